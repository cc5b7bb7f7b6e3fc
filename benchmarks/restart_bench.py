"""Start-up and restarts: a first start with an empty compile cache, a second start on
the cache it left, and a replica restarted by the head's supervisor.

Serves the tiny Qwen3-Omni pipeline (``vllm serve CKPT --stage-configs-path
qwen3_omni_moe ...``) with ``VLLM_CACHE_ROOT`` in a fresh directory and without
``VLLM_CPU_CI_ENV`` (so vLLM's CPU build compiles the thinker with inductor, as a GPU
build does):

1. **first start**: launch -> ``GET /health`` 200; from the log, the thinker's
   ``torch.compile`` time and whether its graphs were compiled or loaded from the cache
   (vLLM's "Compiling a graph for compile range" vs "Directly load the compiled graph");
2. ``kill -9`` of the talker's EngineCore: the supervisor's ``restarted in`` time
   against the talker's first ``engine ready in`` time, and an audio chat after it;
3. **second start**, the same command and cache directory: /health, compile time and
   cache hits again. The plugin's settings (payload directory, YAML path, differing per
   start) stay out of vLLM's cache key (``compat/compile_cache_key.py``): without that
   the second start compiled again.

Usage (from the repository root)::

    .venv/bin/python benchmarks/restart_bench.py            # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Server,
    audio_pipeline_serve,
    engine_core_pid,
    install_sigterm_as_interrupt,
    post_json,
    table,
    wait_health,
)


def _log(server: Server) -> str:
    return "\n".join(line for _, line in server.snapshot())


def _compile(log: str) -> dict:
    """The thinker's compile figures from a server log."""
    took = [float(x) for x in re.findall(r"torch\.compile takes ([\d.]+) s in total", log)]
    return {"compile_s": sum(took), "compiled": len(re.findall(
        r"Compiling a graph for compile range", log)), "loaded": len(re.findall(
            r"Directly load the compiled graph", log))}


def _chat(url: str, model: str, text: str) -> tuple[int, float]:
    start = time.perf_counter()
    status, _ = post_json(f"{url}/v1/chat/completions", {
        "model": model, "max_tokens": 4, "temperature": 0, "modalities": ["text", "audio"],
        "messages": [{"role": "user", "content": text}]}, timeout=600)
    return status, time.perf_counter() - start


def _wait_log(server: Server, pattern: str, timeout: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, _log(server))
        if match:
            return match
        time.sleep(0.1)
    raise RuntimeError(f"no {pattern!r} in the log:\n{server.tail()}")


def start(argv: list[str], env: dict, log: Path, url: str, model: str,
          kill_talker: bool) -> dict:
    server = Server(argv, env, log)
    with server:
        health = wait_health(server, f"{url}/health", timeout=900)
        text = _log(server)
        result = {"health_s": health, **_compile(text)}
        talker = re.search(r"stage 1 \(talker\) engine ready in ([\d.]+) s", text)
        result["talker_ready_s"] = float(talker.group(1)) if talker else None
        status, _ = _chat(url, model, "Warm up.")
        assert status == 200, server.tail()
        if kill_talker:
            pids = re.findall(r"\((?:EngineCore|Worker)[^)]* pid=(\d+)\).*stage 1: loaded",
                              _log(server))
            os.kill(engine_core_pid(int(pids[-1])), 9)
            restarted = _wait_log(server, r"stage 1 replica \d+ .*restarted in ([\d.]+) s")
            result["talker_restart_s"] = float(restarted.group(1))
            result["after_restart"] = _chat(url, model, "After the restart.")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--talker-frames", type=int, default=16)
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    with tempfile.TemporaryDirectory(prefix="restart-bench-") as tmp:
        work = Path(tmp)
        ckpt, argv, env, url = audio_pipeline_serve(args, work)
        env = {k: v for k, v in env.items() if k != "VLLM_CPU_CI_ENV"}
        env["VLLM_CACHE_ROOT"] = str(work / "vllm-cache")
        first = start(argv, env, work / "first.log", url, str(ckpt), kill_talker=True)
        second = start(argv, env, work / "second.log", url, str(ckpt), kill_talker=False)
    rows = [[name, f"{r['health_s']:.1f}", f"{r['compile_s']:.1f}", str(r["compiled"]),
             str(r["loaded"]), f"{r['talker_ready_s']:.1f}" if r["talker_ready_s"] else "-"]
            for name, r in (("first start (empty cache)", first),
                            ("second start (its cache)", second))]
    print(table(["start", "/health s", "thinker compile s", "graphs compiled",
                 "graphs from cache", "talker ready s"], rows,
                title="vllm serve of the tiny Qwen3-Omni pipeline, inductor on"))
    status, seconds = first["after_restart"]
    print(f"talker replica after kill -9: restarted in {first['talker_restart_s']:.1f} s "
          f"(its first start: {first['talker_ready_s']:.1f} s); an audio chat after it: "
          f"{status} in {seconds:.2f} s")
    print(f"second start / first start to /health: "
          f"{second['health_s'] / first['health_s']:.2f}x")


if __name__ == "__main__":
    main()
