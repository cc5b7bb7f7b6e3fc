"""Failures of a prefill/decode pair of real vLLM engines, and the time each takes to fail.

Run by ``pd_generate.py`` on its pair after its batches (``"failures"`` in its spec): a
prefill engine and a decode engine of the thinker stage, each engine core in its own
process, Mooncake over TCP on loopback, both with the plugin's transfer timeout. In
order:

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

Result: ``{case: {"token_ids": [...], "finish": str, "elapsed_s": float},
"decode_unfinished": int, "decode_kv_usage": float}``.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
import uuid

import psutil


def engine_processes(before: set[int]) -> list[psutil.Process]:
    """The engine core process started since ``before`` and its worker processes (where
    the connector's sender runs), engine core first."""
    (core,) = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and "EngineCore" in " ".join([p.name(), *p.cmdline()])]
    return [core, *core.children(recursive=True)]


def children() -> set[int]:
    """The pids of this process's descendants."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _signal(processes: list[psutil.Process], sig: int) -> None:
    for process in processes:
        process.send_signal(sig)


def _kv_usage(model_name: str) -> float:
    """The ``vllm:kv_cache_usage_perc`` gauge of the engine serving ``model_name`` (vLLM's
    Prometheus logger keeps the gauges of the engine built last in this process)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    for metric in get_metrics_snapshot():
        if metric.name == "vllm:kv_cache_usage_perc" and \
                metric.labels.get("model_name") == model_name:
            return float(metric.value)
    raise LookupError(f"no KV cache usage gauge for {model_name}")


def run_failures(spec: dict, prefill, decode, prefill_procs: list[psutil.Process],
                 prefill_engine: dict, decode_name: str) -> dict:
    """The cases above on ``spec["prompt"]`` (``spec["max_tokens"]`` tokens each), in
    order; ``prefill_procs``: the prefill engine's processes (:func:`engine_processes`),
    killed at the end; ``prefill_engine``: its ``remote_engine_id`` and
    ``remote_bootstrap_addr``; ``decode_name``: the decode engine's served model name.
    The decode engine was built last in this process."""
    from vllm import SamplingParams

    from vllm_omni_plugin.kv_transfer import (
        KV_TRANSFER_PARAMS,
        decode_request_params,
        prefill_request_params,
    )

    prompt = [{"prompt_token_ids": list(spec["prompt"])}]
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
    results["decode_kv_usage"] = _kv_usage(decode_name)
    return results
