"""Run real vLLM engines (reference backend) on a thinker checkpoint; print JSON results.

Run as a subprocess by ``plugin_tests/test_reference_backend.py``: the platform is
resolved when vLLM is first imported, so ``VLLM_OMNI_PLUGIN_BACKEND=reference`` must be
in the environment before this process starts.

Input: a JSON spec as ``argv[1]`` (or on stdin when no argument is given)::

    {
      "model": "/path/to/checkpoint",
      "engines": [                                  # run one after another
        {
          "name": "default",
          "engine_args": {...},                     # extra vllm.LLM(...) kwargs
          "batches": [                              # llm.generate() calls, in order
            {"prompts": [[1, 2, 3], ...], "max_tokens": 16}
          ]
        }
      ]
    }

Every engine is built with the thinker stage architecture, float32, eager mode and
stats logging on. Each batch is one ``llm.generate`` call with greedy decoding and
``ignore_eos=True``, so each request yields exactly ``max_tokens`` tokens.

Output: the last stdout line is ``{"engines": {name: result}}`` where ``result`` is
``{"batches": [{"token_ids": [[...], ...], "num_cached_tokens": [...]}, ...],
"metrics": {counter name: value}}`` (counters and gauges from ``llm.get_metrics()``),
or ``{"error": traceback}`` when that engine failed (the others still run).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

ARCH = "OmniPluginQwen3OmniThinker"

BASE_ENGINE_ARGS = {
    "hf_overrides": {"architectures": [ARCH]},
    "max_model_len": 512,
    "dtype": "float32",
    "enforce_eager": True,
    "disable_log_stats": False,
    "seed": 0,
}


def _metrics(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter, Gauge

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if isinstance(m, (Counter, Gauge)):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def run_engine(model: str, spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **{**BASE_ENGINE_ARGS, **spec.get("engine_args", {})})
    init_s = time.perf_counter() - start
    batches = []
    for batch in spec["batches"]:
        params = SamplingParams(temperature=0.0, max_tokens=batch["max_tokens"], ignore_eos=True)
        prompts = [{"prompt_token_ids": list(p)} for p in batch["prompts"]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        batches.append({
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs],
        })
    result = {
        "batches": batches,
        "metrics": _metrics(llm),
        "init_s": round(init_s, 2),
        "total_s": round(time.perf_counter() - start, 2),
    }
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1] if len(argv) > 1 else sys.stdin.read())
    if os.environ.get("VLLM_OMNI_PLUGIN_BACKEND") != "reference":
        print("warning: VLLM_OMNI_PLUGIN_BACKEND is not 'reference'", file=sys.stderr)
    results = {}
    for engine in spec["engines"]:
        try:
            results[engine["name"]] = run_engine(spec["model"], engine)
        except Exception:  # report it, run the other engines
            traceback.print_exc()
            results[engine["name"]] = {"error": traceback.format_exc()[-4000:]}
        print(f"engine {engine['name']!r} done", file=sys.stderr, flush=True)
    sys.stdout.flush()
    print(json.dumps({"engines": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
