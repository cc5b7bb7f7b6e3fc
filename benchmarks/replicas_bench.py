"""Replicated stages: scaling and failover.

1. **Scaling.** The talker (stage 1) is the pipeline's bottleneck: with
   ``--talker-frames`` codec frames per request (default 64) it costs far more
   than the thinker (``max_tokens`` 4) and code2wav. Each talker replica is
   capacity-bound like an accelerator replica is by its KV cache: at most
   ``--talker-max-num-seqs`` (default 4) requests run at once in it (vLLM's
   ``max_num_seqs``). The same ``vllm serve`` pipeline runs with
   ``runtime.num_replicas`` 1 and then 2 for the talker (local replicas in the
   head), and for each a burst of ``--requests`` (default 16) concurrent audio
   chats (after one warm-up chat) is timed. Printed: requests/s of each and the
   2-vs-1 ratio (target >= 1.7). Every process runs with ``OMP_NUM_THREADS=1``
   so two replicas can use two cores.
2. **Failover.** A head plus two headless talker replicas
   (``--headless --stage-id 1``), ``--omni-heartbeat-timeout`` T (default 3 s),
   round-robin. One replica's process group gets SIGKILL at t0 and two
   concurrent chats are sent at once (one is routed to the dead replica, which
   has not been detected yet). Printed: time from t0 to detection (``/metrics``
   shows the replica ``error``, polled every 20 ms; target <= T + 1 s) and to
   the completion of each chat; the one routed to the dead replica is
   resubmitted at detection and served by the other replica.

Usage (from the repository root)::

    .venv/bin/python benchmarks/replicas_bench.py
    .venv/bin/python benchmarks/replicas_bench.py --talker-max-num-seqs 0 --skip-failover
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Server,
    free_port,
    install_sigterm_as_interrupt,
    make_checkpoint,
    post_json,
    table,
    venv_bin,
    wait_health,
)

from vllm_omni_plugin.config.pipelines import builtin_pipeline  # noqa: E402

YAML = Path(builtin_pipeline("qwen3_omni_moe"))


def write_yaml(path: Path, args, talker_replicas: int) -> Path:
    pipeline = yaml.safe_load(YAML.read_text())
    talker = pipeline["stages"][1]
    talker["default_sampling_params"]["max_tokens"] = args.talker_frames
    if args.talker_max_num_seqs:
        talker["engine_args"]["max_num_seqs"] = args.talker_max_num_seqs
    # a random-weight talker rarely emits EOS: every request runs all frames
    talker["runtime"] = {"num_replicas": talker_replicas}
    path.write_text(yaml.safe_dump(pipeline))
    return path


def chat(url: str, model: str, text: str) -> tuple[int, float]:
    start = time.perf_counter()
    status, body = post_json(f"{url}/v1/chat/completions", {
        "model": model, "max_tokens": 4, "temperature": 0, "modalities": ["text", "audio"],
        "messages": [{"role": "user", "content": text}]}, timeout=900)
    if status != 200:
        raise RuntimeError(f"chat failed ({status}): {str(body)[:500]}")
    return status, time.perf_counter() - start


def burst(url: str, model: str, n: int) -> float:
    """Seconds for ``n`` concurrent chats."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            chat(url, model, f"Request number {i}.")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def serve(args, ckpt: Path, yaml_path: Path, log: Path, extra: list[str],
          env: dict) -> tuple[Server, str]:
    port = free_port()
    server = Server([venv_bin("vllm"), "serve", str(ckpt), "--stage-configs-path",
                     str(yaml_path), "--port", str(port), "--max-model-len", "2048",
                     "--dtype", "float32", *extra], env, log)
    server.start()
    return server, f"http://127.0.0.1:{port}"


def scaling(args, ckpt: Path, work: Path, env: dict) -> dict[int, float]:
    rates = {}
    for replicas in (1, 2):
        yaml_path = write_yaml(work / f"scaling{replicas}.yaml", args, replicas)
        server, url = serve(args, ckpt, yaml_path, work / f"scaling{replicas}.log",
                            ["--omni-lb-policy", "least-queue-length"], env)
        try:
            wait_health(server, f"{url}/health", timeout=600)
            chat(url, str(ckpt), "Warm up.")
            seconds = burst(url, str(ckpt), args.requests)
        finally:
            server.stop()
        rates[replicas] = args.requests / seconds
        print(f"talker replicas={replicas}: {args.requests} requests in {seconds:.1f} s "
              f"({rates[replicas]:.3f} req/s)", flush=True)
    return rates


def metric(url: str, name: str, **labels: str) -> float | None:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def failover(args, ckpt: Path, work: Path, env: dict) -> dict[str, float]:
    yaml_path = write_yaml(work / "failover.yaml", args, 0)
    master_port = free_port()
    common = ["-oma", "127.0.0.1", "-omp", str(master_port)]
    head, url = serve(args, ckpt, yaml_path, work / "head.log",
                      [*common, "--omni-lb-policy", "round-robin", "--omni-heartbeat-timeout",
                       str(args.heartbeat_timeout)], env)
    replicas: list[Server] = []
    try:
        for i in range(2):
            server, _ = serve(args, ckpt, yaml_path, work / f"headless{i}.log",
                              [*common, "--headless", "--stage-id", "1"], env)
            replicas.append(server)
        wait_health(head, f"{url}/health", timeout=600)
        ids = {}
        deadline = time.monotonic() + 300
        while len(ids) < 2 and time.monotonic() < deadline:
            for server in replicas:
                for _, line in server.snapshot():
                    if m := re.search(r"stage 1 replica (\d+) serving on", line):
                        ids[int(m.group(1))] = server
            time.sleep(0.5)
        while any(metric(url, "vllm_omni:replica_status", stage="1", replica=str(r),
                         status="up") != 1.0 for r in ids):
            if time.monotonic() > deadline:
                raise TimeoutError("replicas did not attach")
            time.sleep(0.2)
        chat(url, str(ckpt), "Warm up.")
        _, baseline = chat(url, str(ckpt), "Baseline.")
        victim = ids[0]
        done: dict[int, float] = {}
        t0 = time.perf_counter()
        os.killpg(victim.proc.pid, 9)

        def one(i: int) -> None:
            chat(url, str(ckpt), f"After the kill {i}.")
            done[i] = time.perf_counter() - t0

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        detected = None
        while detected is None:
            if metric(url, "vllm_omni:replica_status", stage="1", replica="0",
                      status="error") == 1.0:
                detected = time.perf_counter() - t0
            time.sleep(0.02)
        for t in threads:
            t.join()
        resubmitted = metric(url, "vllm_omni:stage_resubmissions_total", stage="1")
    finally:
        for server in [*replicas, head]:
            server.stop()
    return {"detected": detected, "served": sorted(done.values()), "baseline": baseline,
            "resubmitted": resubmitted or 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="reuse this tiny checkpoint (made there if it has no config.json)")
    ap.add_argument("--requests", type=int, default=16, help="concurrent chats per burst")
    ap.add_argument("--talker-frames", type=int, default=64, help="talker max_tokens")
    ap.add_argument("--talker-max-num-seqs", type=int, default=4,
                    help="max_num_seqs of each talker replica (0: vLLM's default)")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0)
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--skip-failover", action="store_true")
    args = ap.parse_args()
    install_sigterm_as_interrupt()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="replicas-bench-") as tmp:
        work = Path(tmp)
        ckpt = args.checkpoint or work / "tiny-qwen3-omni"
        if not (ckpt / "config.json").exists():
            print(f"tiny checkpoint written in {make_checkpoint(ckpt):.1f} s", flush=True)
        rows = []
        if not args.skip_scaling:
            rates = scaling(args, ckpt, work, env)
            rows.append(["throughput, talker x1 (req/s)", f"{rates[1]:.3f}", ""])
            rows.append(["throughput, talker x2 (req/s)", f"{rates[2]:.3f}", ""])
            rows.append(["ratio x2 / x1", f"{rates[2] / rates[1]:.2f}", ">= 1.7"])
        if not args.skip_failover:
            res = failover(args, ckpt, work, env)
            t = args.heartbeat_timeout
            rows.append(["kill -9 -> detected (s)", f"{res['detected']:.2f}", f"<= {t + 1:g}"])
            rows.append(["kill -9 -> chats served (s)",
                         ", ".join(f"{s:.2f}" for s in res["served"]), ""])
            rows.append(["chat latency before kill (s)", f"{res['baseline']:.2f}", ""])
            rows.append(["tasks resubmitted", f"{res['resubmitted']:g}", ""])
        print()
        print(table(["measure", "value", "target"], rows,
                    title=f"replicas ({args.requests} concurrent chats, talker "
                          f"{args.talker_frames} frames, max_num_seqs "
                          f"{args.talker_max_num_seqs or 'default'}, {os.cpu_count()} CPUs)"))


if __name__ == "__main__":
    main()
