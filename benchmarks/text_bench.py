"""Text chat throughput: the plugin's pipeline vs plain ``vllm serve``, side by side.

Both servers serve the same tiny Qwen3-Omni checkpoint on the same vLLM build:

* **plain**: ``vllm serve CKPT`` with the plugin switched off (``VLLM_PLUGINS=none``):
  vLLM's own ``Qwen3OmniMoeThinkerForConditionalGeneration`` on vLLM's worker;
* **plugin**: ``vllm serve CKPT --stage-configs-path qwen3_omni_moe``:
  the thinker stage (vLLM's class, extended, on the plugin's ``OmniWorker``) answering
  text, with the talker and code2wav engines started and idle.

Both servers run at once (the idle one costs nothing once its workers stop polling),
are warmed up with four waves of chats at each concurrency, then for each concurrency
in ``--concurrency`` and each of ``--trials`` paired trials (order alternating) each
answers ``--requests`` chats (``max_tokens`` ``--max-tokens``, ``ignore_eos``, greedy,
so every chat generates the same number of tokens) with that many in flight. Pairing
in time cancels the slow drifts of a shared 2-core machine. Printed per concurrency:
requests/s of each (median), the median and range of the per-trial ratios plugin /
plain (targets: median >= 0.95, lowest pair >= 0.8). Each server places its engines
as ``--omni-placement auto`` does (the default; on 2 cores, vLLM's own binding).

Common flags of both servers: ``--max-model-len 2048 --dtype float32
--gpu-memory-utilization 0.3`` and ``VLLM_CPU_KVCACHE_SPACE=1`` (vLLM's CPU build).

Usage (from the repository root)::

    .venv/bin/python benchmarks/text_bench.py
    .venv/bin/python benchmarks/text_bench.py --trials 9 --requests 512
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Server,
    chat_load,
    fmt,
    free_port,
    install_sigterm_as_interrupt,
    make_checkpoint,
    median,
    table,
    venv_bin,
    wait_health,
)

from vllm_omni_plugin.config.pipelines import builtin_pipeline  # noqa: E402

YAML = Path(builtin_pipeline("qwen3_omni_moe"))
#: pause before each measurement: the idle server's workers busy-poll for about 1 s
#: after their last step (vLLM's shm_broadcast SpinCondition), and a plugin measurement
#: started within 2.5 s of plain vLLM's ran at a quarter of its rate (issue 28)
IDLE_S = 3.0
COMMON = ["--max-model-len", "2048", "--dtype", "float32", "--gpu-memory-utilization", "0.3"]


def _load(url: str, model: str, requests: int, concurrency: int, max_tokens: int) -> float:
    """Requests/s for ``requests`` chats with ``concurrency`` in flight."""

    def body(i):
        return {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user",
                              "content": f"request {i}: tell me about the weather"}]}

    def check(i, answer, _latency):
        if answer["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"chat {i}: {answer['usage']} != {max_tokens} tokens")

    return chat_load(url, body, requests, concurrency, check)


def start(name: str, ckpt: Path, args, logdir: Path) -> tuple[Server, str]:
    port = free_port()
    argv = [venv_bin("vllm"), "serve", str(ckpt), *COMMON, "--host", "127.0.0.1",
            "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if name == "plugin":
        argv += ["--stage-configs-path", str(YAML)]
    else:
        env["VLLM_PLUGINS"] = "none"
    server = Server(argv, env, logdir / f"{name}.log")
    server.start()
    url = f"http://127.0.0.1:{port}"
    ready = wait_health(server, f"{url}/health", timeout=args.timeout)
    print(f"{name}: ready in {ready:.1f} s (log {logdir / (name + '.log')})", flush=True)
    return server, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="tiny checkpoint dir (made if missing)")
    parser.add_argument("--trials", type=int, default=8, help="paired measurements per concurrency")
    parser.add_argument("--requests", type=int, default=256, help="chats per measurement")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="text-bench-"))
    ckpt = args.checkpoint or tmp / "ckpt"
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt)
    servers = {}
    try:
        for name in ("plain", "plugin"):
            servers[name] = start(name, ckpt, args, tmp)
        for _, url in servers.values():
            for c in args.concurrency:  # warm-up: every batch size class, a few times
                _load(url, str(ckpt), 4 * c, c, args.max_tokens)
        rows = []
        for c in args.concurrency:
            rates: dict[str, list[float]] = {"plain": [], "plugin": []}
            for trial in range(args.trials):
                order = ["plain", "plugin"] if trial % 2 == 0 else ["plugin", "plain"]
                for name in order:
                    time.sleep(IDLE_S)  # the other server's workers go idle first
                    rates[name].append(_load(servers[name][1], str(ckpt), args.requests, c,
                                             args.max_tokens))
                print(f"c={c} trial {trial + 1}: plain {rates['plain'][-1]:.1f}, plugin "
                      f"{rates['plugin'][-1]:.1f} req/s", flush=True)
            ratios = [b / a for a, b in zip(rates["plain"], rates["plugin"], strict=True)]
            rows.append([str(c), fmt(median(rates["plain"])), fmt(median(rates["plugin"])),
                         fmt(median(ratios), ".2f") + "x",
                         f"{min(ratios):.2f}-{max(ratios):.2f}"])
    finally:
        for server, _ in servers.values():
            server.stop()
    print(table(["concurrency", "plain req/s", "plugin req/s", "plugin / plain (median)",
                 "range"], rows,
                title=f"text chat, {args.requests} chats x {args.max_tokens} tokens, "
                      f"{args.trials} paired trials (logs: {tmp})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
