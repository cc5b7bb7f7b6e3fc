"""The memory plans shipped as built-in pipelines (``stage_configs/``,
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


def main(argv: list[str]) -> int:
    from plugin_tests.released_checkpoints import write_released_config
    from vllm_omni_plugin.config.pipelines import BUILTIN_DIR
    from vllm_omni_plugin.tools.plan import plan_from_args, render

    with tempfile.TemporaryDirectory() as root:
        dirs = {name: write_released_config(name, os.path.join(root, name))
                for name in ("qwen3_omni", "bagel")}
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
