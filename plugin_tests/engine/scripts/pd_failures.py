"""Failures of a prefill/decode pair of real vLLM engines, and the time each takes to fail.

Run as a subprocess by ``plugin_tests/engine/test_pd_engine.py``. A prefill engine and a
decode engine of the thinker stage (as ``pd_generate.py`` builds them, each engine core in
its own process, Mooncake over TCP on loopback), both with the plugin's transfer timeout
``timeout_s``. In order:

1. ``reference``: the decode engine generates the prompt itself; ``warm``: with PD.
2. ``unreachable_bootstrap``: the decode request names a bootstrap address where a real
   socket accepts connections and never answers.
3. ``transfer_never_completes``: the prefill engine prefills the prompt, then its engine core
   process is stopped (SIGSTOP) before the decode engine pulls; it is continued (SIGCONT)
   once the decode request has failed, and a PD request after it (``after_resume``) must
   still match the reference: the prefill engine must not write the stale pull late.
4. ``prefill_killed``: the prefill engine prefills the prompt, then its engine core process
   is killed (SIGKILL) before the decode engine pulls.
5. ``after``: the decode engine generates the prompt itself again.

Output: the last stdout line is ``{"engines": {"failures": {case: {"token_ids": [...],
"finish": str, "elapsed_s": float}, "decode_unfinished": int,
"decode_kv_usage": float}}}``, or ``{"error": traceback}``.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
import uuid

import psutil
from _engines import run_engines
from pd_generate import _free_port, _llm, _prompts, _shutdown


def _engine_processes(before: set[int]) -> list[psutil.Process]:
    """The engine core process started since ``before`` and its worker processes (where
    the connector's sender runs), engine core first."""
    (core,) = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and "EngineCore" in " ".join([p.name(), *p.cmdline()])]
    return [core, *core.children(recursive=True)]


def _signal(processes: list[psutil.Process], sig: int) -> None:
    for process in processes:
        process.send_signal(sig)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kv_usage(model_name: str) -> float:
    """The ``vllm:kv_cache_usage_perc`` gauge of the engine serving ``model_name`` (vLLM's
    Prometheus logger keeps the gauges of the engine built last in this process)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    for metric in get_metrics_snapshot():
        if metric.name == "vllm:kv_cache_usage_perc" and \
                metric.labels.get("model_name") == model_name:
            return float(metric.value)
    raise LookupError(f"no KV cache usage gauge for {model_name}")


def run_failures(spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_omni_plugin.kv_transfer import (
        CONNECTOR_NAME,
        EXTRA_BOOTSTRAP_PORT,
        EXTRA_TRANSFER_TIMEOUT,
        KV_TRANSFER_PARAMS,
        decode_request_params,
        prefill_request_params,
    )

    port = _free_port()
    timeout = spec["timeout_s"]
    ids = {role: f"pd-fail-{role}-{uuid.uuid4().hex[:8]}" for role in ("prefill", "decode")}
    prefill_engine = {"remote_engine_id": ids["prefill"],
                      "remote_bootstrap_addr": f"http://127.0.0.1:{port}"}
    before = _children()
    prefill = _llm(spec["model"], spec, KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_producer", engine_id=ids["prefill"],
        kv_connector_extra_config={"mooncake_protocol": "tcp", EXTRA_BOOTSTRAP_PORT: port,
                                   EXTRA_TRANSFER_TIMEOUT: timeout}),
        served_model_name="pd-prefill")
    prefill_procs = _engine_processes(before)
    print("prefill engine processes:", [(p.pid, p.name()) for p in prefill_procs],
          file=sys.stderr, flush=True)
    decode = _llm(spec["model"], spec, KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_consumer", engine_id=ids["decode"],
        kv_connector_extra_config={"mooncake_protocol": "tcp",
                                   EXTRA_TRANSFER_TIMEOUT: timeout}),
        served_model_name="pd-decode")
    prompt = _prompts([spec["prompt"]])
    greedy = {"temperature": 0.0, "max_tokens": spec["max_tokens"], "ignore_eos": True}
    results: dict = {}

    def local(case: str) -> None:
        start = time.perf_counter()
        (out,) = decode.generate(prompt, SamplingParams(**greedy), use_tqdm=False)
        results[case] = {"token_ids": list(out.outputs[0].token_ids),
                         "finish": out.outputs[0].finish_reason,
                         "elapsed_s": time.perf_counter() - start}

    def prefill_now() -> str:
        transfer_id = uuid.uuid4().hex
        (out,) = prefill.generate(prompt, SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True,
            extra_args={KV_TRANSFER_PARAMS: prefill_request_params(transfer_id)}),
            use_tqdm=False)
        assert out.outputs[0].finish_reason == "length", out
        return transfer_id

    def pull(case: str, transfer_id: str, engine: dict) -> None:
        start = time.perf_counter()
        (out,) = decode.generate(prompt, SamplingParams(
            **greedy, extra_args={KV_TRANSFER_PARAMS: decode_request_params(transfer_id,
                                                                             engine)}),
            use_tqdm=False)
        results[case] = {"token_ids": list(out.outputs[0].token_ids),
                         "finish": out.outputs[0].finish_reason,
                         "elapsed_s": time.perf_counter() - start}
        print(f"{case}: {results[case]}", file=sys.stderr, flush=True)

    try:
        local("reference")
        pull("warm", prefill_now(), prefill_engine)

        with socket.socket() as silent:  # accepts (the kernel's backlog), never answers
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            pull("unreachable_bootstrap", uuid.uuid4().hex,
                 {"remote_engine_id": f"pd-fail-ghost-{uuid.uuid4().hex[:8]}",
                  "remote_bootstrap_addr": f"http://127.0.0.1:{silent.getsockname()[1]}"})

        transfer_id = prefill_now()
        _signal(prefill_procs, signal.SIGSTOP)
        try:
            pull("transfer_never_completes", transfer_id, prefill_engine)
        finally:
            _signal(prefill_procs, signal.SIGCONT)
        pull("after_resume", prefill_now(), prefill_engine)

        transfer_id = prefill_now()
        _signal(prefill_procs, signal.SIGKILL)
        psutil.wait_procs(prefill_procs, timeout=30)
        pull("prefill_killed", transfer_id, prefill_engine)

        local("after")
        results["decode_unfinished"] = decode.llm_engine.get_num_unfinished_requests()
        results["decode_kv_usage"] = _kv_usage("pd-decode")
        return results
    finally:
        _shutdown(decode)
        if all(p.is_running() for p in prefill_procs):
            _shutdown(prefill)


if __name__ == "__main__":
    sys.exit(run_engines(sys.argv, lambda spec, engine: run_failures(spec)))
