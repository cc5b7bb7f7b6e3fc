"""Child process of ``unit/test_released_checkpoints.py``: build stage models of a
released checkpoint (Qwen3-Omni-30B-A3B-Instruct or BAGEL-7B-MoT) on the meta device, as
the head configures their engines from the shipped pipeline, and feed each loader every
tensor of the vendored listing (meta tensors of the listed shape, bf16), as vLLM's loader
feeds every file's. Prints one JSON object per stage: ``{"stage", "params", "loaded",
"error", "bad_shape_error"}`` (``bad_shape_error``: the loader's error when tensor
``KEY`` is a row too long).

A process of its own: vLLM's distributed state (one gloo rank) is process-global.

    python -m plugin_tests.meta_load PIPELINE CONFIG_DIR STAGE:KEY [STAGE:KEY ...]
"""

from __future__ import annotations

import json
import sys


def _engine_config(stage, pipeline: str, config_dir: str):
    from vllm_omni_plugin.config.pipelines import builtin_pipeline
    from vllm_omni_plugin.config.settings import OmniSettings
    from vllm_omni_plugin.engine.stages import stage_engine_config

    settings = OmniSettings(stage_configs_path=builtin_pipeline(pipeline))
    return stage_engine_config(stage, {"model": config_dir, "dtype": "bfloat16",
                                             "skip_tokenizer_init": True}, settings)


def _build(stage, vllm_config):
    import torch
    from vllm.config import set_current_vllm_config

    from vllm_omni_plugin.models import stage_model_class

    cls = stage_model_class(stage.engine_args["hf_overrides"]["architectures"][0])
    with set_current_vllm_config(vllm_config), torch.device("meta"):
        return cls(vllm_config=vllm_config)


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


def main(argv: list[str]) -> int:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    import vllm_omni_plugin
    from plugin_tests.released_checkpoints import bagel_tensors, qwen3_omni_tensors
    from vllm_omni_plugin.config.loader import load_pipeline_config
    from vllm_omni_plugin.config.pipelines import builtin_pipeline

    pipeline_name, config_dir = argv[0], argv[1]
    wanted = dict(arg.split(":", 1) for arg in argv[2:])
    vllm_omni_plugin.register()
    pipeline = load_pipeline_config(builtin_pipeline(pipeline_name))
    stages = [next(s for s in pipeline.stages if s.name == name) for name in wanted]
    configs = [_engine_config(stage, pipeline_name, config_dir) for stage in stages]
    with set_current_vllm_config(configs[0]):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{get_open_port()}", 0, "gloo")
        initialize_model_parallel(1, 1)
    tensors = bagel_tensors() if pipeline_name == "bagel" else qwen3_omni_tensors()
    for (name, bad_key), stage, vllm_config in zip(wanted.items(), stages, configs,
                                                   strict=True):
        result = {"stage": name, "error": None, "bad_shape_error": None}
        model = _build(stage, vllm_config)
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
