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
      "engine_args": {...},                 # extra vllm.LLM(...) kwargs
      "batches": [[[id, ...], ...], ...]    # llm.generate() calls, in order: prompts
    }

Each prompt of batch ``b`` publishes under the payload key ``"b{b}.p{i}"`` (created here,
as the orchestrator does; its failure key is ``"b{b}.p{i}.err"``); ``max_tokens=1``.

Output: the last stdout line is ``{"batches": [{"keys": [...], "token_ids": [[...], ...],
"finished": [...]}, ...], "steps": [[num_requests, num_tokens], ...] or None,
"init_s": ..., "total_s": ...}``; ``steps`` lists the worker's steps with tokens
(only when the engine core runs in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
or ``{"error": traceback}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

QWEN3_OMNI_YAML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                               "stage_configs", "qwen3_omni_moe.yaml")
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


def run(spec: dict) -> dict:
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from vllm_omni_plugin.config.settings import OmniSettings
    from vllm_omni_plugin.extra_args import PAYLOAD
    from vllm_omni_plugin.models.qwen3_omni.code2wav import Qwen3OmniCode2WavStage
    from vllm_omni_plugin.payload_store import PayloadStore

    start = time.perf_counter()
    model = spec["model"]
    # what the stage launcher (engine/stages.py) merges into the stage's hf_overrides
    overrides = Qwen3OmniCode2WavStage.engine_hf_overrides(AutoConfig.from_pretrained(model))
    engine_args = {
        **BASE_ENGINE_ARGS,
        "hf_overrides": {"architectures": [ARCH], **overrides},
        "additional_config": OmniSettings(
            stage_configs_path=QWEN3_OMNI_YAML, stage_id=STAGE_ID, entry=False,
            payload_dir=spec["payload_dir"]).additional_config(),
        **spec.get("engine_args", {}),
    }
    store = PayloadStore(spec["payload_dir"])
    llm = LLM(model, **engine_args)
    init_s = time.perf_counter() - start
    batches = []
    for b, prompts in enumerate(spec["batches"]):
        keys = [f"b{b}.p{i}" for i in range(len(prompts))]
        for key in keys:
            store.create(key)  # the consumer opens keys; the worker only writes
        params = [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                                 extra_args={PAYLOAD: {"out": key, "err": f"{key}.err"}})
                  for key in keys]
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                            use_tqdm=False)
        batches.append({
            "keys": keys,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "finished": [bool(o.finished) for o in outs],
        })
    result = {"batches": batches, "steps": STEPS, "init_s": round(init_s, 2),
              "total_s": round(time.perf_counter() - start, 2)}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1] if len(argv) > 1 else sys.stdin.read())
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        _observe_steps()  # the worker runs in this process
    try:
        result = run(spec)
    except Exception:
        traceback.print_exc()
        result = {"error": traceback.format_exc()[-6000:]}
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
