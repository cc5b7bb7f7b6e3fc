"""Time to first audio (TTFP) and real-time factor (RTF) of chat with audio, streamed
(``stream: true``, audio as ``delta.audio``) vs not, at several concurrencies, side by
side in one run on one server.

One ``vllm serve CKPT --stage-configs-path qwen3_omni_moe`` on the
tiny Qwen3-Omni checkpoint, the talker's codec-frame budget set to ``--talker-frames``
and code2wav's ``streaming`` as in the YAML unless ``--stream-chunk``,
``--stream-first-chunk`` or ``--stream-left-context`` say otherwise (streamed requests
decode the talker's frames in chunks while the talker runs; the others decode them once,
at the end). The
talker of a streamed request is fed the thinker's output while the thinker runs (the
YAML's ``stream_input``) unless ``--talker-after-thinker``.
Every chat asks for text and ``pcm16`` audio (greedy, ``--max-tokens`` thinker tokens,
prompts differing per request). Per request:

* **TTFP**: seconds from sending the request to the first audio byte: the first
  ``delta.audio`` event with audio when streamed, the whole answer when not (its audio
  arrives with it).
* **latency**: seconds to the end of the answer.
* **RTF**: latency / seconds of speech returned (below 1 is faster than real time).
* **stall**: seconds a player that starts at the first audio and plays at 24 kHz would
  wait for audio before the end (0 when every chunk arrives before the audio before it
  has played; always 0 when not streamed).

After a warm-up, each of ``--trials`` trials runs ``--requests`` chats per
(concurrency, mode), in rotating order. Printed per (concurrency, mode): requests/s
(median over trials), TTFP and RTF p50/p99 over all trials' requests, and per
concurrency the issue's two ratios: streamed TTFP p50 / non-streamed latency p50
(target <= 0.3) and streamed / non-streamed requests/s (target within 5 %).

Usage (from the repository root)::

    .venv/bin/python benchmarks/speech_stream_bench.py
    .venv/bin/python benchmarks/speech_stream_bench.py --concurrency 8 --stream-left-context 0
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Server,
    add_audio_chat_args,
    audio_deltas,
    audio_pipeline_serve,
    fmt,
    install_sigterm_as_interrupt,
    median,
    percentile,
    table,
    wait_health,
)

SAMPLE_RATE = 24000  # Qwen3-Omni's code2wav
MODES = ("non-streamed", "streamed")


async def _one(session, url: str, body: dict, stream: bool
               ) -> tuple[float, float, float, float]:
    """(TTFP s, latency s, speech s, stall s) of one chat."""
    start = time.perf_counter()
    first = None
    pcm = 0
    stall = 0.0
    runs_out = 0.0  # when a player that started at the first audio runs out of audio
    async with session.post(f"{url}/v1/chat/completions",
                            json={**body, "stream": stream}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:500]}")
        if not stream:
            answer = await r.json()
            first = time.perf_counter() - start
            pcm = len(base64.b64decode(answer["choices"][0]["message"]["audio"]["data"]))
        else:
            async for data in audio_deltas(r):
                now = time.perf_counter() - start
                first = first if first is not None else now
                stall += max(0.0, now - runs_out) if pcm else 0.0
                runs_out = max(runs_out, now) + len(data) / 2 / SAMPLE_RATE
                pcm += len(data)
    if first is None:
        raise RuntimeError("no audio in the answer")
    return first, time.perf_counter() - start, pcm / 2 / SAMPLE_RATE, stall


async def _load(url: str, model: str, requests: int, concurrency: int, max_tokens: int,
                stream: bool) -> tuple[float, list[tuple[float, float, float, float]]]:
    import aiohttp  # a vLLM requirement

    todo = iter(range(requests))
    samples: list[tuple[float, float, float, float]] = []

    def body(i):
        return {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "modalities": ["text", "audio"], "audio": {"format": "pcm16"},
                "messages": [{"role": "user", "content": f"request {i}: say something"}]}

    async def worker(session):
        for i in todo:
            samples.append(await _one(session, url, body(i), stream))

    timeout = aiohttp.ClientTimeout(total=1800)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return requests / (time.perf_counter() - start), samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_audio_chat_args(parser)
    parser.add_argument("--stream-chunk", type=int,
                        help="code2wav streaming chunk_size, frames (default: the YAML's)")
    parser.add_argument("--stream-left-context", type=int,
                        help="code2wav streaming left_context, frames (default: the YAML's)")
    parser.add_argument("--stream-first-chunk", type=int,
                        help="code2wav streaming first_chunk_size, frames (default: the "
                             "YAML's)")
    parser.add_argument("--talker-after-thinker", action="store_true",
                        help="start the talker of a streamed chat when the thinker has "
                             "finished (stream_input: false) instead of feeding it while "
                             "the thinker runs")
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="speech-stream-bench-"))
    ckpt, argv, env, url = audio_pipeline_serve(args, tmp)
    cells = [(c, mode) for c in args.concurrency for mode in MODES]
    rates: dict = {cell: [] for cell in cells}
    samples: dict = {cell: [] for cell in cells}

    def run(c, mode, n):
        return asyncio.run(_load(url, str(ckpt), n, c, args.max_tokens, mode == "streamed"))

    with Server(argv, env, tmp / "serve.log") as server:
        ready = wait_health(server, f"{url}/health", timeout=args.timeout)
        print(f"server ready in {ready:.1f} s (log {tmp / 'serve.log'})", flush=True)
        for c, mode in cells:  # warm-up
            run(c, mode, 2 * c)
        for trial in range(args.trials):
            shift = trial % len(cells)
            for c, mode in cells[shift:] + cells[:shift]:
                rate, got = run(c, mode, args.requests)
                rates[(c, mode)].append(rate)
                samples[(c, mode)].extend(got)
                print(f"trial {trial + 1}, c={c}, {mode}: {rate:.3f} req/s", flush=True)
    rows, ratios = [], []
    for c, mode in cells:
        ttfp = [s[0] for s in samples[(c, mode)]]
        rtf = [s[1] / s[2] for s in samples[(c, mode)] if s[2]]
        rows.append([str(c), mode, fmt(median(rates[(c, mode)]), ".3f"),
                     fmt(percentile(ttfp, 0.5), ".3f"), fmt(percentile(ttfp, 0.99), ".3f"),
                     fmt(percentile(rtf, 0.5), ".2f"), fmt(percentile(rtf, 0.99), ".2f"),
                     fmt(median([s[2] for s in samples[(c, mode)]]), ".2f"),
                     fmt(percentile([s[3] for s in samples[(c, mode)]], 0.99), ".3f")])
    for c in args.concurrency:
        plain = [s[1] for s in samples[(c, "non-streamed")]]
        streamed = [s[0] for s in samples[(c, "streamed")]]
        ratios.append([str(c), fmt(percentile(streamed, 0.5) / percentile(plain, 0.5), ".2f"),
                       fmt(median(rates[(c, "streamed")]) / median(rates[(c, "non-streamed")]),
                           ".3f")])
    print(table(["concurrency", "mode", "req/s", "TTFP p50 s", "TTFP p99 s", "RTF p50",
                 "RTF p99", "speech s", "stall p99 s"], rows, left=2,
                title=f"chat with audio, {args.requests} chats x {args.trials} trials per "
                      f"cell, thinker {args.max_tokens} tokens, talker <= "
                      f"{args.talker_frames} frames (log: {tmp / 'serve.log'})"))
    print()
    print(table(["concurrency", "streamed TTFP / non-streamed latency (p50)",
                 "streamed / non-streamed req/s"], ratios,
                title="targets: TTFP ratio <= 0.3, req/s ratio >= 0.95"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
