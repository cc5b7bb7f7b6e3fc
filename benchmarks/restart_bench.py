"""Start-up and restarts: a first start with an empty compile cache, a second start on
the cache it left, and a replica restarted by the head's supervisor.

Serves the tiny Qwen3-Omni pipeline (``vllm serve CKPT --stage-configs-path
qwen3_omni_moe ...``) with ``VLLM_CACHE_ROOT`` in a fresh directory and without
``VLLM_CPU_CI_ENV`` (so vLLM's CPU build compiles the thinker with inductor, as a GPU
build does):

1. **first start**: launch -> ``GET /health`` 200; from the log, how long the thinker's
   ``torch.compile`` took and whether vLLM compiled its model ("saved AOT compiled
   function") or loaded it from the cache ("Directly load AOT compilation");
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
    install_sigterm_as_interrupt,
    stage_engine_core_pid,
    table,
    timed_audio_chat,
    wait_health,
)


def _log(server: Server) -> str:
    return "\n".join(line for _, line in server.snapshot())


def _compile(server: Server) -> dict:
    """The thinker's compile figures from a server's stamped log: vLLM 0.32 saves its
    AOT-compiled model ("saved AOT compiled function") or loads it ("Directly load AOT
    compilation"); the seconds from the CPU model runner's "Warming up model for the
    compilation" to the first of those."""
    lines = server.snapshot()
    start = next((t for t, line in lines if "Warming up model for the compilation" in line),
                 None)
    saved = [t for t, line in lines if "saved AOT compiled function" in line]
    loaded = [t for t, line in lines if re.search(
        r"Directly load (AOT compilation|the compiled graph)", line)]
    done = saved + loaded
    text = "\n".join(line for _, line in lines)
    return {"compile_s": min(done) - start if start is not None and done else None,
            "compiled": len(saved), "loaded": len(loaded),
            "keys": sorted(set(re.findall(r"torch_aot_compile/(\w+)/", text))),
            "load_failures": re.findall(r"Compiling model again due to a load failure.*", text)}


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
        result = {"health_s": health, **_compile(server)}
        talker = re.search(r"stage 1 \(talker\) engine ready in ([\d.]+) s", text)
        result["talker_ready_s"] = float(talker.group(1)) if talker else None
        status, _ = timed_audio_chat(url, model, "Warm up.", timeout=600)
        assert status == 200, server.tail()
        if kill_talker:
            os.kill(stage_engine_core_pid(_log(server), 1), 9)
            restarted = _wait_log(server, r"stage 1 replica \d+ .*restarted in ([\d.]+) s")
            result["talker_restart_s"] = float(restarted.group(1))
            result["after_restart"] = timed_audio_chat(url, model, "After the restart.",
                                                       timeout=600)
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
    rows = [[name, f"{r['health_s']:.1f}",
             f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "-", str(r["compiled"]),
             str(r["loaded"]), f"{r['talker_ready_s']:.1f}" if r["talker_ready_s"] else "-"]
            for name, r in (("first start (empty cache)", first),
                            ("second start (its cache)", second))]
    print(table(["start", "/health s", "thinker compile or load s", "AOT compiled",
                 "AOT loaded from cache", "talker ready s"], rows,
                title="vllm serve of the tiny Qwen3-Omni pipeline, inductor on"))
    for name, r in (("first", first), ("second", second)):
        print(f"{name} start: compile cache keys {', '.join(k[:12] for k in r['keys'])}"
              + "".join(f"\n  {line}" for line in r["load_failures"]))
    status, seconds = first["after_restart"]
    print(f"talker replica after kill -9: restarted in {first['talker_restart_s']:.1f} s "
          f"(its first start: {first['talker_ready_s']:.1f} s); an audio chat after it: "
          f"{status} in {seconds:.2f} s")
    print(f"second start / first start to /health: "
          f"{second['health_s'] / first['health_s']:.2f}x")


if __name__ == "__main__":
    main()
