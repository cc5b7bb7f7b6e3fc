"""Images per second of BAGEL text to image (``POST /v1/images/generations``) at several
concurrencies, with 1 vs 2 DiT replicas, side by side in one run.

One ``vllm serve`` of the tiny BAGEL checkpoint per replica count, with the built-in
pipeline ``bagel`` and the DiT stage's ``runtime.num_replicas`` set (local
replicas in the head, least-queue-length routing). vLLM's CPU build binds every engine's
threads to the same cores unless told otherwise, so replicas on one host share them;
with ``--pin-cores`` each DiT replica is a headless ``vllm serve --headless --stage-id
1`` of its own, bound to one core (``VLLM_CPU_OMP_THREADS_BIND``: replica ``i`` on core
``i + 1`` modulo the cores), as replicas on their own devices would be. After a warm-up,
each of ``--trials`` trials sends ``--requests`` image requests per concurrency (``--size``,
``--steps`` timesteps, seeds differing per request). Printed per (replicas, concurrency):
images/s (median over trials) and latency p50/p99, then per concurrency the ratio
2 replicas / 1.

Usage (from the repository root)::

    .venv/bin/python benchmarks/image_bench.py
    .venv/bin/python benchmarks/image_bench.py --concurrency 1 4 --size 128x128 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO,
    Server,
    fmt,
    free_port,
    install_sigterm_as_interrupt,
    median,
    percentile,
    table,
    venv_bin,
    wait_health,
)

from vllm_omni_plugin.config.pipelines import builtin_pipeline  # noqa: E402

YAML = Path(builtin_pipeline("bagel"))


def write_yaml(path: Path, replicas: int) -> Path:
    import yaml

    pipeline = yaml.safe_load(YAML.read_text())
    pipeline["stages"][1]["runtime"] = {"num_replicas": replicas}
    path.write_text(yaml.safe_dump(pipeline))
    return path


def wait_replicas(server: Server, url: str, count: int, timeout: float) -> None:
    """Wait until ``count`` DiT replicas are up (the head's ``/metrics``)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        up = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("vllm_omni:replica_status{")
                 and 'stage="1"' in line and 'status="up"' in line)
        if up >= count:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{count} DiT replicas not up after {timeout:.0f} s:\n{server.tail()}")


async def load(url: str, model: str, args, concurrency: int, first_seed: int
               ) -> tuple[float, list[float]]:
    """(images/s, latencies) of ``args.requests`` requests, ``concurrency`` in flight."""
    import aiohttp

    todo = iter(range(args.requests))
    latencies: list[float] = []

    async def worker(session):
        for i in todo:
            body = {"model": model, "prompt": f"Picture number {i}.", "size": args.size,
                    "seed": first_seed + i, "num_inference_steps": args.steps}
            start = time.perf_counter()
            async with session.post(f"{url}/v1/images/generations", json=body) as r:
                answer = await r.json()
                if r.status != 200 or not answer["data"][0]["b64_json"]:
                    raise RuntimeError(f"image {i}: HTTP {r.status}: {str(answer)[:300]}")
            latencies.append(time.perf_counter() - start)

    timeout = aiohttp.ClientTimeout(total=1800)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return args.requests / (time.perf_counter() - start), latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=12, help="per trial and cell")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT (default 64x64)")
    parser.add_argument("--steps", type=int, default=10,
                        help="num_inference_steps (timesteps; default 10)")
    parser.add_argument("--pin-cores", action="store_true",
                        help="each DiT replica headless, bound to a core of its own")
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    work = Path(tempfile.mkdtemp(prefix="image-bench-"))
    ckpt = work / "ckpt"
    subprocess.run([sys.executable, "-m", "vllm_omni_plugin.tools.tiny_checkpoint", "bagel",
                    str(ckpt), "--seed", "0"], check=True, cwd=str(REPO),
                   stdout=subprocess.DEVNULL, timeout=600)
    rows, rates = [], {}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for replicas in args.replicas:
        port, master = free_port(), free_port()
        yaml_path = write_yaml(work / f"bagel{replicas}.yaml",
                               0 if args.pin_cores else replicas)
        common = [str(ckpt), "--stage-configs-path", str(yaml_path), "--max-model-len", "512",
                  "--dtype", "float32", "--gpu-memory-utilization", "0.2"]
        cluster = ["-oma", "127.0.0.1", "-omp", str(master)] if args.pin_cores else []
        server = Server([venv_bin("vllm"), "serve", *common, "--port", str(port), *cluster,
                         "--omni-lb-policy", "least-queue-length"], env,
                        work / f"serve{replicas}.log")
        headless = [Server([venv_bin("vllm"), "serve", *common, *cluster, "--headless",
                            "--stage-id", "1", "--port", str(free_port())],
                           {**env, "VLLM_CPU_OMP_THREADS_BIND": str((i + 1) % os.cpu_count())},
                           work / f"headless{replicas}-{i}.log")
                    for i in range(replicas if args.pin_cores else 0)]
        url = f"http://127.0.0.1:{port}"
        with server:
            try:
                for proc in headless:
                    proc.start()
                wait_health(server, f"{url}/health", timeout=600)
                wait_replicas(server, url, replicas, timeout=600)
                print(f"DiT replicas={replicas}: server ready in {server.elapsed():.1f} s",
                      flush=True)
                warm_up = argparse.Namespace(**{**vars(args), "requests": 2 * replicas})
                asyncio.run(load(url, str(ckpt), warm_up, 2, 0))
                for c in args.concurrency:
                    trial_rates, latencies = [], []
                    for trial in range(args.trials):
                        rate, lat = asyncio.run(load(url, str(ckpt), args, c,
                                                     1000 * (trial + 1)))
                        trial_rates.append(rate)
                        latencies += lat
                        print(f"  c={c} trial {trial + 1}: {rate:.3f} images/s", flush=True)
                    rates[(replicas, c)] = median(trial_rates)
                    rows.append([str(replicas), str(c), fmt(rates[(replicas, c)], ".3f"),
                                 fmt(percentile(latencies, 0.5), ".3f"),
                                 fmt(percentile(latencies, 0.99), ".3f")])
            finally:
                for proc in headless:
                    proc.stop()
    print()
    print(table(["DiT replicas", "concurrency", "images/s", "latency p50 s", "p99 s"], rows,
                title=f"BAGEL text to image, tiny checkpoint, {args.size}, "
                      f"{args.steps} timesteps, {args.requests} requests x "
                      f"{args.trials} trials"
                      + (", DiT replicas headless on their own cores" if args.pin_cores
                         else ", DiT replicas local")))
    if 1 in args.replicas and 2 in args.replicas:
        for c in args.concurrency:
            print(f"c={c}: 2 replicas / 1 = {rates[(2, c)] / rates[(1, c)]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
