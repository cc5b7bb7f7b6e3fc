"""The talker's time per frame in a streamed chat with a long user turn vs a short one:
what the talker's input costs it per step as the thinker's output grows.

One ``vllm serve CKPT --stage-configs-path qwen3_omni_moe`` on the
tiny Qwen3-Omni checkpoint (``--max-model-len`` large enough for the long turn), the
talker capped at ``--talker-frames`` frames. Each chat streams text and ``pcm16``
audio: the talker is fed the thinker's output while the thinker runs (the YAML's
``stream_input``) and code2wav decodes its frames in chunks. The user turns are
``--long`` and ``--short`` tokens of filler text (counted with the checkpoint's chat
template); the thinker writes ``--max-tokens`` tokens (``ignore_eos``), one talker frame
each, so the talker runs on an input that grows nearly every step.

Per chat, the talker's time per frame is the time from its first audio delta to its
last divided by the frames between them (1,920 samples a frame at 24 kHz): steady state,
after the prefill. After a warm-up, ``--trials`` pairs of chats (long and short, the
order alternating) run one at a time. Prints the median ms per frame of each and the
median and range of the per-pair ratio long ÷ short (issue 27's target: ≤ 1.2).

    .venv/bin/python benchmarks/talker_feed_bench.py
    .venv/bin/python benchmarks/talker_feed_bench.py --long 4000 --short 100 --trials 7
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Server,
    audio_deltas,
    audio_pipeline_serve,
    fmt,
    install_sigterm_as_interrupt,
    median,
    table,
    wait_health,
)

SAMPLES_PER_FRAME = 1920  # Qwen3-Omni's code2wav: 24 kHz, 12.5 frames a second


def _user_turn(ckpt: Path, tokens: int) -> str:
    """Filler text whose chat prompt (one user turn) has about ``tokens`` token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))

    def length(words: int) -> int:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": " ".join(["hello"] * words)}],
            add_generation_prompt=True, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    low, high = 1, tokens  # the most words whose prompt fits in ``tokens`` ids
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if length(mid) <= tokens else (low, mid - 1)
    return " ".join(["hello"] * low)


async def _frame_ms(url: str, model: str, text: str, max_tokens: int) -> float:
    """The talker's ms per frame in one streamed chat (see the module docstring)."""
    import aiohttp  # a vLLM requirement

    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "modalities": ["text", "audio"], "audio": {"format": "pcm16"}, "stream": True,
            "messages": [{"role": "user", "content": text}]}
    arrivals: list[tuple[float, int]] = []  # (seconds, samples) per audio delta
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session, \
            session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:500]}")
        async for data in audio_deltas(r):
            arrivals.append((time.perf_counter(), len(data) // 2))
    if len(arrivals) < 2:
        raise RuntimeError(f"{len(arrivals)} audio deltas: too few to time the talker")
    frames = sum(s for _, s in arrivals[1:]) / SAMPLES_PER_FRAME
    return 1000 * (arrivals[-1][0] - arrivals[0][0]) / frames


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="tiny checkpoint dir (made if missing)")
    parser.add_argument("--long", type=int, default=4000, help="long user turn, tokens")
    parser.add_argument("--short", type=int, default=100, help="short user turn, tokens")
    parser.add_argument("--max-tokens", type=int, default=48, help="thinker tokens per chat")
    parser.add_argument("--talker-frames", type=int, default=48,
                        help="talker max_tokens (codec frames)")
    parser.add_argument("--trials", type=int, default=5, help="pairs of chats")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    args.max_model_len = max(2048, args.long + args.max_tokens + 16)
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="talker-feed-bench-"))
    ckpt, argv, env, url = audio_pipeline_serve(args, tmp)
    turns = {"long": _user_turn(ckpt, args.long), "short": _user_turn(ckpt, args.short)}
    times: dict[str, list[float]] = {kind: [] for kind in turns}

    def chat(kind: str) -> float:
        return asyncio.run(_frame_ms(url, str(ckpt), turns[kind], args.max_tokens))

    with Server(argv, env, tmp / "serve.log") as server:
        ready = wait_health(server, f"{url}/health", timeout=args.timeout)
        print(f"server ready in {ready:.1f} s (log {tmp / 'serve.log'})", flush=True)
        chat("long"), chat("short")  # warm-up
        for trial in range(args.trials):
            for kind in ("long", "short") if trial % 2 == 0 else ("short", "long"):
                times[kind].append(chat(kind))
            print(f"trial {trial + 1}: long {times['long'][-1]:.1f} ms/frame, short "
                  f"{times['short'][-1]:.1f} ms/frame", flush=True)
    ratios = [a / b for a, b in zip(times["long"], times["short"], strict=True)]
    print(table(["user turn (tokens)", "long ms/frame", "short ms/frame",
                 "long ÷ short (median)", "range"],
                [[f"{args.long} vs {args.short}", fmt(median(times["long"])),
                  fmt(median(times["short"])), fmt(median(ratios), ".3f"),
                  f"{min(ratios):.3f}-{max(ratios):.3f}"]],
                title=f"talker of a streamed chat, {args.trials} pairs, thinker "
                      f"{args.max_tokens} tokens, talker <= {args.talker_frames} frames"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
