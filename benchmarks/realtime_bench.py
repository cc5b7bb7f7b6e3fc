"""Realtime API latency: end of the user's turn to the first response audio, against a
streamed chat completion of the same turn, and barge-in, side by side in one run on one
server.

One ``vllm serve CKPT --stage-configs-path qwen3_omni_moe`` on the tiny Qwen3-Omni
checkpoint (talker capped at ``--talker-frames``). Every turn is the speech fixture
(``plugin_tests/fixtures/speech/hello.flac``, 2.76 s), answered with ``--max-tokens``
thinker tokens and pcm16 audio, through the official ``openai`` SDK's realtime client.
Per turn:

* **commit**: seconds from ``input_audio_buffer.commit`` + ``response.create`` (the
  speech appended beforehand) to the first ``response.output_audio.delta``;
* **VAD**: seconds from ``input_audio_buffer.speech_stopped`` (server VAD, the speech
  and 1 s of silence appended at once) to the first ``response.output_audio.delta``;
* **chat**: seconds from sending a streamed chat completion with the same audio (an
  ``input_audio`` part, ``modalities`` text and audio, pcm16) to its first
  ``delta.audio``: what a client of ``/v1/chat/completions`` waits for the same turn;
* **barge-in**: seconds from sending speech while a response plays (after its first
  audio delta) to its ``response.done`` with status ``cancelled``.

Then ``--trials`` conversations of ``--conversation`` speech turns (12; commit mode, one
session each, the conversation growing): per turn, commit to first audio, the prompt's
tokens and, from vLLM's prefix-cache counters, those read from the cache and those
computed (target: turn 12 within 1.2x of turn 2, each turn computing about its new
tokens).

Each of ``--trials`` trials runs ``--turns`` turns per (concurrency, mode),
``concurrency`` clients at once, each doing its turns one after another, each turn on a
session of its own (so that its prompt is the chat request's: one audio turn; the
other clients' session set-up overlaps it), cells in rotating order. Sampling is the
model's default in both APIs (the Realtime API sets no temperature): a turn the tiny
model answers too briefly to speak is counted ("no speech"), not timed. The clients
parse events as the chat client parses its stream (JSON, no schema check: they share
the host's cores with the server). Printed: p50/p99 per (concurrency, mode), and per
concurrency the ratio realtime / chat of the p50s (target <= 1.0: a turn answered
through the Realtime API waits no longer than the same turn as a chat).

Usage (from the repository root)::

    .venv/bin/python benchmarks/realtime_bench.py
    .venv/bin/python benchmarks/realtime_bench.py --concurrency 1 4 --turns 8
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    Server,
    add_audio_chat_args,
    audio_deltas,
    audio_pipeline_serve,
    fmt,
    install_sigterm_as_interrupt,
    percentile,
    prefix_cache_counters,
    table,
    wait_health,
)

from plugin_tests.realtime_client import (  # noqa: E402
    Events,
    chunks,
    session,
    speech_pcm,
    text_item,
)
from vllm_omni_plugin.entrypoints.realtime.input_audio import chat_audio_part  # noqa: E402

MODES = ("commit", "VAD", "chat", "barge-in")


async def _turns(url: str, model: str, mode: str, turns: int, max_tokens: int
                 ) -> list[float]:
    """``turns`` turns of ``mode``, one after another, each on a realtime session of its
    own (for ``chat``: each a chat request); seconds per turn, None for a turn answered
    without speech."""
    import openai

    speech = speech_pcm(before_s=0.3, after_s=1.0)
    if mode == "chat":
        import aiohttp  # a vLLM requirement

        # the audio as the session hands it to the model (16 kHz WAV)
        body = {"model": model, "max_tokens": max_tokens, "stream": True,
                "modalities": ["text", "audio"], "audio": {"format": "pcm16"},
                "messages": [{"role": "user", "content": [chat_audio_part(speech)]}]}
        times = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
            for _ in range(turns):
                start = time.perf_counter()
                async with http.post(f"{url}/v1/chat/completions", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
                    first = None
                    async for _pcm in audio_deltas(r):
                        first = first or time.perf_counter() - start
                times.append(first)
        return times
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-")
    vad = {"type": "server_vad"} if mode in ("VAD", "barge-in") else None
    times = []
    for _ in range(turns):  # a session per turn: its prompt is the chat request's
        async with client.realtime.connect(model=model) as connection:
            events = Events(connection, validate=False)
            await events.until("session.created")
            await connection.session.update(session=session(
                max_output_tokens=max_tokens, turn_detection=vad))
            await events.until("session.updated")
            if mode == "barge-in":
                await connection.conversation.item.create(item=text_item("Tell me more"))
                await connection.response.create()
                if not await _first_audio(events):
                    times.append(None)
                    continue
                start = time.perf_counter()
                for piece in chunks(speech, ms=1000):
                    await connection.input_audio_buffer.append(audio=piece)
                await events.until("response.done", timeout=300)
                times.append(time.perf_counter() - start)
                await events.until("response.done", timeout=300)  # the new turn's
                continue
            for piece in chunks(speech, ms=1000):
                await connection.input_audio_buffer.append(audio=piece)
            if mode == "commit":
                start = time.perf_counter()
                await connection.input_audio_buffer.commit()
                await connection.response.create()
            else:
                await events.until("input_audio_buffer.speech_stopped")
                start = events.times[-1]  # when the speech_stopped event came
            if await _first_audio(events):
                times.append(time.perf_counter() - start)
                await events.until("response.done", timeout=300)
            else:
                times.append(None)
    return times


async def _conversation(url: str, model: str, turns: int, max_tokens: int) -> list[dict]:
    """One session of ``turns`` speech turns (commit mode), each answered before the next;
    per turn: seconds from the commit to the first audio delta (None: answered without
    speech), the prompt's tokens, and of them those read from the prefix cache and those
    computed (vLLM's counters, read between turns)."""
    import openai

    speech = speech_pcm(before_s=0.3, after_s=1.0)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-")
    out = []
    async with client.realtime.connect(model=model) as connection:
        events = Events(connection, validate=False)
        await events.until("session.created")
        await connection.session.update(session=session(max_output_tokens=max_tokens))
        await events.until("session.updated")
        for _ in range(turns):
            for piece in chunks(speech, ms=1000):
                await connection.input_audio_buffer.append(audio=piece)
            before = await asyncio.to_thread(prefix_cache_counters, url)
            start = time.perf_counter()
            await connection.input_audio_buffer.commit()
            await connection.response.create()
            spoke = await _first_audio(events)
            first = time.perf_counter() - start if spoke else None
            done = (await events.until("response.done", timeout=300))[-1]
            after = await asyncio.to_thread(prefix_cache_counters, url)
            usage = done["response"].get("usage") or {}
            queried, hits = after[0] - before[0], after[1] - before[1]
            out.append({"first_audio": first, "prompt": usage.get("input_tokens"),
                        "cached": hits, "computed": queried - hits})
    return out


async def _first_audio(events: Events) -> bool:
    """Wait for the response's first audio delta (True) or its end without one (False:
    a reply too short to speak, which the sampled tiny model sometimes gives)."""
    while True:
        kind = (await events.next(timeout=300))["type"]
        if kind in ("response.output_audio.delta", "response.done"):
            return kind == "response.output_audio.delta"


async def _load(url, model, mode, concurrency, turns, max_tokens) -> list[float]:
    per_client = max(1, turns // concurrency)
    results = await asyncio.gather(*(_turns(url, model, mode, per_client, max_tokens)
                                     for _ in range(concurrency)))
    return [t for r in results for t in r]  # None: a turn answered without speech


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_audio_chat_args(parser)
    parser.add_argument("--turns", type=int, default=8, help="turns per measurement")
    parser.add_argument("--conversation", type=int, default=12, metavar="TURNS",
                        help="then --trials sessions of this many speech turns each, the "
                        "conversation growing (0: none)")
    parser.set_defaults(concurrency=[1, 4], max_tokens=8, talker_frames=16)
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="realtime-bench-"))
    ckpt, argv, env, url = audio_pipeline_serve(args, tmp)
    cells = [(c, mode) for c in args.concurrency for mode in MODES]
    samples: dict = {cell: [] for cell in cells}

    def run(c, mode, turns):
        return asyncio.run(_load(url, str(ckpt), mode, c, turns, args.max_tokens))

    with Server(argv, env, tmp / "serve.log") as server:
        ready = wait_health(server, f"{url}/health", timeout=args.timeout)
        print(f"server ready in {ready:.1f} s (log {tmp / 'serve.log'})", flush=True)
        for c, mode in cells:  # warm-up
            run(c, mode, c)
        for trial in range(args.trials):
            shift = trial % len(cells)
            for c, mode in cells[shift:] + cells[:shift]:
                got = run(c, mode, args.turns)
                samples[(c, mode)].extend(got)
                timed = [t for t in got if t is not None]
                print(f"trial {trial + 1}, c={c}, {mode}: p50 "
                      f"{fmt(percentile(timed, 0.5) if timed else None, '.3f')} s", flush=True)
        conversations = [asyncio.run(_conversation(url, str(ckpt), args.conversation,
                                                   args.max_tokens))
                         for _ in range(args.trials if args.conversation else 0)]
    silent = {cell: sum(t is None for t in got) for cell, got in samples.items()}
    samples = {cell: [t for t in got if t is not None] for cell, got in samples.items()}
    rows = [[str(c), mode, str(len(samples[(c, mode)])), str(silent[(c, mode)]),
             fmt(percentile(samples[(c, mode)], 0.5), ".3f"),
             fmt(percentile(samples[(c, mode)], 0.99), ".3f")] for c, mode in cells]
    ratios = [[str(c), *(fmt(percentile(samples[(c, mode)], 0.5)
                             / percentile(samples[(c, "chat")], 0.5), ".2f")
                         for mode in ("commit", "VAD"))] for c in args.concurrency]
    print(table(["concurrency", "mode", "turns", "no speech", "p50 s", "p99 s"], rows, left=2,
                title=f"realtime turns (commit/VAD: end of turn -> first audio delta; chat: "
                      f"request -> first delta.audio; barge-in: speech -> response "
                      f"cancelled), thinker {args.max_tokens} tokens, talker <= "
                      f"{args.talker_frames} frames (log: {tmp / 'serve.log'})"))
    print()
    print(table(["concurrency", "commit / chat (p50)", "VAD stop / chat (p50)"], ratios,
                title="target: <= 1.0"))
    if conversations:
        _print_conversations(conversations)
    return 0


def _print_conversations(conversations: list[list[dict]]) -> None:
    """Per turn, the medians over the conversations; then turn N over turn 2."""
    rows, firsts = [], []
    for turn in range(len(conversations[0])):
        got = [c[turn] for c in conversations]
        first = percentile([g["first_audio"] for g in got if g["first_audio"] is not None],
                           0.5) if any(g["first_audio"] for g in got) else None
        firsts.append(first)
        rows.append([str(turn + 1), fmt(first, ".3f"),
                     *(fmt(percentile([g[key] for g in got if g[key] is not None], 0.5)
                           if any(g[key] is not None for g in got) else None, ".0f")
                       for key in ("prompt", "cached", "computed"))])
    print()
    print(table(["turn", "commit -> first audio s (p50)", "prompt tokens", "read from cache",
                 "computed"], rows, left=1,
                title=f"{len(conversations)} conversations of {len(rows)} speech turns "
                      "(one session each; tokens: vLLM's prefix-cache counters)"))
    if len(firsts) >= 2 and firsts[1] and firsts[-1]:
        print(f"turn {len(firsts)} / turn 2 (commit -> first audio): "
              f"{firsts[-1] / firsts[1]:.2f} (target <= 1.2)")


if __name__ == "__main__":
    sys.exit(main())
