"""Audio chat throughput with the stages placed vs all on vLLM's default binding, side by
side in one run.

The same ``vllm serve CKPT --stage-configs-path qwen3_omni_moe`` as ``audio_bench.py``
(tiny Qwen3-Omni checkpoint, talker capped at ``--talker-frames``), started once per
(trial, arm), in rotating order, with ``VLLM_CPU_OMP_THREADS_BIND`` removed from its
environment (a binding there would turn placement off):

* ``placed``: the stages on ``--stage-devices`` (``runtime.devices`` per stage, e.g.
  ``0 1 1``), or, without it, where ``--omni-placement auto`` puts them;
* ``none``: ``--omni-placement none``, vLLM's own binding (on its CPU build every
  engine's worker on the first core, one core left to the other processes).

Each server logs its placement (printed) and is warmed up with ``2 x concurrency``
chats, then runs ``--requests`` chats at each concurrency in ``--concurrency``.
Printed per (concurrency, arm): requests/s (median over trials), latency p50 and p99
over all trials' requests, and the ratio placed / none of the medians (the issue's
target: >= 1.3x at concurrency 8).

Usage (from the repository root)::

    .venv/bin/python benchmarks/placement_bench.py                    # auto, c=8, 2 trials
    .venv/bin/python benchmarks/placement_bench.py --stage-devices 0 1 1 --trials 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Server,
    add_audio_chat_args,
    audio_chat_load,
    audio_pipeline_serve,
    fmt,
    install_sigterm_as_interrupt,
    median,
    percentile,
    table,
    wait_health,
)

ARMS = ("placed", "none")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_audio_chat_args(parser)
    parser.set_defaults(concurrency=[8], trials=2)
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="placement-bench-"))
    servers = {}
    for arm in ARMS:
        (tmp / arm).mkdir()
        ckpt, argv, env, url = audio_pipeline_serve(args, tmp / arm)
        args = argparse.Namespace(**{**vars(args), "checkpoint": ckpt, "stage_devices": None})
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        mode = "auto" if arm == "placed" else "none"
        servers[arm] = ([*argv, "--omni-placement", mode], env, url)
    print(f"cores this process may use: {sorted(os.sched_getaffinity(0))}", flush=True)
    results = {(c, arm): [] for c in args.concurrency for arm in ARMS}
    for trial in range(args.trials):
        for arm in ARMS[trial % 2:] + ARMS[:trial % 2]:
            argv, env, url = servers[arm]
            with Server(argv, env, tmp / arm / f"serve-{trial}.log") as server:
                ready = wait_health(server, f"{url}/health", timeout=args.timeout)
                placement = next((line.split("placement: ", 1)[1].split("; memory")[0]
                                  for _, line in server.lines if "placement: " in line), "?")
                print(f"trial {trial + 1}, {arm}: ready in {ready:.1f} s ({placement})",
                      flush=True)
                for c in args.concurrency:
                    audio_chat_load(url, str(ckpt), 2 * c, c, args.max_tokens)
                    results[c, arm].append(
                        audio_chat_load(url, str(ckpt), args.requests, c, args.max_tokens))
                    print(f"  c={c}: {results[c, arm][-1][0]:.3f} req/s", flush=True)
    rows = []
    for c in args.concurrency:
        rates = {arm: median([r[0] for r in results[c, arm]]) for arm in ARMS}
        for arm in ARMS:
            latencies = [x for r in results[c, arm] for x in r[1]]
            rows.append([str(c), arm, fmt(rates[arm], ".3f"),
                         fmt(percentile(latencies, 0.5), ".2f"),
                         fmt(percentile(latencies, 0.99), ".2f"),
                         fmt(rates[arm] / rates["none"], ".2f") + "x"])
    print(table(["concurrency", "arm", "req/s", "latency p50 s", "latency p99 s",
                 "req/s vs none"], rows,
                title=f"audio chat, {args.requests} chats x {args.trials} trials, thinker "
                      f"{args.max_tokens} tokens, talker <= {args.talker_frames} frames "
                      f"(logs: {tmp})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
