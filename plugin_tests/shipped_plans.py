"""The memory plans shipped as built-in pipelines (``vllm_omni_plugin/stage_configs/``,
``*_1xh100.yaml`` and the like), as ``python -m vllm_omni_plugin.tools.plan`` writes them
for the released checkpoints (their configs derived from the vendored listing and facts:
:mod:`plugin_tests.released_checkpoints`).

    python -m plugin_tests.shipped_plans          # print {name: YAML} as JSON
    python -m plugin_tests.shipped_plans --write  # rewrite the shipped files

A process of its own: building models needs vLLM's process-global distributed state.
GPU sizes are what ``nvidia-smi`` reports: an H100 80GB 81,559 MiB (79.6 GiB), an H200
143,771 MiB (140 GiB).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

#: built-in name -> (checkpoint, the plan tool's arguments after MODEL)
SHIPPED = {
    "qwen3_omni_moe_2xh100": ("qwen3_omni", ["--pipeline", "qwen3_omni_moe", "--devices",
                                             "2x79.6", "--max-model-len", "32768"]),
    "qwen3_omni_moe_1xh200": ("qwen3_omni", ["--pipeline", "qwen3_omni_moe", "--devices",
                                             "1x140", "--max-model-len", "32768"]),
    "qwen3_omni_moe_fp8_1xh100": ("qwen3_omni", [
        "--pipeline", "qwen3_omni_moe", "--devices", "1x79.6", "--max-model-len", "32768",
        "--quantization", "thinker=fp8"]),
    "bagel_1xh100": ("bagel", ["--pipeline", "bagel", "--devices", "1x79.6"]),
}


def released_config_dirs(root: str) -> dict[str, str]:
    """Directories under ``root`` with each released checkpoint's derived
    ``config.json`` (and, for BAGEL, a tokenizer with Qwen2.5's special tokens: the
    DiT reads its image markers' ids from it)."""
    from plugin_tests.released_checkpoints import bagel_config, qwen3_omni_config
    from vllm_omni_plugin.models.bagel.tiny_checkpoint import BAGEL_SPECIAL_TOKENS
    from vllm_omni_plugin.tools.tiny_tokenizer import QWEN25_ADDED_TOKENS, build_qwen_tokenizer

    dirs = {}
    for name, config in (("qwen3_omni", qwen3_omni_config()), ("bagel", bagel_config())):
        dirs[name] = os.path.join(root, name)
        os.makedirs(dirs[name], exist_ok=True)
        with open(os.path.join(dirs[name], "config.json"), "w") as f:
            json.dump(config, f)
    build_qwen_tokenizer(QWEN25_ADDED_TOKENS, BAGEL_SPECIAL_TOKENS).save_pretrained(
        dirs["bagel"])
    return dirs


def main(argv: list[str]) -> int:
    from vllm_omni_plugin.config.pipelines import BUILTIN_DIR
    from vllm_omni_plugin.tools.plan import plan_from_args, render

    with tempfile.TemporaryDirectory() as root:
        dirs = released_config_dirs(root)
        plans = {}
        for name, (checkpoint, args) in SHIPPED.items():
            plan, text = plan_from_args([dirs[checkpoint], *args])
            print(f"== {name}\n{render(plan)}", file=sys.stderr)
            plans[name] = {"yaml": text, "fits": plan.fits, "minimum": plan.minimum,
                           "stages": [dataclasses.asdict(s) for s in plan.stages]}
    if "--write" in argv:
        for name, result in plans.items():
            (BUILTIN_DIR / f"{name}.yaml").write_text(result["yaml"])
    print(json.dumps(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
