"""Admission control under a burst, restart of a killed stage engine, and recovery
from a stalled one.

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
3. **Stall.** ``--stall-runs`` (default 3) times per stage kind, with
   ``--omni-stall-timeout`` ``--stall-timeout`` (default 5 s): SIGSTOP of the stage's
   EngineCore at t0, then one request that reaches it (the talker and code2wav of the
   pipeline above; the prefill stage of ``qwen3_omni_moe_pd``, a text chat; the DiT of
   ``bagel``, a 48x32 image in 4 steps). Printed per kind, p50 over the runs: seconds
   from t0 to the log line that the stage stalled (detection: the timeout plus up to one
   probe interval, a tenth of it) and to its "restarted" line (recovery), and the
   stalled request's answer (resubmitted to the restarted engine: 200).

Usage (from the repository root)::

    .venv/bin/python benchmarks/hardening_bench.py
    .venv/bin/python benchmarks/hardening_bench.py --burst 40 --bound 4
    .venv/bin/python benchmarks/hardening_bench.py --parts stall --stall-runs 3
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO,
    Server,
    free_port,
    install_sigterm_as_interrupt,
    make_checkpoint,
    post_json,
    stage_engine_core_pid,
    table,
    timed_audio_chat,
    venv_bin,
    wait_health,
)

from vllm_omni_plugin.config.pipelines import builtin_pipeline  # noqa: E402

YAML = Path(builtin_pipeline("qwen3_omni_moe"))
PARTS = ("burst", "restart", "stall")


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


def stall_runs(server: Server, stage: int, send, runs: int) -> dict:
    """``runs`` stalls of ``stage``'s EngineCore, one ``send()`` (-> HTTP status) each;
    per run: detection, recovery and answer seconds from the SIGSTOP, and the status."""
    out = {"detected": [], "restarted": [], "answered": [], "status": []}
    for _ in range(runs):
        log = "\n".join(line for _, line in server.snapshot())
        engine = stage_engine_core_pid(log, stage)
        t0 = server.elapsed()
        os.kill(engine, signal.SIGSTOP)
        out["status"].append(send())
        out["answered"].append(server.elapsed() - t0)
        replica = rf"stage {stage} replica 0 \(local [^)]*\)"
        out["detected"].append(log_time(server, rf"{replica}: stalled", t0) - t0)
        out["restarted"].append(log_time(server, rf"{replica}: restarted in", t0) - t0)
    return out


def stall(args, work: Path) -> dict:
    """:func:`stall_runs` for each stage kind, each pipeline on a server of its own."""
    qwen = work / "ckpt"
    bagel = work / "bagel"
    subprocess.run([sys.executable, "-m", "vllm_omni_plugin.tools.tiny_checkpoint", "bagel",
                    str(bagel), "--seed", "0"], check=True, cwd=str(REPO),
                   stdout=subprocess.DEVNULL, timeout=600)

    def chat(url, model, audio):
        body = {"model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello there."}]}
        if audio:
            body["modalities"] = ["text", "audio"]
        return lambda: post_json(f"{url}/v1/chat/completions", body, 600)[0]

    def image(url, model):
        return lambda: post_json(f"{url}/v1/images/generations", {
            "model": model, "prompt": "A red boat.", "size": "48x32", "seed": 1,
            "num_inference_steps": 4}, 600)[0]

    plans = [  # (pipeline, checkpoint, [(kind, stage, make_send)])
        ("qwen3_omni_moe", qwen, [("talker", 1, lambda u, m: chat(u, m, True)),
                                  ("code2wav", 2, lambda u, m: chat(u, m, True))]),
        ("qwen3_omni_moe_pd", qwen, [("thinker prefill (PD)", 3,
                                      lambda u, m: chat(u, m, False))]),
        ("bagel", bagel, [("BAGEL DiT", 1, image)]),
    ]
    results = {}
    for pipeline, ckpt, kinds in plans:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = Server([venv_bin("vllm"), "serve", str(ckpt), "--stage-configs-path",
                         pipeline, "--port", str(port), "--max-model-len", "512",
                         "--dtype", "float32", "--omni-stall-timeout",
                         str(args.stall_timeout)],
                        {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
                        work / f"stall-{pipeline}.log")
        with server:
            wait_health(server, f"{url}/health", timeout=600)
            for kind, stage, make_send in kinds:
                send = make_send(url, str(ckpt))
                send()  # warm-up
                results[kind] = stall_runs(server, stage, send, args.stall_runs)
                print(f"{kind}: {args.stall_runs} stalls measured", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--talker-frames", type=int, default=64)
    parser.add_argument("--bound", type=int, default=4, help="talker runtime.max_inflight")
    parser.add_argument("--burst", type=int, default=None, help="default: 3 x --bound")
    parser.add_argument("--admission-timeout", type=float, default=2.0)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--stall-timeout", type=float, default=5.0,
                        help="--omni-stall-timeout of the stall part's servers (seconds)")
    parser.add_argument("--stall-runs", type=int, default=3, help="stalls per stage kind")
    args = parser.parse_args()
    args.burst = args.burst or 3 * args.bound
    install_sigterm_as_interrupt()
    with tempfile.TemporaryDirectory(prefix="hardening-bench-") as tmp:
        work = Path(tmp)
        ckpt = work / "ckpt"
        make_checkpoint(ckpt)
        if "stall" in args.parts:
            print_stalls(args, stall(args, work))
        if not {"burst", "restart"} & set(args.parts):
            return
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
            b = burst(args, url, str(ckpt), server.proc.pid) if "burst" in args.parts \
                else None
            r = restart(url, str(ckpt), server) if "restart" in args.parts else None
    if b is not None:
        print_burst(args, b)
    if r is not None:
        print(f"Restart after kill -9 of the idle talker EngineCore: detected "
              f"{r['detected']:.2f} s, restarted {r['restarted']:.2f} s, chat sent at the "
              f"kill answered {r['status']} after {r['answered']:.2f} s")


def print_stalls(args, results: dict) -> None:
    rows = [[kind, f"{statistics.median(r['detected']):.2f}",
             f"{statistics.median(r['restarted']):.2f}",
             f"{statistics.median(r['answered']):.2f}",
             ",".join(map(str, r["status"]))] for kind, r in results.items()]
    print(table(["stage kind", "detection p50 s", "recovery p50 s", "answer p50 s",
                 "statuses"], rows,
                title=f"Stalled stage (SIGSTOP of its EngineCore), --omni-stall-timeout "
                      f"{args.stall_timeout:g} s, {args.stall_runs} runs per kind"))


def print_burst(args, b: dict) -> None:
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


if __name__ == "__main__":
    main()
