"""Run a real vLLM engine on a Qwen3-Omni checkpoint's code2wav stage; print JSON results.

Run as a subprocess by ``plugin_tests/engine/test_code2wav_engine.py`` (vLLM resolves its
platform and model-runner choice when first imported). The engine is vLLM's own worker
and model runner (``OmniWorker``: the platform's worker plus the stage payload channel)
running the code2wav stage architecture (``OmniPluginQwen3OmniCode2Wav``), as stage 2 of
the Qwen3-Omni pipeline YAML, publishing into a payload store.

Input: a JSON spec as ``argv[1]`` (or on stdin when no argument is given)::

    {
      "model": "/path/to/checkpoint",
      "payload_dir": "/path/to/store",
      "engines": [                              # run one after another
        {
          "name": "default",
          "engine_args": {...},                 # extra vllm.LLM(...) kwargs
          "batches": [[[id, ...], ...], ...],   # llm.generate() calls, in order: prompts
                                                # (or {"ids": [...], "left_context": c,
                                                # "stream": [key, first, last]}: a chunk
                                                # of a streamed request; "stream" optional)
          "probe": true                         # optional: see probe_model
        }
      ]
    }

Each prompt ``i`` of batch ``b`` publishes under the payload key ``"{name}.b{b}.p{i}"``
(created here, as the orchestrator does; its failure key is that key plus ``".err"``; a
chunk's input payload goes under that key plus ``".in"``); ``max_tokens=1``.

Output: the last stdout line is ``{"engines": {name: result}}`` where ``result`` is
``{"batches": [{"keys": [...], "token_ids": [[...], ...], "finished": [...]}, ...],
"steps": [[num_requests, num_tokens], ...] or None, "streams": ..., "init_s": ...,
"total_s": ...}`` (``streams``: the stream states the model holds at the end)
(``steps``: the worker's steps with tokens, only when the engine core runs in this
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or ``{"error": traceback}`` when that
engine failed (the others still run); with ``"probe"`` it also holds ``"probe"``, what
:func:`probe_model` returned, and in it ``"memory_profile"``, what
``_engines.memory_profile_calls`` returned for the whole decoder (the calls the engine's
start-up made: needs the engine core in this process).
"""

from __future__ import annotations

import gc
import sys
import time

from _engines import StartupCalls, memory_profile_calls, run_engines

from vllm_omni_plugin.config.pipelines import builtin_pipeline

QWEN3_OMNI_YAML = builtin_pipeline("qwen3_omni_moe")
ARCH = "OmniPluginQwen3OmniCode2Wav"
STAGE_ID = 2

BASE_ENGINE_ARGS = {
    "worker_cls": "vllm_omni_plugin.worker.omni_worker.OmniWorker",
    "skip_tokenizer_init": True,      # prompts are code ids; the output token is a dummy
    "generation_config": "vllm",      # the checkpoint's generation config is the thinker's
    "dtype": "float32",
    "enforce_eager": True,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,  # a request's codes arrive in one step
    "seed": 0,
    # On vLLM's CPU build this is the share of host memory the engine may reserve
    # (checked against free memory at start-up); the model has no KV cache.
    "gpu_memory_utilization": 0.2,
}

#: (num requests, num tokens) of every step the worker executed with tokens
STEPS: list[list[int]] | None = None


def _observe_steps() -> None:
    global STEPS
    from vllm_omni_plugin.worker.omni_worker import OmniWorkerMixin

    STEPS = []
    inner = OmniWorkerMixin.execute_model

    def execute_model(worker, scheduler_output):
        if scheduler_output.total_num_scheduled_tokens:
            STEPS.append([len(scheduler_output.num_scheduled_tokens),
                          scheduler_output.total_num_scheduled_tokens])
        return inner(worker, scheduler_output)

    OmniWorkerMixin.execute_model = execute_model


def probe_model(model) -> dict:
    """Drive the engine's model (inside its worker) through steps vLLM's scheduler does not
    produce for it: rows of a prompt split over steps (the engine core turns chunked
    prefill off for a model without KV cache), next to a whole prompt; then a forward
    outside any step (vLLM's dummy runs)."""
    import torch

    from vllm_omni_plugin.worker.stage_io import ScheduledRequest

    class Step:  # the StageStep interface the model uses
        def __init__(self, rows):
            self.rows, self.failures = rows, {}

        def requests(self):
            return self.rows

        def inputs(self, req_id):
            return {}

        def failed(self, req_id):
            return req_id in self.failures

        def fail(self, req_id, exc):
            self.failures[req_id] = f"{type(exc).__name__}: {exc}"

    cfg = model.config
    device = next(model.parameters()).device
    frame = torch.arange(cfg.num_quantizers, device=device) * cfg.codebook_size  # codes 0
    ids = frame.repeat(5 + 3 + 5)
    step = Step([ScheduledRequest("split-first", 0, 64, 0, 80),
                 ScheduledRequest("whole", 64, 48, 0, 48),
                 ScheduledRequest("split-rest", 112, 16, 64, 80)])
    model.stage_step = step
    try:
        hidden = model(ids[:128], torch.arange(128, device=device))
    finally:
        model.stage_step = None
    outputs = {k: {n: list(t.shape) for n, t in v.items()}
               for k, v in model.stage_output_requests().items()}
    dummy = model(ids, torch.arange(ids.numel(), device=device))
    return {"failures": step.failures, "outputs": outputs, "hidden": list(hidden.shape),
            "dummy": list(dummy.shape), "dummy_zero": bool((dummy == 0).all()),
            "dummy_outputs": len(model.stage_output_requests()),
            "logits": list(model.compute_logits(hidden[:2]).shape)}


def run(model: str, payload_dir: str, spec: dict) -> dict:
    import torch
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from vllm_omni_plugin.config.settings import OmniSettings
    from vllm_omni_plugin.extra_args import PAYLOAD
    from vllm_omni_plugin.models.qwen3_omni.code2wav import (
        LEFT_CONTEXT_INPUT,
        STREAM_INPUT,
        Qwen3OmniCode2WavStage,
    )
    from vllm_omni_plugin.payload_store import PayloadStore

    if STEPS is not None:
        STEPS.clear()
    start = time.perf_counter()
    # what the stage launcher (replicas/engines.py) merges into the stage's hf_overrides
    overrides = Qwen3OmniCode2WavStage.engine_hf_overrides(AutoConfig.from_pretrained(model))
    engine_args = {
        **BASE_ENGINE_ARGS,
        "hf_overrides": {"architectures": [ARCH], **overrides},
        "additional_config": OmniSettings(
            stage_configs_path=QWEN3_OMNI_YAML, stage_id=STAGE_ID, entry=False,
            payload_dir=payload_dir).additional_config(),
        **spec.get("engine_args", {}),
    }
    store = PayloadStore(payload_dir)
    startup = StartupCalls()
    try:
        llm = LLM(model, **engine_args)
    finally:
        startup.stop()
    init_s = time.perf_counter() - start
    batches = []
    for b, prompts in enumerate(spec["batches"]):
        keys = [f"{spec['name']}.b{b}.p{i}" for i in range(len(prompts))]
        params = []
        for key, prompt in zip(keys, prompts, strict=True):
            store.create(key)  # the consumer opens keys; the worker only writes
            slots = {"out": key, "err": f"{key}.err"}
            if isinstance(prompt, dict):
                inputs = {LEFT_CONTEXT_INPUT: torch.tensor([prompt["left_context"]],
                                                           dtype=torch.long)}
                if "stream" in prompt:
                    inputs[STREAM_INPUT] = torch.tensor(prompt["stream"], dtype=torch.long)
                store.put(f"{key}.in", inputs)
                slots["in"] = f"{key}.in"
            params.append(SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                                         extra_args={PAYLOAD: slots}))
        outs = llm.generate([{"prompt_token_ids": list(p["ids"] if isinstance(p, dict) else p)}
                             for p in prompts], params, use_tqdm=False)
        batches.append({
            "keys": keys,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "finished": [bool(o.finished) for o in outs],
        })
    probe = llm.apply_model(probe_model)[0] if spec.get("probe") else None
    if probe is not None:
        probe["memory_profile"] = llm.collective_rpc(
            memory_profile_calls, args=(lambda model: {"decoder": model.code2wav},
                                        startup.calls))[0]
    streams = llm.apply_model(lambda model: len(model._streams))[0]
    result = {"batches": batches, "probe": probe, "streams": streams,
              "steps": list(STEPS) if STEPS is not None else None,
              "init_s": round(init_s, 2), "total_s": round(time.perf_counter() - start, 2)}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


if __name__ == "__main__":
    sys.exit(run_engines(
        sys.argv, lambda spec, engine: run(spec["model"], spec["payload_dir"], engine),
        in_process=_observe_steps))
