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

Printed per minute (as it goes, and as a table at the end): answers (all, and by
status), the API server's RSS and its two parts, ``RssAnon`` (its heaps: what a leak
grows) and ``RssFile`` (mapped libraries and model files, which the kernel drops and
pages back in as the host's memory comes and goes: on a shared host the RSS moves with
it), the engines' RSS (every process under it), the files in the payload store. At the
end: 5xx (and stream errors or failed connections) for valid requests (target 0), the
API server's RSS slope after the first 5 minutes, least squares (target <= 1 MB/min),
the payload store's files once the load stopped and in-flight requests ended (target 0;
the first 20 are listed), and the verdict on the API server's RSS and ``RssAnon``: the
slope over the last ``--tail-minutes`` minutes, and the minute from which it is flat
(the first sample, with at least 4 after it, that no later one exceeds by more than
``--flat-band`` MB), with what it grew before and after. ``--json``
writes the samples to a file. The e2e suite runs 60 seconds of it against its shared
server (``plugin_tests/e2e/test_e2e_serve.py``).

``--trace DIR`` runs the server under ``traced_serve.py``: ``vllm serve`` in-process,
with a thread that writes to DIR the RSS, glibc's heap in use and free, the lines whose
allocations grew (tracemalloc), object counts by type and the sizes of vLLM's and the
plugin's collections, against a baseline. After sample ``--trace-from`` (2) the clients
pause until no request is in flight and the probe has its baseline, then go on; the
probe samples every ``--interval`` seconds, and once the load is over and nothing is in
flight it takes ``sample-idle.txt``: baseline and idle sample, both without requests in
flight, tell what stays per request (``--trim``: glibc's ``malloc_trim(0)`` before each
sample). Tracing slows the API server several times and adds some 20 MB of its own.
Variables such as ``MALLOC_ARENA_MAX`` pass through to the server.

    .venv/bin/python benchmarks/soak_bench.py                 # 30 minutes, 12 clients
    .venv/bin/python benchmarks/soak_bench.py --minutes 10 --clients 8
    .venv/bin/python benchmarks/soak_bench.py --minutes 10 --trace /tmp/soak-trace
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
    #: the API server's anonymous memory (its heaps; ``RssAnon``) and mapped files
    #: (``RssFile``: libraries and model files, paged in and out with the host's memory)
    api_anon_mb: float = 0.0
    api_file_mb: float = 0.0


@dataclass
class SoakReport:
    samples: list[Sample] = field(default_factory=list)
    #: payload store files once the load stopped and in-flight requests ended
    files_at_end: int = -1
    #: a few of those files (paths under the payload store's base directory)
    files_left: list[str] = field(default_factory=list)
    #: :class:`Sample` field -> its value when the server was ready (before the load)
    at_ready: dict[str, float] = field(default_factory=dict)
    #: seconds the clients paused for ``on_pause`` (see :func:`soak`)
    paused_s: float = 0.0

    def totals(self) -> Counter:
        return sum((s.answers for s in self.samples), Counter())

    def failed_valid(self) -> int:
        """5xx, stream errors and failed connections of valid requests."""
        return sum(n for (kind, outcome), n in self.totals().items()
                   if outcome in FAILED or (kind == "bad" and outcome != "400"))

    def rss_slope(self, after_s: float = 300.0, what: str = "api_rss_mb") -> float | None:
        """The slope (MB/min, least squares) of the API server's RSS (``what``: the
        :class:`Sample` field, e.g. ``api_anon_mb``) over the samples after ``after_s``
        seconds; None with fewer than 2."""
        return _slope([(s.seconds / 60, getattr(s, what)) for s in self.samples
                       if s.seconds > after_s])

    def tail_slope(self, minutes: float, what: str = "api_rss_mb") -> float | None:
        """The slope (MB/min) of ``what`` over the last ``minutes`` of the soak."""
        if not self.samples:
            return None
        return self.rss_slope(self.samples[-1].seconds - minutes * 60 - 1e-6, what)

    def flat_from(self, band: float = 5.0, window: int = 5,
                  what: str = "api_rss_mb") -> Sample | None:
        """The first sample from which ``what`` is flat: no later sample is more than
        ``band`` MB above it, and at least ``window`` samples (itself included) are left;
        None when there is none (it still grows, or too few samples)."""
        for i in range(len(self.samples) - window + 1):
            here = getattr(self.samples[i], what)
            if max(getattr(s, what) for s in self.samples[i:]) - here <= band:
                return self.samples[i]
        return None


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``points``; None with fewer than 2 or no spread."""
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else None


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of ``pid`` in MB (``field`` of /proc/PID/status: ``VmRSS``, or its
    parts ``RssAnon``, ``RssFile``, ``RssShmem``); 0 when gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
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
               payload_root: Path, interval: float = 60.0, settle_s: float = 60.0,
               on_sample=None, pause_after: int | None = None, on_pause=None,
               on_idle=None) -> SoakReport:
    """Run the soak (see the module docstring) against ``url``; ``server_pid``: the
    ``vllm serve`` process (the API server), ``payload_root``: its payload store's base
    directory. Samples every ``interval`` seconds (each :class:`Sample` also goes to
    ``on_sample``, if given); after the load, waits up to ``settle_s`` for the payload
    store to empty. After sample ``pause_after`` the clients pause, once no request is
    in flight ``await on_pause()`` runs, then they go on (the load still lasts
    ``seconds``); at the end, with nothing in flight, ``await on_idle()`` runs."""
    import aiohttp  # a vLLM requirement

    report = SoakReport()
    answers: Counter = Counter()
    counter = itertools.count()
    start = time.perf_counter()
    deadline = start + seconds
    going = asyncio.Event()
    going.set()
    in_flight = 0

    async def client(session, first: int):
        nonlocal in_flight
        for kind in itertools.islice(itertools.cycle(KINDS), first, None):
            await going.wait()
            if time.perf_counter() >= deadline:
                return
            in_flight += 1
            try:
                outcome = await _one(session, url, model, kind, next(counter))
            finally:
                in_flight -= 1
            answers[(kind, outcome)] += 1

    def sample():
        report.samples.append(Sample(time.perf_counter() - start, Counter(answers),
                                     rss_mb(server_pid), engines_rss_mb(server_pid),
                                     payload_files(payload_root),
                                     rss_mb(server_pid, "RssAnon"),
                                     rss_mb(server_pid, "RssFile")))
        answers.clear()
        if on_sample is not None:
            on_sample(report.samples[-1])

    async def pause():
        nonlocal deadline
        going.clear()
        paused = time.perf_counter()
        while in_flight:
            await asyncio.sleep(0.2)
        await on_pause()
        report.paused_s = time.perf_counter() - paused
        deadline += report.paused_s
        going.set()

    async def sampler():
        while True:
            await asyncio.sleep(interval)
            sample()
            if on_pause is not None and len(report.samples) == pause_after:
                await pause()

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
    report.files_left = sorted(str(Path(d, f).relative_to(payload_root))
                               for d, _, files in os.walk(payload_root) for f in files)[:20]
    if on_idle is not None:
        await on_idle()
    return report


def _by_status(sample: Sample) -> Counter:
    by_status: Counter = Counter()
    for (_, outcome), n in sample.answers.items():
        by_status[outcome] += n
    return by_status


def _row(s: Sample) -> list[str]:
    by_status = _by_status(s)
    return [f"{s.seconds / 60:.1f}", str(sum(by_status.values())),
            " ".join(f"{k}:{v}" for k, v in sorted(by_status.items())),
            f"{s.api_rss_mb:.0f}", f"{s.api_anon_mb:.0f}", f"{s.api_file_mb:.0f}",
            f"{s.engines_rss_mb:.0f}", str(s.payload_files)]


def verdict(report: SoakReport, tail_minutes: float, limit: float = 1.0,
            band: float = 5.0) -> str:
    """The verdict on the API server's memory (see the module docstring), for its RSS and
    for its anonymous part (``RssAnon``: what its heaps hold; the rest, mapped library
    and model files, is paged in and out as the host's memory comes and goes)."""
    if len(report.samples) < 2:
        return "too few samples for a verdict"
    first, last = report.samples[0], report.samples[-1]
    lines = []
    for what, name in (("api_rss_mb", "RSS"), ("api_anon_mb", "RssAnon")):
        tail = report.tail_slope(tail_minutes, what)
        v0, v1 = getattr(first, what), getattr(last, what)
        ready = report.at_ready.get(what)
        lines.append(f"API server {name}: "
                     f"{'' if ready is None else f'{ready:.0f} MB when ready, '}"
                     f"{v0:.0f} MB at minute {first.seconds / 60:.1f}, "
                     f"{v1:.0f} MB at minute {last.seconds / 60:.1f} ({v1 - v0:+.0f} MB); "
                     f"slope over the last {tail_minutes:g} min: "
                     f"{'-' if tail is None else f'{tail:.2f}'} MB/min (target <= {limit:g})")
        flat = report.flat_from(band, what=what)
        if len(report.samples) < 5:
            lines.append("  too few samples (< 5) to tell when it flattened")
        elif flat is None:
            lines.append(f"  not flat: from no sample with 4 or more after it does it stay "
                         f"within {band:g} MB of its value there")
        else:
            vf = getattr(flat, what)
            lines.append(f"  flat from minute {flat.seconds / 60:.1f} (no later sample more "
                         f"than {band:g} MB above it): {vf - v0:+.0f} MB before it (from "
                         f"minute {first.seconds / 60:.1f}), {v1 - vf:+.0f} MB after it")
    return "\n".join(lines)


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
    parser.add_argument("--tail-minutes", type=float, default=10,
                        help="the verdict's slope is over the last this many minutes")
    parser.add_argument("--flat-band", type=float, default=5.0,
                        help="MB: flat from the first sample no later one exceeds by more")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, help="also write the samples to this file")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="run the server under traced_serve.py, writing to DIR")
    parser.add_argument("--trace-from", type=int, default=2, metavar="N",
                        help="with --trace: after sample N the clients pause while the "
                             "probe takes its baseline with nothing in flight")
    parser.add_argument("--trim", action="store_true",
                        help="with --trace: malloc_trim(0) before each trace sample")
    args = parser.parse_args()
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="soak-bench-"))
    ckpt, argv, env, url = audio_pipeline_serve(args, tmp)
    start_file, idle_file = tmp / "trace-start", tmp / "trace-idle"
    if args.trace is not None:
        # the probe takes its baseline once start_file exists, an idle sample once
        # idle_file does (both while no request is in flight: see soak())
        argv = [sys.executable, str(Path(__file__).resolve().parent / "traced_serve.py"),
                "--out", str(args.trace), "--start-file", str(start_file),
                "--idle-file", str(idle_file), "--interval", str(args.interval),
                *(["--trim"] if args.trim else []), "--", *argv[1:]]

    async def probe_step(trigger: Path, done: str) -> None:
        trigger.touch()
        waited = time.perf_counter() + args.timeout
        while not (args.trace / done).exists() and time.perf_counter() < waited:
            await asyncio.sleep(0.5)
        print(f"trace: {done} after {args.timeout - (waited - time.perf_counter()):.0f} s",
              flush=True)

    async def on_pause() -> None:
        await probe_step(start_file, "baseline.done")

    async def on_idle() -> None:
        await probe_step(idle_file, "idle.done")

    payloads = tmp / "payloads"
    payloads.mkdir()
    env["VLLM_OMNI_PLUGIN_PAYLOAD_DIR"] = str(payloads)

    def on_sample(s: Sample) -> None:
        minute, answers, by_status, api, anon, mapped, engines, files = _row(s)
        print(f"minute {minute}: {answers} answers ({by_status}), API server {api} MB "
              f"(anon {anon}, file {mapped}), engines {engines} MB, payload files {files}",
              flush=True)

    with Server(argv, env, tmp / "serve.log") as server:
        ready = wait_health(server, f"{url}/health", timeout=args.timeout)
        pid = server.proc.pid
        at_ready = {"api_rss_mb": rss_mb(pid), "api_anon_mb": rss_mb(pid, "RssAnon"),
                    "api_file_mb": rss_mb(pid, "RssFile"), "engines_rss_mb": engines_rss_mb(pid)}
        print(f"server ready in {ready:.1f} s (log {tmp / 'serve.log'}); API server RSS "
              f"{at_ready['api_rss_mb']:.0f} MB (anon {at_ready['api_anon_mb']:.0f}), engines "
              f"{at_ready['engines_rss_mb']:.0f} MB", flush=True)
        traced = args.trace is not None
        report = asyncio.run(soak(url, str(ckpt), args.minutes * 60, args.clients,
                                  server.proc.pid, payloads, interval=args.interval,
                                  on_sample=on_sample, pause_after=args.trace_from,
                                  on_pause=on_pause if traced else None,
                                  on_idle=on_idle if traced else None))
        report.at_ready = at_ready
    print(table(["minute", "answers", "answers by status", "API server RSS MB", "anon",
                 "file", "engines RSS MB", "payload files"], [_row(s) for s in report.samples],
                left=3,
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
    if report.files_left:
        print("payload files left (first 20):", *report.files_left, sep="\n  ")
    if args.trace is not None:
        after = sum(sum(s.answers.values()) for s in report.samples[args.trace_from:])
        print(f"trace ({args.trace}): the load paused {report.paused_s:.0f} s after "
              f"sample {args.trace_from} for the baseline; {after} answers between it and "
              f"the idle sample (sample-idle.txt)")
    print()
    print(verdict(report, args.tail_minutes, band=args.flat_band))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "clients": args.clients, "minutes": args.minutes, "at_ready": report.at_ready,
            "files_at_end": report.files_at_end,
            "samples": [{"seconds": s.seconds, "api_rss_mb": s.api_rss_mb,
                         "api_anon_mb": s.api_anon_mb, "api_file_mb": s.api_file_mb,
                         "engines_rss_mb": s.engines_rss_mb,
                         "payload_files": s.payload_files,
                         "answers": {f"{k} {o}": n for (k, o), n in s.answers.items()}}
                        for s in report.samples]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
