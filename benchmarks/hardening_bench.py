"""Admission control under a burst, and restart of a killed stage engine.

One ``vllm serve`` pipeline on the tiny checkpoint, with
``--talker-frames`` codec frames per request (default 64) so a request spends
most of its time in the talker, whose admission bound is ``--bound``
(``runtime.max_inflight``, default 4), and ``--omni-admission-timeout``
``--admission-timeout`` (default 2 s).

1. **Burst.** After one warm-up chat, ``--burst`` (default 3 x bound)
   concurrent audio chats. Printed: admitted and refused (429) counts, p50/p99
   latency of each, and the API server's resident memory (``VmRSS`` of its
   process) before the burst, at its peak (sampled every 50 ms) and 5 s after.
2. **Restart.** ``kill -9`` of the idle talker's EngineCore at t0 and one audio
   chat sent at once. Printed: seconds from t0 to the supervisor's log line
   that the engine exited (detection), to its "restarted" line, and to the
   chat's answer (which waited for the restarted talker).

Usage (from the repository root)::

    .venv/bin/python benchmarks/hardening_bench.py
    .venv/bin/python benchmarks/hardening_bench.py --burst 40 --bound 4
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Server,
    free_port,
    install_sigterm_as_interrupt,
    make_checkpoint,
    stage_engine_core_pid,
    table,
    timed_audio_chat,
    venv_bin,
    wait_health,
)

from vllm_omni_plugin.config.pipelines import builtin_pipeline  # noqa: E402

YAML = Path(builtin_pipeline("qwen3_omni_moe"))


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (``VmRSS`` in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def log_time(server: Server, pattern: str, after: float, timeout: float = 300) -> float:
    """Seconds since launch of the first log line after ``after`` matching ``pattern``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for stamp, line in server.snapshot():
            if stamp >= after and re.search(pattern, line):
                return stamp
        time.sleep(0.05)
    raise TimeoutError(f"{pattern!r} not logged; log tail:\n{server.tail()}")


def burst(args, url: str, model: str, pid: int) -> dict:
    results: list[tuple[int, float]] = []
    lock = threading.Lock()
    peak = [rss_mib(pid)]
    done = threading.Event()

    def one(i: int) -> None:
        outcome = timed_audio_chat(url, model, f"Request number {i}.")
        with lock:
            results.append(outcome)

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], rss_mib(pid))

    before = rss_mib(pid)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.burst)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    time.sleep(5)
    after = rss_mib(pid)
    by_status: dict[int, list[float]] = {}
    for status, seconds in results:
        by_status.setdefault(status, []).append(seconds)
    return {"by_status": by_status, "wall": wall, "rss": (before, peak[0], after)}


def restart(url: str, model: str, server: Server) -> dict:
    engine = stage_engine_core_pid("\n".join(line for _, line in server.snapshot()), 1)
    t0 = server.elapsed()
    os.kill(engine, 9)
    status, answered = timed_audio_chat(url, model, "After the kill.")
    return {
        "detected": log_time(server, r"stage 1 replica \d+ .*engine core exited", t0) - t0,
        "restarted": log_time(server, r"stage 1 replica \d+ .*restarted in", t0) - t0,
        "answered": answered,
        "status": status,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--talker-frames", type=int, default=64)
    parser.add_argument("--bound", type=int, default=4, help="talker runtime.max_inflight")
    parser.add_argument("--burst", type=int, default=None, help="default: 3 x --bound")
    parser.add_argument("--admission-timeout", type=float, default=2.0)
    args = parser.parse_args()
    args.burst = args.burst or 3 * args.bound
    install_sigterm_as_interrupt()
    with tempfile.TemporaryDirectory(prefix="hardening-bench-") as tmp:
        work = Path(tmp)
        ckpt = work / "ckpt"
        make_checkpoint(ckpt)
        pipeline = yaml.safe_load(YAML.read_text())
        talker = pipeline["stages"][1]
        talker["default_sampling_params"]["max_tokens"] = args.talker_frames
        talker["runtime"] = {"max_inflight": args.bound}
        yaml_path = work / "pipeline.yaml"
        yaml_path.write_text(yaml.safe_dump(pipeline))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        server = Server([venv_bin("vllm"), "serve", str(ckpt), "--stage-configs-path",
                         str(yaml_path), "--port", str(port), "--max-model-len", "2048",
                         "--dtype", "float32", "--omni-admission-timeout",
                         str(args.admission_timeout)], env, work / "serve.log")
        with server:
            wait_health(server, f"{url}/health", timeout=600)
            for i in range(2):
                timed_audio_chat(url, str(ckpt), f"Warm up {i}.")
            b = burst(args, url, str(ckpt), server.proc.pid)
            r = restart(url, str(ckpt), server)
    rows = []
    for status, seconds in sorted(b["by_status"].items()):
        rows.append([str(status), str(len(seconds)), f"{percentile(seconds, 50):.2f}",
                     f"{percentile(seconds, 99):.2f}"])
    print(table(["status", "requests", "p50 s", "p99 s"], rows,
                title=f"Burst: {args.burst} concurrent audio chats, talker bound {args.bound}, "
                      f"admission timeout {args.admission_timeout:g} s, "
                      f"{args.talker_frames} frames ({b['wall']:.1f} s in all)"))
    before, peak, after = b["rss"]
    print(f"API server RSS: before {before:.0f} MiB, peak {peak:.0f} MiB, "
          f"5 s after {after:.0f} MiB ({after - before:+.0f} MiB)")
    print(f"Restart after kill -9 of the idle talker EngineCore: detected {r['detected']:.2f} s, "
          f"restarted {r['restarted']:.2f} s, chat sent at the kill answered "
          f"{r['status']} after {r['answered']:.2f} s")


if __name__ == "__main__":
    main()
