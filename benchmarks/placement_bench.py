"""Audio chat throughput with the stages placed (``--omni-placement auto``) vs all on
vLLM's default binding (``none``), side by side in one run.

The same ``vllm serve CKPT --stage-configs-path qwen3_omni_moe`` as ``audio_bench.py``
(tiny Qwen3-Omni checkpoint, talker capped at ``--talker-frames``), started once per
(trial, placement), in rotating order, with ``VLLM_CPU_OMP_THREADS_BIND`` removed from
its environment (a binding there would turn ``auto`` off). On vLLM's CPU build ``auto``
puts the thinker's worker on the first half of the cores and the talker's and code2wav's
on the rest; ``none`` leaves vLLM's binding, which puts every engine's worker on the
first core. Each server is warmed up with ``2 x concurrency`` chats, then runs
``--requests`` chats at each concurrency in ``--concurrency``.

Printed per (concurrency, placement): requests/s (median over trials), latency p50 and
p99 over all trials' requests, and the ratio auto / none of the medians (the issue's
target: >= 1.3x at concurrency 8).

Usage (from the repository root)::

    .venv/bin/python benchmarks/placement_bench.py                    # c=8, 2 trials
    .venv/bin/python benchmarks/placement_bench.py --concurrency 1 8 --trials 3
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

PLACEMENTS = ("auto", "none")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_audio_chat_args(parser)
    parser.set_defaults(concurrency=[8], trials=2)
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="placement-bench-"))
    ckpt, argv, env, url = audio_pipeline_serve(args, tmp)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    print(f"cores this process may use: {sorted(os.sched_getaffinity(0))}", flush=True)
    results = {(c, p): [] for c in args.concurrency for p in PLACEMENTS}
    for trial in range(args.trials):
        for placement in PLACEMENTS[trial % 2:] + PLACEMENTS[:trial % 2]:
            log = tmp / f"serve-{trial}-{placement}.log"
            with Server([*argv, "--omni-placement", placement], env, log) as server:
                ready = wait_health(server, f"{url}/health", timeout=args.timeout)
                print(f"trial {trial + 1}, {placement}: ready in {ready:.1f} s", flush=True)
                for c in args.concurrency:
                    audio_chat_load(url, str(ckpt), 2 * c, c, args.max_tokens)
                    results[c, placement].append(
                        audio_chat_load(url, str(ckpt), args.requests, c, args.max_tokens))
                    print(f"  c={c}: {results[c, placement][-1][0]:.3f} req/s", flush=True)
    rows = []
    for c in args.concurrency:
        rates = {p: median([r[0] for r in results[c, p]]) for p in PLACEMENTS}
        for p in PLACEMENTS:
            latencies = [x for r in results[c, p] for x in r[1]]
            rows.append([str(c), p, fmt(rates[p], ".3f"), fmt(percentile(latencies, 0.5), ".2f"),
                         fmt(percentile(latencies, 0.99), ".2f"),
                         fmt(rates[p] / rates["none"], ".2f") + "x"])
    print(table(["concurrency", "placement", "req/s", "latency p50 s", "latency p99 s",
                 "req/s vs none"], rows,
                title=f"audio chat, {args.requests} chats x {args.trials} trials, thinker "
                      f"{args.max_tokens} tokens, talker <= {args.talker_frames} frames "
                      f"(logs: {tmp})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
