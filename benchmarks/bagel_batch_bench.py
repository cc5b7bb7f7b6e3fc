"""BAGEL's DiT batching: four concurrent image requests vs the same four one after another,
side by side in one run of one server.

One ``vllm serve`` of the tiny BAGEL checkpoint with the built-in pipeline ``bagel`` (the
DiT's ``max_num_seqs`` 4: four images denoised at once, each engine step one Euler step
of each, those of one size in shared forwards). After a warm-up (the same requests both
ways), each of ``--trials`` trials sends ``--batch`` requests (``--size``, ``--steps``
timesteps, a seed each) one after another, then the same requests at once. Printed per
trial: images/s of both and their ratio; then the median ratio, and the largest
difference, in uint8 levels, between an image served beside others and the same
request served alone (0: the same bytes). On a 2-core host the server runs under
``taskset -c 1`` (``--pin``, as ``text_bench.py``): its API process on core 1, vLLM's
CPU workers on core 0, where they bind themselves.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bagel_batch_bench.py
    .venv/bin/python benchmarks/bagel_batch_bench.py --size 128x128 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO,
    Server,
    fmt,
    free_port,
    install_sigterm_as_interrupt,
    median,
    table,
    venv_bin,
    wait_health,
)

from vllm_omni_plugin.config.pipelines import builtin_pipeline  # noqa: E402


async def serve_images(url: str, model: str, args, seeds: list[int], together: bool
                       ) -> tuple[float, list]:
    """``(images/s, images)`` of one request per seed, all at once or one after another;
    each image a ``[H, W, 3]`` uint8 array."""
    import aiohttp
    import numpy as np
    from PIL import Image

    async def one(session, seed: int):
        body = {"model": model, "prompt": f"A lighthouse at dusk, number {seed}.",
                "size": args.size, "seed": seed, "num_inference_steps": args.steps}
        async with session.post(f"{url}/v1/images/generations", json=body) as r:
            answer = await r.json()
            if r.status != 200:
                raise RuntimeError(f"seed {seed}: HTTP {r.status}: {str(answer)[:300]}")
        png = base64.b64decode(answer["data"][0]["b64_json"])
        return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        if together:
            images = await asyncio.gather(*(one(session, seed) for seed in seeds))
        else:
            images = [await one(session, seed) for seed in seeds]
        return len(seeds) / (time.perf_counter() - start), list(images)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4, help="requests per trial")
    parser.add_argument("--trials", type=int, default=9,
                        help="trials (default 9: a trial's ratio varies by about 0.1 "
                             "on a 2-core host)")
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT (default 64x64)")
    parser.add_argument("--steps", type=int, default=50,
                        help="num_inference_steps (timesteps; default 50, the official)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction,
                        default=os.cpu_count() == 2 and shutil.which("taskset") is not None,
                        help="run the server under `taskset -c 1` (default: on a 2-core "
                             "host)")
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    work = Path(tempfile.mkdtemp(prefix="bagel-batch-bench-"))
    ckpt = work / "ckpt"
    subprocess.run([sys.executable, "-m", "vllm_omni_plugin.tools.tiny_checkpoint", "bagel",
                    str(ckpt), "--seed", "0"], check=True, cwd=str(REPO),
                   stdout=subprocess.DEVNULL, timeout=600)
    port = free_port()
    argv = [venv_bin("vllm"), "serve", str(ckpt), "--stage-configs-path",
            builtin_pipeline("bagel"), "--max-model-len", "512", "--dtype", "float32",
            "--gpu-memory-utilization", "0.2", "--port", str(port)]
    if args.pin:
        argv = ["taskset", "-c", "1", *argv]
    server = Server(argv, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, work / "serve.log")
    url = f"http://127.0.0.1:{port}"
    rows, ratios, worst = [], [], 0
    with server:
        wait_health(server, f"{url}/health", timeout=600)
        print(f"server ready in {server.elapsed():.1f} s", flush=True)
        # warm-up: the shapes both ways of serving run (oneDNN builds a kernel per shape)
        for together in (True, False):
            asyncio.run(serve_images(url, str(ckpt), args, list(range(args.batch)),
                                     together))
        for trial in range(args.trials):
            seeds = [100 * (trial + 1) + i for i in range(args.batch)]
            alone_rate, alone = asyncio.run(serve_images(url, str(ckpt), args, seeds, False))
            together_rate, together = asyncio.run(
                serve_images(url, str(ckpt), args, seeds, True))
            diff = max(int(abs(a.astype(int) - b.astype(int)).max())
                       for a, b in zip(alone, together, strict=True))
            worst = max(worst, diff)
            ratios.append(together_rate / alone_rate)
            rows.append([str(trial + 1), fmt(alone_rate, ".3f"), fmt(together_rate, ".3f"),
                         fmt(ratios[-1], ".2f"), str(diff)])
            print(f"  trial {trial + 1}: one after another {alone_rate:.3f} images/s, "
                  f"at once {together_rate:.3f}, ratio {ratios[-1]:.2f}, "
                  f"max level difference {diff}", flush=True)
    print()
    print(table(["trial", "one after another images/s", "at once images/s", "ratio",
                 "max level difference"], rows,
                title=f"BAGEL text to image, tiny checkpoint, {args.batch} requests of "
                      f"{args.size}, {args.steps} timesteps"))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    print(f"median ratio at once / one after another: {median(ratios):.2f} (quartiles "
          f"{quartiles[0]:.2f}-{quartiles[2]:.2f}); largest difference of an image at once "
          f"from alone: {worst} levels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
