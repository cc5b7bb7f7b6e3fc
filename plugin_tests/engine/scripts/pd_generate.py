"""Prefill/decode disaggregation of the thinker stage between two real vLLM engines.

Run as a subprocess by ``plugin_tests/engine/test_pd_engine.py``. Two engines of the thinker
stage (the plugin's thinker architecture on its ``OmniWorker``, as ``thinker_generate.py``
builds them), each with its engine core in its own process, both running
``OmniMooncakeConnector`` over Mooncake's TCP transport on loopback: ``prefill``
(``kv_role="kv_producer"``, with vLLM's prefix caching, as the shipped PD pipeline's
prefill stage) and ``decode`` (``"kv_consumer"``, without).

Each batch runs one of two ways:

* ``"local"``: the decode engine generates the prompts itself (no ``kv_transfer_params``:
  vLLM's usual path, the reference);
* ``"pd"``: the prompts go to the prefill engine first (one token, ``ignore_eos``,
  ``do_remote_decode``), then to the decode engine with the pairing parameters
  (``do_remote_prefill``, the prefill engine's id, its bootstrap address, one fresh
  ``transfer_id`` per request), which pulls each prompt's KV cache from the prefill engine
  and generates. ``prefill_prompts`` may give the prefill engine other prompts.

Then the same pair goes through the failure cases of ``pd_failures.py`` on
``"failures"``'s prompt (the prefill engine is killed in the last of them).
``timeout_s``: the plugin's transfer timeout of both engines
(``omni_plugin_transfer_timeout_s``; the prefill engine holds a finished request's KV
cache half that long).

Input (``argv[1]`` or stdin)::

    {"model": DIR, "block_size": 32, "max_descs_per_peer": null or N,
     "timeout_s": 4.0,
     "engines": [{"name": "pd"}],
     "batches": [{"mode": "local" | "pd", "prompts": [[ids], ...], "max_tokens": N,
                  "prefill_prompts": [[ids], ...]}],
     "failures": {"prompt": [ids], "max_tokens": N}}

Output: the last stdout line is ``{"engines": {"pd": {"batches": [{"token_ids": [...],
"finish": [...], "prefill_finish": [...], "prefill_cached": [...]}], "engine_ids": {...},
"failures": {...}}}}`` (``failures``: ``pd_failures.run_failures``'s result, or
``{"error": traceback}`` when the failure cases raised), or ``{"error": traceback}``.
"""

from __future__ import annotations

import gc
import socket
import sys
import traceback
import uuid

from _engines import run_engines
from pd_failures import children, engine_processes, run_failures
from thinker_generate import BASE_ENGINE_ARGS


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _llm(model: str, spec: dict, kv_transfer_config=None, **engine_args):
    from vllm import LLM

    return LLM(model, **{**BASE_ENGINE_ARGS, "enable_prefix_caching": False, **engine_args},
               block_size=spec["block_size"], kv_cache_memory_bytes=16 * 1024 * 1024,
               kv_transfer_config=kv_transfer_config)


def _shutdown(*llms) -> None:
    for llm in llms:
        llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _prompts(ids_list):
    return [{"prompt_token_ids": list(ids)} for ids in ids_list]


def run_pd(spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_omni_plugin.kv_transfer import (
        CONNECTOR_NAME,
        EXTRA_BOOTSTRAP_PORT,
        EXTRA_MAX_DESCS_PER_PEER,
        EXTRA_TRANSFER_TIMEOUT,
        KV_TRANSFER_PARAMS,
        decode_request_params,
        prefill_request_params,
    )

    port = _free_port()
    common = {"mooncake_protocol": "tcp", EXTRA_TRANSFER_TIMEOUT: spec["timeout_s"]}
    extra = {**common, EXTRA_BOOTSTRAP_PORT: port}
    if spec.get("max_descs_per_peer"):
        extra[EXTRA_MAX_DESCS_PER_PEER] = spec["max_descs_per_peer"]
    ids = {role: f"pd-test-{role}-{uuid.uuid4().hex[:8]}" for role in ("prefill", "decode")}
    prefill_engine = {"remote_engine_id": ids["prefill"],
                      "remote_bootstrap_addr": f"http://127.0.0.1:{port}"}
    before = children()
    prefill = _llm(spec["model"], spec, KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_producer", engine_id=ids["prefill"],
        kv_connector_extra_config=extra), served_model_name="pd-prefill",
        enable_prefix_caching=True)
    prefill_procs = engine_processes(before)
    print("prefill engine processes:", [(p.pid, p.name()) for p in prefill_procs],
          file=sys.stderr, flush=True)
    decode = None
    try:
        decode = _llm(spec["model"], spec, KVTransferConfig(
            kv_connector=CONNECTOR_NAME, kv_role="kv_consumer", engine_id=ids["decode"],
            kv_connector_extra_config=common), served_model_name="pd-decode")
        batches = []
        for batch in spec["batches"]:
            if batch["mode"] == "local":
                params = SamplingParams(temperature=0.0, max_tokens=batch["max_tokens"],
                                        ignore_eos=True)
                outs = decode.generate(_prompts(batch["prompts"]), params, use_tqdm=False)
                batches.append({"token_ids": [list(o.outputs[0].token_ids) for o in outs],
                                "finish": [o.outputs[0].finish_reason for o in outs]})
                continue
            transfer_ids = [uuid.uuid4().hex for _ in batch["prompts"]]
            prefill_params = [SamplingParams(
                temperature=0.0, max_tokens=1, ignore_eos=True,
                extra_args={KV_TRANSFER_PARAMS: prefill_request_params(t)})
                for t in transfer_ids]
            pre = prefill.generate(_prompts(batch.get("prefill_prompts") or batch["prompts"]),
                                   prefill_params, use_tqdm=False)
            decode_params = [SamplingParams(
                temperature=0.0, max_tokens=batch["max_tokens"], ignore_eos=True,
                extra_args={KV_TRANSFER_PARAMS: decode_request_params(t, prefill_engine)})
                for t in transfer_ids]
            outs = decode.generate(_prompts(batch["prompts"]), decode_params, use_tqdm=False)
            batches.append({
                "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                "finish": [o.outputs[0].finish_reason for o in outs],
                "prefill_finish": [o.outputs[0].finish_reason for o in pre],
                "prefill_cached": [o.num_cached_tokens for o in pre],
            })
        try:
            failures = run_failures(spec["failures"], prefill, decode, prefill_procs,
                                    prefill_engine, "pd-decode")
        except Exception:  # report it beside the batches' results
            traceback.print_exc()
            failures = {"error": traceback.format_exc()[-6000:]}
        return {"batches": batches, "engine_ids": ids, "failures": failures}
    finally:
        running = all(p.is_running() for p in prefill_procs)  # killed by a failure case?
        _shutdown(*(x for x in (decode, prefill if running else None) if x is not None))


if __name__ == "__main__":
    sys.exit(run_engines(sys.argv, lambda spec, engine: run_pd(spec)))
