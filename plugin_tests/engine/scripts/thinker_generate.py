"""Run real vLLM engines on a Qwen3-Omni checkpoint's thinker stage; print JSON results.

Run as a subprocess by ``plugin_tests/engine/test_thinker_engine.py`` (vLLM resolves its
platform and model-runner choice when first imported). Every engine is vLLM's own
worker and model runner (``OmniWorker``: the platform's worker plus the stage payload
channel) running the thinker stage architecture (vLLM's Qwen3-Omni thinker class).

Input: a JSON spec as ``argv[1]`` (or on stdin when no argument is given)::

    {
      "model": "/path/to/checkpoint",
      "engines": [                                  # run one after another
        {
          "name": "default",
          "engine_args": {...},                     # extra vllm.LLM(...) kwargs
          "batches": [                              # llm.generate() calls, in order
            {"prompts": [[1, 2, 3], ...], "max_tokens": 16,   # or one per prompt
             "extra_args": [{...} or null, ...]}    # optional: raw extra_args per prompt
          ]
        }
      ]
    }

An engine may add ``"payload_dir": DIR`` and a batch ``"publish": true``: each
request then publishes the thinker's hidden states under the payload key
``"{engine}.b{batch}.p{prompt}"`` in DIR (listed as ``payload_keys``).

Every engine is built with the thinker stage architecture and the plugin's worker,
float32, eager mode and stats logging on. Each batch is one ``llm.generate`` call with
greedy decoding and ``ignore_eos=True``, so each request yields exactly ``max_tokens``
tokens.

Output: the last stdout line is ``{"engines": {name: result}}`` where ``result`` is
``{"batches": [{"token_ids": [[...], ...], "num_cached_tokens": [...],
"metrics": {...}}, ...], "metrics": {counter name: value}, "scheduler": {...}}``
(counters and gauges from ``llm.get_metrics()``, a batch's as they stood after it;
what the scheduler asked of the worker, see :class:`SchedulerObserver`, or None when
the engine core runs in another process, i.e. unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
or ``{"error": traceback}`` when that engine failed (the others still run).
"""

from __future__ import annotations

import gc
import sys
import time

from _engines import run_engines

from vllm_omni_plugin.config.pipelines import builtin_pipeline

#: The pipeline whose thinker stage the engines run (settings only: the worker
#: reads its stage id and payload directory).
QWEN3_OMNI_YAML = builtin_pipeline("qwen3_omni_moe")

ARCH = "OmniPluginQwen3OmniThinker"

BASE_ENGINE_ARGS = {
    "hf_overrides": {"architectures": [ARCH]},
    "worker_cls": "vllm_omni_plugin.worker.omni_worker.OmniWorker",
    "max_model_len": 512,
    "dtype": "float32",
    "enforce_eager": True,
    "disable_log_stats": False,
    "seed": 0,
    # On vLLM's CPU build this is the share of host memory the engine may reserve
    # (checked against free memory at start-up); the KV cache is sized explicitly.
    "gpu_memory_utilization": 0.2,
}


class SchedulerObserver:
    """Counts what the scheduler asked of the worker (engine core in this process only).

    Wraps ``OmniWorkerMixin.execute_model`` so tests can check that a scenario really
    exercised chunked prefill or preemption/resumption.
    """

    def __init__(self) -> None:
        self.installed = False
        self.reset()

    def reset(self) -> None:
        self.stats = {
            "steps": 0,
            "max_step_tokens": 0,
            "partial_prefills": 0,       # slices ending before the known tokens
            "new_with_computed": 0,      # new requests starting at num_computed > 0
            "resumed": 0,                # preempted requests scheduled again
            "resumed_with_computed": 0,  # ... with some KV reused from the prefix cache
            "resumed_as_new": 0,         # ... sent as new requests (V2 protocol)
            "resumed_partial": 0,        # ... whose recompute was chunked
        }
        self.resumed_ids: set[str] = set()
        #: req id -> tokens the request must have fed before it samples (prompt, or
        #: prompt + generated when resumed)
        self.lengths: dict[str, int] = {}

    def install(self) -> None:
        from vllm_omni_plugin.worker.omni_worker import OmniWorkerMixin

        observer, inner = self, OmniWorkerMixin.execute_model

        def execute_model(worker, scheduler_output):
            try:
                observer.observe(worker, scheduler_output)
            except Exception as exc:  # never break the engine; the test sees it
                observer.stats["observer_error"] = repr(exc)
            return inner(worker, scheduler_output)

        OmniWorkerMixin.execute_model = execute_model
        self.installed = True

    def observe(self, worker, so) -> None:
        st = self.stats
        known = self.lengths
        total = {}
        for new in so.scheduled_new_reqs:
            tokens = new.prefill_token_ids if new.prefill_token_ids is not None else (
                new.prompt_token_ids or [])
            total[new.req_id] = (new.num_computed_tokens, len(tokens))
            resumed = new.req_id in known or len(tokens) > len(new.prompt_token_ids or [])
            known[new.req_id] = len(tokens)
            if resumed:
                self.resumed_ids.add(new.req_id)
                st["resumed"] += 1
                st["resumed_as_new"] += 1
                st["resumed_with_computed"] += new.num_computed_tokens > 0
            elif new.num_computed_tokens > 0:
                st["new_with_computed"] += 1
        cached = so.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if req_id in cached.resumed_req_ids:
                self.resumed_ids.add(req_id)
                st["resumed"] += 1
                st["resumed_with_computed"] += computed > 0
                total[req_id] = (computed, len(cached.all_token_ids[req_id]))
                known[req_id] = total[req_id][1]
            else:
                total[req_id] = (computed, known.get(req_id, 0))
        for req_id, n in so.num_scheduled_tokens.items():
            computed, length = total.get(req_id, (0, 0))
            if computed + n < length:
                st["partial_prefills"] += 1
                st["resumed_partial"] += req_id in self.resumed_ids
        if so.total_num_scheduled_tokens:
            st["steps"] += 1
            st["max_step_tokens"] = max(st["max_step_tokens"], so.total_num_scheduled_tokens)


OBSERVER = SchedulerObserver()


def _metrics(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter, Gauge

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if isinstance(m, (Counter, Gauge)):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def run_engine(model: str, spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_omni_plugin.config.settings import OmniSettings
    from vllm_omni_plugin.extra_args import PAYLOAD
    from vllm_omni_plugin.payload_store import PayloadStore

    OBSERVER.reset()
    start = time.perf_counter()
    engine_args = {**BASE_ENGINE_ARGS, **spec.get("engine_args", {})}
    if spec.get("payload_dir"):  # the thinker stage of the pipeline, publishing hidden states
        engine_args["additional_config"] = OmniSettings(
            stage_configs_path=QWEN3_OMNI_YAML, stage_id=0, entry=False,
            payload_dir=spec["payload_dir"]).additional_config()
    store = PayloadStore(spec["payload_dir"]) if spec.get("payload_dir") else None
    llm = LLM(model, **engine_args)
    init_s = time.perf_counter() - start
    batches = []
    for batch in spec["batches"]:
        prompts = [{"prompt_token_ids": list(p)} for p in batch["prompts"]]
        max_tokens = batch["max_tokens"]
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        keys = [f"{spec['name']}.b{len(batches)}.p{i}" if batch.get("publish") else None
                for i in range(len(prompts))]
        for key in filter(None, keys):
            store.create(key)  # the consumer opens keys; the worker only writes
        raw = batch.get("extra_args") or [None] * len(prompts)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                 extra_args={**(x or {}), **({PAYLOAD: {"out": k}} if k else {})}
                                 or None)
                  for n, k, x in zip(max_tokens, keys, raw, strict=True)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        batches.append({
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs],
            "payload_keys": keys,
            "metrics": _metrics(llm),
        })
    result = {
        "batches": batches,
        "metrics": _metrics(llm),
        "scheduler": dict(OBSERVER.stats) if OBSERVER.installed else None,
        "init_s": round(init_s, 2),
        "total_s": round(time.perf_counter() - start, 2),
    }
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


if __name__ == "__main__":
    sys.exit(run_engines(sys.argv, lambda spec, engine: run_engine(spec["model"], engine),
                         in_process=OBSERVER.install))
