"""Audio chat throughput of the pipeline at several concurrencies, side by side in one run.

One ``vllm serve CKPT --stage-configs-path qwen3_omni_moe`` on the
tiny Qwen3-Omni checkpoint (every stage on vLLM's worker and model runner), with the
talker's codec-frame budget set to ``--talker-frames`` (a copy of the YAML). Each chat
asks for text and audio (``modalities: ["text", "audio"]``, greedy, ``max_tokens``
``--max-tokens`` for the thinker); the prompts differ per request.

After a warm-up at every concurrency, each of ``--trials`` trials runs ``--requests``
chats at each concurrency in ``--concurrency`` (order rotating per trial, so slow
drifts of a shared machine hit every level alike). Printed per concurrency (medians
over trials): requests/s, latency p50 and p99 (all trials' requests), the real-time
factor (request latency / seconds of speech returned; below 1 is faster than real
time) and requests/s relative to concurrency 1 (the issue's target: >= 3x at 8).

Usage (from the repository root)::

    .venv/bin/python benchmarks/audio_bench.py
    .venv/bin/python benchmarks/audio_bench.py --concurrency 1 8 16 --trials 5
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_audio_chat_args(parser)
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="audio-bench-"))
    ckpt, argv, env, url = audio_pipeline_serve(args, tmp)
    results: dict[int, list[tuple[float, list[float], list[float]]]] = {
        c: [] for c in args.concurrency}
    with Server(argv, env, tmp / "serve.log") as server:
        ready = wait_health(server, f"{url}/health", timeout=args.timeout)
        print(f"server ready in {ready:.1f} s (log {tmp / 'serve.log'})", flush=True)
        for c in args.concurrency:  # warm-up
            audio_chat_load(url, str(ckpt), 2 * c, c, args.max_tokens)
        for trial in range(args.trials):
            order = args.concurrency[trial % len(args.concurrency):] + \
                args.concurrency[:trial % len(args.concurrency)]
            for c in order:
                results[c].append(audio_chat_load(url, str(ckpt), args.requests, c,
                                                  args.max_tokens))
                print(f"trial {trial + 1}, c={c}: {results[c][-1][0]:.3f} req/s", flush=True)
    base = median([r[0] for r in results[args.concurrency[0]]])
    rows = []
    for c in args.concurrency:
        rates = [r[0] for r in results[c]]
        latencies = [x for r in results[c] for x in r[1]]
        rtf = [lat / s for r in results[c] for lat, s in zip(r[1], r[2], strict=True) if s]
        speech = [s for r in results[c] for s in r[2]]
        rows.append([str(c), fmt(median(rates), ".3f"), fmt(percentile(latencies, 0.5), ".2f"),
                     fmt(percentile(latencies, 0.99), ".2f"), fmt(median(speech), ".2f"),
                     fmt(median(rtf), ".2f"),
                     fmt(median(rates) / base, ".2f") + "x"])
    print(table(["concurrency", "req/s", "latency p50 s", "latency p99 s", "speech s",
                 "RTF p50", f"req/s vs c={args.concurrency[0]}"], rows,
                title=f"audio chat, {args.requests} chats x {args.trials} trials, thinker "
                      f"{args.max_tokens} tokens, talker <= {args.talker_frames} frames "
                      f"(log: {tmp / 'serve.log'})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
