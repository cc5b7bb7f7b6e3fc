"""The Qwen3-Omni pipeline under vLLM's GPU defaults, checked against HF transformers on
the same device: what a maintainer with a GPU and PyPI's ``vllm`` runs
(``bash scripts/gpu_check.sh``), and, with ``--cpu``, its dry run on vLLM's CPU build
(CI runs it: ``plugin_tests/engine/test_gpu_check.py``).

Each case is one run of the engine script ``plugin_tests/engine/scripts/omni_pipeline.py``
(the shipped ``vllm_omni_plugin/stage_configs/qwen3_omni_moe.yaml``, three EngineCores, the tiny
checkpoint; the talker at :data:`~plugin_tests.engine.pipeline_reference.TALKER_FRAMES`
frames) with nothing set that vLLM's defaults decide: on a GPU the thinker runs on the
V2 model runner with CUDA graphs and async scheduling, the talker and code2wav eager as
the YAML says. Cases (:data:`CASES`):

* ``fp32``: float32;
* ``bf16``: bfloat16, what GPU users run (on vLLM's CPU build only where the CPU has
  AVX-512 BF16 or AMX);
* ``tp2``: float32, the thinker on tensor parallelism 2 (two GPUs; on the CPU build, two
  cores, one a rank).

Every served answer (the parity requests alone and 8 at once, and streamed) is compared
with HF transformers teacher-forced along it on the same device and dtype
(:func:`~plugin_tests.engine.pipeline_reference.agreement`): each greedy choice the
pipeline made (thinker tokens, the talker's code 0 and its end, codes 1-15) must be HF's
own or trail HF's top logit by less than the dtype's near-tie gap (``NEAR_TIES``), and
the waveform must be HF's decode of the same codes. Forcing HF along the served answer
compares all of it: a near-tie flipped by rounding does not end the comparison. The
report (one screen) gives per case what vLLM chose for each stage (model runner, CUDA
graph mode, async scheduling, TP, dtype), how many choices were HF's own and the
largest gap of those that were not.
Exit status 0 when every case ran and agreed.

    python -m plugin_tests.gpu_check                      # every case on the GPU
    python -m plugin_tests.gpu_check --cpu --cases bf16   # vLLM's CPU build
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import yaml


class Case(NamedTuple):
    """One configuration of the pipeline."""

    name: str
    dtype: str
    thinker_tp: int = 1


CASES = (Case("fp32", "float32"), Case("bf16", "bfloat16"), Case("tp2", "float32", 2))

#: Max |served - HF's decode of the same codes| of a waveform, per dtype and device.
#: float32 on the CPU: rounding only (7.5e-8 observed, TP 2). On a GPU, cuDNN's
#: convolutions may use TF32 (torch's default, in HF's code2wav and the stage's alike):
#: float32's bound there is that of TF32's 10-bit mantissa. bfloat16: 9.8e-4 observed on
#: vLLM's CPU build (AVX-512 BF16, vLLM 0.32).
WAVEFORM_ATOL = {("float32", "cpu"): 1e-5, ("float32", "cuda"): 1e-3,
                 ("bfloat16", "cpu"): 1e-2, ("bfloat16", "cuda"): 1e-2}

#: the engine script's answers: (report key of their thinker tokens, the .npz of their
#: codes and waveforms)
_SERVED = (("thinker_tokens", "served.npz"), ("streamed_thinker_tokens", "streamed.npz"))


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX-512 BF16 or AMX), where vLLM's
    CPU build runs bfloat16 models at speed."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def skip_reason(case: Case, device: str) -> str | None:
    """Why ``case`` cannot run on this host, or None."""
    if case.thinker_tp > 1:
        if device == "cuda":
            import torch

            if torch.cuda.device_count() < case.thinker_tp:
                return f"needs {case.thinker_tp} GPUs, {torch.cuda.device_count()} visible"
        elif len(os.sched_getaffinity(0)) < case.thinker_tp:
            return f"needs {case.thinker_tp} CPU cores"
    if case.dtype == "bfloat16" and device == "cpu" and not cpu_has_bf16():
        return "this CPU has neither AVX-512 BF16 nor AMX"
    return None


def case_yaml(case: Case, root: Path, device: str) -> str:
    """The shipped pipeline for ``case``: the talker at TALKER_MAX_TOKENS, the thinker on
    ``case.thinker_tp`` ranks (on the CPU build placed on that many cores)."""
    from plugin_tests.conftest import QWEN3_OMNI_YAML
    from plugin_tests.engine.pipeline_reference import TALKER_MAX_TOKENS

    with open(QWEN3_OMNI_YAML) as f:
        pipeline = yaml.safe_load(f)
    pipeline["stages"][1]["default_sampling_params"]["max_tokens"] = TALKER_MAX_TOKENS
    if case.thinker_tp > 1:
        thinker = pipeline["stages"][0]
        thinker["engine_args"]["tensor_parallel_size"] = case.thinker_tp
        if device == "cpu":
            cores = sorted(os.sched_getaffinity(0))[:case.thinker_tp]
            thinker["runtime"] = {"devices": ",".join(map(str, cores))}
    path = root / f"{case.name}.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    return str(path)


def check_case(case: Case, ckpt: str, root: Path, device: str, scenarios: list[str]) -> dict:
    """Run ``case`` and compare every answer with HF's teacher-forced along it:
    ``{"settings": {stage: {...}}, "answers": n, "agreed": n, "choices": n, "exact": n,
    "worst": {kind: gap}, "waveform_err": worst, "problems": [...]}``."""
    import torch

    from plugin_tests.engine.pipeline_reference import (
        agreement,
        hf_model,
        hf_speak,
        run_script,
    )

    out = root / case.name
    out.mkdir()
    gpu_memory_utilization = "0.25" if device == "cuda" else "0.3"
    report, _ = run_script(ckpt, case_yaml(case, root, device), out, scenarios,
                           options=("--dtype", case.dtype, "--gpu-memory-utilization",
                                    gpu_memory_utilization))
    model, eos = hf_model(ckpt, case.dtype, device)
    prompts = report["prompt_ids"]
    atol = WAVEFORM_ATOL[(case.dtype, device)]
    result = {"settings": report["settings"], "answers": 0, "agreed": 0, "choices": 0,
              "exact": 0, "worst": {}, "waveform_err": 0.0, "problems": []}
    compared = {}  # (prompt, tokens, codes) -> Agreement: identical answers compare once
    for tokens_key, npz in _SERVED:
        if tokens_key not in report:
            continue
        served = np.load(out / npz)
        for name, tokens in report[tokens_key].items():
            kind, i = name.rsplit("_", 1)
            if kind == "text":  # the text-only twin of a solo request: tokens only
                continue
            prompt = prompts[int(i) % len(prompts)]
            codes, wav = served[f"{kind}_codes_{i}"], served[f"{kind}_waveform_{i}"]
            key = (tuple(prompt), tuple(tokens), codes.tobytes())
            if key not in compared:
                forced = hf_speak(model, eos, force=(tokens, codes),
                                  input_ids=torch.tensor([prompt]))
                compared[key] = agreement(tokens, codes, wav, forced, model, case.dtype, atol)
            got = compared[key]
            result["answers"] += 1
            result["agreed"] += not got.problem
            result["choices"] += got.choices
            result["exact"] += got.exact
            for kind_of_choice, gap in got.worst.items():
                result["worst"][kind_of_choice] = max(result["worst"].get(kind_of_choice, 0.0),
                                                      gap)
            result["waveform_err"] = max(result["waveform_err"], got.waveform_err)
            if got.problem:
                result["problems"].append(f"{npz.split('.')[0]} {name}: {got.problem}")
    return result


def _short(settings: dict) -> str:
    runner = ", ".join(name.rsplit(".", 3)[-3] + "." + name.rsplit(".", 1)[-1]
                       for name in settings["model_runner"])
    mode = settings["cudagraph_mode"].removeprefix("CUDAGraphMode.")
    return (f"{runner}; graphs {mode}; async {'on' if settings['async_scheduling'] else 'off'}; "
            f"TP {settings['tensor_parallel_size']}; {settings['dtype']}")


def render(results: dict, device: str) -> str:
    """The one-screen report of :func:`main`'s results."""
    lines = [f"gpu_check on {device}: the tiny Qwen3-Omni pipeline vs HF, greedy", ""]
    for name, result in results.items():
        if "skipped" in result:
            lines.append(f"{name:5} SKIPPED: {result['skipped']}")
            continue
        if "error" in result:
            lines.append(f"{name:5} FAILED to run: {result['error'].splitlines()[0]}")
            continue
        verdict = "ok" if result["agreed"] == result["answers"] else "FAILED"
        worst = ", ".join(f"{kind} {gap:.1e}" for kind, gap in result["worst"].items())
        lines.append(f"{name:5} {verdict}: {result['agreed']}/{result['answers']} answers "
                     f"agree with HF; {result['exact']}/{result['choices']} greedy choices "
                     f"HF's own, largest gap to HF's: {worst}; waveform "
                     f"{result['waveform_err']:.1e}")
        for stage, settings in sorted(result["settings"].items()):
            lines.append(f"      stage {stage}: {_short(settings)}")
        lines.extend(f"      {problem}" for problem in result["problems"][:5])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true",
                        help="dry run on vLLM's CPU build (HF on the CPU too)")
    parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES],
                        default=[c.name for c in CASES])
    parser.add_argument("--scenarios", nargs="+", choices=["parity", "streamed"],
                        default=["parity", "streamed"],
                        help="the engine script's scenarios each case serves")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--out", type=Path,
                        help="keep each case's pipeline YAML, engine logs and answers here "
                             "(default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    from plugin_tests.conftest import cached_tiny_checkpoint

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device is visible (torch.cuda.is_available() is False); "
                         "--cpu runs the dry run on vLLM's CPU build")
    ckpt = cached_tiny_checkpoint("qwen3-omni")
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for case in CASES:
            if case.name not in args.cases:
                continue
            if reason := skip_reason(case, device):
                results[case.name] = {"skipped": reason}
                continue
            print(f"[gpu_check] case {case.name} ...", file=sys.stderr, flush=True)
            try:
                results[case.name] = check_case(case, ckpt, root, device, args.scenarios)
            except BaseException as exc:  # pytest.fail's Failed is a BaseException
                if isinstance(exc, KeyboardInterrupt):
                    raise
                print(f"[gpu_check] case {case.name} failed: {exc}", file=sys.stderr)
                results[case.name] = {"error": str(exc)}
    print(render(results, device))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    ran = [r for r in results.values() if "skipped" not in r]
    return 0 if ran and all("error" not in r and r["agreed"] == r["answers"]
                            for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
