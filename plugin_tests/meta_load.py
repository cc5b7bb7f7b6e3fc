"""Child process of ``unit/test_released_checkpoints.py``: build stage models of a
released checkpoint (Qwen3-Omni-30B-A3B-Instruct or BAGEL-7B-MoT) on the meta device, as
the head configures their engines from the shipped pipeline, and feed each loader every
tensor of the vendored listing (meta tensors of the listed shape, bf16), as vLLM's loader
feeds every file's. Prints one JSON object per stage: ``{"pipeline", "stage", "params",
"loaded", "error", "bad_shape_error"}`` (``bad_shape_error``: the loader's error when
tensor ``KEY`` is a row too long).

A process of its own: vLLM's distributed state (one gloo rank) is process-global. Several
pipelines, separated by ``--``, share it (one import of vLLM, about 13 s of CPU).

    python -m plugin_tests.meta_load PIPELINE CONFIG_DIR STAGE:KEY [STAGE:KEY ...] \
        [-- PIPELINE CONFIG_DIR STAGE:KEY ...]
"""

from __future__ import annotations

import json
import sys


def _load(model, vllm_config, tensors, wrong: str | None = None) -> set[str]:
    import torch
    from vllm.config import set_current_vllm_config

    def shape(key):
        dims = tensors[key].shape
        return (dims[0] + 1, *dims[1:]) if key == wrong else dims

    with set_current_vllm_config(vllm_config):
        return set(model.load_weights(
            (key, torch.empty(shape(key), dtype=torch.bfloat16, device="meta"))
            for key in tensors))


def _pipeline(argv: list[str]) -> None:
    """One ``PIPELINE CONFIG_DIR STAGE:KEY ...`` group of :func:`main`'s arguments."""
    from plugin_tests.released_checkpoints import bagel_tensors, qwen3_omni_tensors
    from vllm_omni_plugin.config.loader import load_pipeline_config
    from vllm_omni_plugin.config.pipelines import builtin_pipeline
    from vllm_omni_plugin.tools.plan import build_on_meta, engine_configs, single_rank

    pipeline_name, config_dir = argv[0], argv[1]
    wanted = dict(arg.split(":", 1) for arg in argv[2:])
    path = builtin_pipeline(pipeline_name)
    pipeline = load_pipeline_config(path)
    stages = [next(s for s in pipeline.stages if s.name == name) for name in wanted]
    base = {"model": config_dir, "dtype": "bfloat16", "skip_tokenizer_init": True}
    configs = [config for _, config in engine_configs(pipeline, path, base, stages)]
    single_rank(configs[0])
    tensors = bagel_tensors() if pipeline_name == "bagel" else qwen3_omni_tensors()
    for (name, bad_key), vllm_config in zip(wanted.items(), configs, strict=True):
        result = {"pipeline": pipeline_name, "stage": name, "error": None,
                  "bad_shape_error": None}
        model = build_on_meta(vllm_config)
        result["params"] = sorted(n for n, _ in model.named_parameters())
        try:
            result["loaded"] = sorted(_load(model, vllm_config, tensors))
        except Exception as exc:  # reported to the test, which fails naming it
            result["error"] = f"{type(exc).__name__}: {exc}"
        try:  # loading meta tensors writes nothing: the same model again
            _load(model, vllm_config, tensors, wrong=bad_key)
        except Exception as exc:
            result["bad_shape_error"] = f"{bad_key}: {type(exc).__name__}: {exc}"[:300]
        print(json.dumps(result), flush=True)


def main(argv: list[str]) -> int:
    import vllm_omni_plugin

    vllm_omni_plugin.register()
    group: list[str] = []
    for arg in [*argv, "--"]:
        if arg != "--":
            group.append(arg)
        elif group:
            _pipeline(group)
            group = []
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
