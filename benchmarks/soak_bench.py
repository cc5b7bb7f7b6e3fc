"""A soak: mixed load against one server for a long time; per minute, the answers by
status, the API server's and the engines' resident memory, and the payload store's files.

One ``vllm serve CKPT --stage-configs-path qwen3_omni_moe`` on the
tiny Qwen3-Omni checkpoint (the talker capped at ``--talker-frames`` frames), its payload
store in a directory of its own (``VLLM_OMNI_PLUGIN_PAYLOAD_DIR``). ``--clients``
clients send requests back to back for ``--minutes`` minutes, each cycling through the
kinds of :data:`KINDS`:

* ``text``: a text-only chat; ``audio``: a chat with audio (WAV);
* ``streamed``: a chat streaming text and ``pcm16`` audio, read to the end (an ``error``
  event counts as ``stream-error``);
* ``disconnect``: the same, closed by the client after its first audio delta;
* ``bad``: a chat with unsupported ``modalities`` (a 400 is the right answer);
* ``speech``: ``/v1/audio/speech`` (WAV).

Printed per minute: answers by status, the API server's RSS, the engines' RSS (every
process under it), the files in the payload store. At the end: 5xx (and stream errors or
failed connections) for valid requests (target 0), the API server's RSS slope after
the first 5 minutes, least squares (target <= 1 MB/min), and the payload store's files
once the load stopped and in-flight requests ended (target 0). The e2e suite runs
60 seconds of it against its shared server (``plugin_tests/e2e/test_e2e_serve.py``).

    .venv/bin/python benchmarks/soak_bench.py                 # 30 minutes, 12 clients
    .venv/bin/python benchmarks/soak_bench.py --minutes 10 --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

KINDS = ("text", "audio", "streamed", "disconnect", "bad", "speech")
#: what counts as failing a valid request (a ``bad`` request's 400 is its right answer)
FAILED = ("5xx", "stream-error", "connection-error")


@dataclass
class Sample:
    """One interval of the soak."""

    seconds: float  # since the start
    answers: Counter  # (kind, outcome) -> count, in this interval
    api_rss_mb: float
    engines_rss_mb: float
    payload_files: int


@dataclass
class SoakReport:
    samples: list[Sample] = field(default_factory=list)
    #: payload store files once the load stopped and in-flight requests ended
    files_at_end: int = -1

    def totals(self) -> Counter:
        return sum((s.answers for s in self.samples), Counter())

    def failed_valid(self) -> int:
        """5xx, stream errors and failed connections of valid requests."""
        return sum(n for (kind, outcome), n in self.totals().items()
                   if outcome in FAILED or (kind == "bad" and outcome != "400"))

    def rss_slope(self, after_s: float = 300.0) -> float | None:
        """The API server's RSS slope (MB/min, least squares) of the samples after
        ``after_s`` seconds; None with fewer than 2."""
        points = [(s.seconds / 60, s.api_rss_mb) for s in self.samples if s.seconds > after_s]
        if len(points) < 2:
            return None
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        var = sum((x - mx) ** 2 for x, _ in points)
        return sum((x - mx) * (y - my) for x, y in points) / var if var else None


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MB (``VmRSS`` in /proc/PID/status); 0 when gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def engines_rss_mb(pid: int) -> float:
    """Resident memory of every process under ``pid`` (its EngineCores and workers)."""
    import psutil  # a vLLM requirement

    total = 0.0
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    for child in children:
        try:
            total += child.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return total


def payload_files(root: Path) -> int:
    """Files under the payload store's base directory (every run directory in it)."""
    return sum(len(files) for _, _, files in os.walk(root))


async def _one(session, url: str, model: str, kind: str, i: int) -> str:
    """One request of ``kind``; its outcome: the HTTP status, ``disconnected``,
    ``stream-error`` or ``connection-error``."""
    import aiohttp  # a vLLM requirement

    chat = {"model": model, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": f"request {i}: say something"}]}
    audio = {**chat, "modalities": ["text", "audio"]}
    if kind == "speech":
        path, body = "/v1/audio/speech", {"model": model, "voice": "ethan",
                                          "input": f"Sentence number {i}.",
                                          "response_format": "wav"}
    else:
        path, body = "/v1/chat/completions", {
            "text": chat, "audio": {**audio, "audio": {"format": "wav"}},
            "streamed": {**audio, "audio": {"format": "pcm16"}, "stream": True},
            "disconnect": {**audio, "audio": {"format": "pcm16"}, "stream": True},
            "bad": {**chat, "modalities": ["text", "video"]}}[kind]
    try:
        async with session.post(f"{url}{path}", json=body) as r:
            if r.status != 200 or not body.get("stream"):
                await r.read()
                return str(r.status) if r.status < 500 else "5xx"
            async for line in r.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    return "stream-error"
                delta = (event.get("choices") or [{}])[0].get("delta") or {}
                if kind == "disconnect" and (delta.get("audio") or {}).get("data"):
                    return "disconnected"  # leaving the block closes the connection
            return "200"
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return "connection-error"


async def soak(url: str, model: str, seconds: float, clients: int, server_pid: int,
               payload_root: Path, interval: float = 60.0, settle_s: float = 60.0
               ) -> SoakReport:
    """Run the soak (see the module docstring) against ``url``; ``server_pid``: the
    ``vllm serve`` process (the API server), ``payload_root``: its payload store's base
    directory. Samples every ``interval`` seconds; after the load, waits up to
    ``settle_s`` for the payload store to empty."""
    import aiohttp  # a vLLM requirement

    report = SoakReport()
    answers: Counter = Counter()
    counter = itertools.count()
    start = time.perf_counter()
    deadline = start + seconds

    async def client(session, first: int):
        for kind in itertools.islice(itertools.cycle(KINDS), first, None):
            if time.perf_counter() >= deadline:
                return
            answers[(kind, await _one(session, url, model, kind, next(counter)))] += 1

    def sample():
        report.samples.append(Sample(time.perf_counter() - start, Counter(answers),
                                     rss_mb(server_pid), engines_rss_mb(server_pid),
                                     payload_files(payload_root)))
        answers.clear()

    async def sampler():
        while True:
            await asyncio.sleep(interval)
            sample()

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(
            limit=clients, force_close=True)) as session:
        ticking = asyncio.ensure_future(sampler())
        try:
            await asyncio.gather(*(client(session, c) for c in range(clients)))
        finally:
            ticking.cancel()
    if answers or not report.samples:
        sample()
    settled = time.perf_counter() + settle_s
    while payload_files(payload_root) and time.perf_counter() < settled:
        await asyncio.sleep(0.5)
    report.files_at_end = payload_files(payload_root)
    return report


def main() -> int:
    from _common import (
        Server,
        audio_pipeline_serve,
        fmt,
        install_sigterm_as_interrupt,
        table,
        wait_health,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="tiny checkpoint dir (made if missing)")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--talker-frames", type=int, default=32,
                        help="talker max_tokens (codec frames)")
    parser.add_argument("--interval", type=float, default=60, help="seconds per sample")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="soak-bench-"))
    ckpt, argv, env, url = audio_pipeline_serve(args, tmp)
    payloads = tmp / "payloads"
    payloads.mkdir()
    env["VLLM_OMNI_PLUGIN_PAYLOAD_DIR"] = str(payloads)
    with Server(argv, env, tmp / "serve.log") as server:
        ready = wait_health(server, f"{url}/health", timeout=args.timeout)
        print(f"server ready in {ready:.1f} s (log {tmp / 'serve.log'})", flush=True)
        report = asyncio.run(soak(url, str(ckpt), args.minutes * 60, args.clients,
                                  server.proc.pid, payloads, interval=args.interval))
    rows = []
    for s in report.samples:
        by_status = Counter()
        for (_, outcome), n in s.answers.items():
            by_status[outcome] += n
        rows.append([f"{s.seconds / 60:.1f}",
                     " ".join(f"{k}:{v}" for k, v in sorted(by_status.items())),
                     f"{s.api_rss_mb:.0f}", f"{s.engines_rss_mb:.0f}", str(s.payload_files)])
    print(table(["minute", "answers by status", "API server RSS MB", "engines RSS MB",
                 "payload files"], rows, left=2,
                title=f"soak: {args.clients} clients, {args.minutes:g} min, kinds {KINDS} "
                      f"(log: {tmp / 'serve.log'})"))
    totals = report.totals()
    print()
    print("answers:", ", ".join(f"{kind} {outcome}: {n}"
                                for (kind, outcome), n in sorted(totals.items())))
    print(table(["5xx / errors for valid requests", "API server RSS slope after 5 min",
                 "payload files at the end"],
                [[str(report.failed_valid()), fmt(report.rss_slope(), ".2f") + " MB/min",
                  str(report.files_at_end)]],
                title="targets: 0, <= 1 MB/min, 0"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
