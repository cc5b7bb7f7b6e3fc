"""Spoken answers after a shared system prompt: cold (computed whole) vs warm (read from
vLLM's prefix cache, the skipped positions' rows from the thinker's row cache).

One ``vllm serve CKPT --stage-configs-path qwen3_omni_moe`` on the tiny Qwen3-Omni
checkpoint (talker capped at ``--talker-frames``). Every chat is streamed, asks for text
and audio, and starts with the same system message of ``--system-prompt-tokens`` tokens
followed by a user turn of its own (never seen before). A **cold** chat carries a
``cache_salt`` of its own (vLLM's request field: its blocks hash apart from every other
request's), so it
computes its whole prompt; a **warm** chat carries the shared salt, so the system
message's blocks are read from the cache once the first warm chat computed them. Chats
run one at a time, cold and warm alternating, ``--requests`` of each per trial.

Per chat: time to first audio (request sent to the first ``delta.audio``) and the
thinker's prompt tokens read from the cache and computed (vLLM's prefix-cache counters
on ``/metrics``, read between chats). Printed: per trial the p50s, then the medians over
all chats and warm / cold.

Usage (from the repository root)::

    .venv/bin/python benchmarks/spoken_prefix_bench.py
    .venv/bin/python benchmarks/spoken_prefix_bench.py --system-prompt-tokens 1500 --requests 16
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
    median,
    prefix_cache_counters,
    system_prompt,
    table,
    wait_health,
)


async def _chat(url: str, body: dict) -> dict:
    """One streamed chat: seconds to its first audio, and the prompt tokens the thinker
    read from the cache and computed."""
    import aiohttp  # a vLLM requirement

    before = await asyncio.to_thread(prefix_cache_counters, url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        start = time.perf_counter()
        first = None
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
            async for _pcm in audio_deltas(r):
                first = first or time.perf_counter() - start
    after = await asyncio.to_thread(prefix_cache_counters, url)
    queried, hits = after[0] - before[0], after[1] - before[1]
    return {"first_audio": first, "cached": hits, "computed": queried - hits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_audio_chat_args(parser)
    parser.add_argument("--system-prompt-tokens", type=int, default=1500)
    parser.set_defaults(requests=8, max_tokens=8, talker_frames=16)
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="spoken-prefix-bench-"))
    ckpt, argv, env, url = audio_pipeline_serve(args, tmp)
    system = system_prompt(ckpt, args.system_prompt_tokens)

    def body(i: str, salt: str) -> dict:
        return {"model": str(ckpt), "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "modalities": ["text", "audio"],
                "audio": {"format": "pcm16"}, "cache_salt": salt,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"request {i}: say something"}]}

    seen: dict[str, list[dict]] = {"cold": [], "warm": []}
    with Server(argv, env, tmp / "serve.log") as server:
        ready = wait_health(server, f"{url}/health", timeout=args.timeout)
        print(f"server ready in {ready:.1f} s (log {tmp / 'serve.log'})", flush=True)
        asyncio.run(_chat(url, body("warm-up", "shared")))  # the shared prefix computed
        for trial in range(args.trials):
            got: dict[str, list[dict]] = {"cold": [], "warm": []}
            for i in range(args.requests):
                for kind in ("cold", "warm"):
                    salt = f"cold-{trial}-{i}" if kind == "cold" else "shared"
                    got[kind].append(asyncio.run(_chat(url, body(f"{trial}.{i}", salt))))
            for kind, chats in got.items():
                seen[kind].extend(chats)
                print(f"trial {trial + 1}, {kind}: first audio p50 "
                      f"{fmt(median([c['first_audio'] for c in chats]), '.3f')} s, "
                      f"computed {fmt(median([c['computed'] for c in chats]), '.0f')} "
                      f"tokens", flush=True)
    rows, firsts = [], {}
    for kind, chats in seen.items():
        firsts[kind] = median([c["first_audio"] for c in chats])
        rows.append([kind, str(len(chats)), fmt(firsts[kind], ".3f"),
                     fmt(median([c["cached"] for c in chats]), ".0f"),
                     fmt(median([c["computed"] for c in chats]), ".0f")])
    print(table(["chats", "n", "first audio s (p50)", "prompt tokens read from cache",
                 "prompt tokens computed"], rows, left=1,
                title=f"spoken chats after a {args.system_prompt_tokens}-token system "
                      f"message, one at a time (log: {tmp / 'serve.log'})"))
    print(f"warm / cold, first audio: {firsts['warm'] / firsts['cold']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
