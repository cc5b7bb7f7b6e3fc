"""Helpers shared by the benchmark scripts (not part of the package).

Everything here uses the standard library and what vLLM installs (aiohttp for the
chat load), so the scripts run with the project's venv interpreter without extra
installs.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import wave
from pathlib import Path

from vllm_omni_plugin.config.pipelines import builtin_pipeline

REPO = Path(__file__).resolve().parent.parent


def venv_bin(name: str) -> str:
    """``name`` next to the running interpreter (the venv's bin/), else on PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def make_checkpoint(path: Path) -> float:
    """Write the tiny Qwen3-Omni checkpoint (seed 0) to ``path``; returns seconds taken."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "vllm_omni_plugin.tools.tiny_checkpoint", "qwen3-omni", str(path),
         "--seed", "0"],
        check=True, cwd=str(REPO), stdout=subprocess.DEVNULL, timeout=600,
    )
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, spec: str = ".1f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(headers: list[str], rows: list[list[str]], title: str | None = None,
          left: int = 1) -> str:
    """A plain-text table; the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells):
        return "  ".join(
            c.ljust(widths[i]) if i < left else c.rjust(widths[i]) for i, c in enumerate(cells)
        )

    out = []
    if title:
        out.append(title)
    out.append(line(headers))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def install_sigterm_as_interrupt() -> None:
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt so ``finally`` blocks run."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread / not supported
            pass


class Server:
    """A ``vllm serve`` process in its own session (process group).

    stdout+stderr go through a pipe to a reader thread that writes the log file
    and stamps every line with ``time.perf_counter()`` at arrival, so log
    events can be placed on the launch timeline with sub-second resolution
    (vLLM's own log timestamps have 1 s resolution).

    :meth:`stop` kills the whole process group (API server, every EngineCore)
    with SIGTERM, then SIGKILL after a grace period. Use as a context manager.
    """

    def __init__(self, argv: list[str], env: dict, log_path: Path):
        self.argv = argv
        self.env = env
        self.log_path = Path(log_path)
        self.lines: list[tuple[float, str]] = []  # (seconds since launch, line)
        self.proc: subprocess.Popen | None = None
        self.t0: float | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(REPO),
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "w", encoding="utf-8", errors="replace") as log:
            for raw in self.proc.stdout:
                now = time.perf_counter() - self.t0
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                log.write(f"[+{now:8.3f}s] {line}\n")
                log.flush()
                with self._lock:
                    self.lines.append((now, line))

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def snapshot(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self.lines)

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.snapshot()[-n:])

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the pgid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(pgid):
                    break
                time.sleep(0.2)
            else:
                continue
            break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self._reader is not None:
            self._reader.join(timeout=5)


def _group_alive(pgid: int) -> bool:
    """True while a non-zombie process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields[0] = state, fields[2] = pgrp (see proc(5))
        if fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def engine_core_pid(pid: int) -> int:
    """The EngineCore of a process that logged for a stage: the process itself, or its
    parent when it is a worker (vLLM's CPU platform runs each engine's worker in a process
    of its own, titled ``VLLM::Worker``). Read while the server runs.

    Raises:
        psutil.Error: the process is gone or cannot be read.
    """
    import psutil

    proc = psutil.Process(pid)
    title = proc.cmdline()[:1]
    return proc.ppid() if title and title[0].startswith("VLLM::Worker") else pid


def stage_engine_core_pid(log: str, stage_id: int) -> int:
    """The EngineCore of stage ``stage_id``'s latest engine, from a server's log (its
    worker's "stage N: OmniWorker (vLLM's ...)" line; :func:`engine_core_pid`).

    Raises:
        LookupError: no such line in ``log``.
    """
    import re

    pids = re.findall(rf"\(\S+ pid=(\d+)\).*stage {stage_id}: \w+ \(vLLM's", log)
    if not pids:
        raise LookupError(f"no worker of stage {stage_id} in the log")
    return engine_core_pid(int(pids[-1]))


def timed_audio_chat(url: str, model: str, text: str,
                     timeout: float = 900) -> tuple[int, float]:
    """One text + audio chat (4 thinker tokens, greedy): (HTTP status, seconds)."""
    start = time.perf_counter()
    status, _ = post_json(f"{url}/v1/chat/completions", {
        "model": model, "max_tokens": 4, "temperature": 0, "modalities": ["text", "audio"],
        "messages": [{"role": "user", "content": text}]}, timeout=timeout)
    return status, time.perf_counter() - start


def http_get_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def wait_health(server: Server, url: str, timeout: float, poll: float = 0.1) -> float:
    """Seconds since launch at which ``GET url`` first answered 200."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if not server.alive():
            raise RuntimeError(
                f"server exited with code {server.proc.returncode} before /health; "
                f"log tail:\n{server.tail()}"
            )
        if http_get_status(url) == 200:
            return server.elapsed()
        time.sleep(poll)
    raise TimeoutError(f"/health not 200 after {timeout:.0f} s; log tail:\n{server.tail()}")


def post_json(url: str, body: dict, timeout: float) -> tuple[int, dict | str]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def wav_seconds(b64: str) -> float:
    """Duration in seconds of a base64 WAV (the chat API's ``message.audio.data``)."""
    with wave.open(io.BytesIO(base64.b64decode(b64))) as w:
        return w.getnframes() / w.getframerate()


def write_short_talker_yaml(src: Path, dst: Path, max_tokens: int,
                            streaming: dict | None = None,
                            stream_input: bool | None = None,
                            devices: list[str] | None = None) -> Path:
    """Copy the pipeline YAML ``src`` to ``dst`` with the talker's (stage 1)
    ``max_tokens`` (codec frames) set to ``max_tokens`` (and its ``stream_input`` to
    ``stream_input`` unless None), code2wav's (stage 2) ``streaming`` fields updated
    from ``streaming``, and stage ``i``'s ``runtime.devices`` set to ``devices[i]``
    (``-``: left as is)."""
    import yaml

    data = yaml.safe_load(src.read_text())
    stages = {int(s["stage_id"]): s for s in data["stages"]}
    if 1 not in stages:
        raise SystemExit(f"{src}: no stage 1 to apply --talker-max-tokens to")
    stages[1].setdefault("default_sampling_params", {})["max_tokens"] = max_tokens
    if stream_input is not None:
        stages[1]["stream_input"] = stream_input
    if streaming:
        stages[2].setdefault("streaming", {}).update(streaming)
    for stage_id, value in enumerate(devices or []):
        if value != "-":
            stages[stage_id].setdefault("runtime", {})["devices"] = value
    dst.write_text(
        f"# benchmark copy of {src} with stage 1 max_tokens={max_tokens}, stream_input "
        f"{'as is' if stream_input is None else stream_input}, stage 2 streaming "
        f"{streaming or 'as is'}\n" + yaml.safe_dump(data, sort_keys=False)
    )
    return dst


async def _chat_load(url: str, make_body, requests: int, concurrency: int, check) -> float:
    import aiohttp  # a vLLM requirement; an asyncio client keeps the client's CPU cost low

    todo = iter(range(requests))

    async def worker(session):
        for i in todo:
            start = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=make_body(i)) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"chat {i}: HTTP {r.status}: {str(answer)[:500]}")
            check(i, answer, time.perf_counter() - start)

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency,
                                                                    force_close=True)) as s:
        start = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        return requests / (time.perf_counter() - start)


def chat_load(url: str, make_body, requests: int, concurrency: int, check) -> float:
    """Requests/s for ``requests`` chat completions with ``concurrency`` in flight.

    ``make_body(i)`` gives request ``i``'s JSON body; ``check(i, answer, latency_s)`` sees
    each answer (raise to stop the run). A non-200 answer raises ``RuntimeError``.
    """
    return asyncio.run(_chat_load(url, make_body, requests, concurrency, check))


async def audio_deltas(response):
    """The decoded ``data`` of each ``delta.audio`` with audio in a streamed chat answer
    (an aiohttp response with status 200), as it arrives.

    Raises:
        RuntimeError: an ``error`` event in the stream.
    """
    async for line in response.content:
        if not line.startswith(b"data: ") or b'"audio"' not in line:
            continue
        event = json.loads(line[len(b"data: "):])
        if "error" in event:
            raise RuntimeError(f"stream error: {event['error']}")
        audio = event["choices"][0]["delta"].get("audio")
        if audio and audio.get("data"):
            yield base64.b64decode(audio["data"])


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def add_audio_chat_args(parser) -> None:
    """The options of the audio chat benchmarks (checkpoint, trials, load, talker cap)."""
    parser.add_argument("--checkpoint", type=Path, help="tiny checkpoint dir (made if missing)")
    parser.add_argument("--trials", type=int, default=3, help="measurements per cell")
    parser.add_argument("--requests", type=int, default=16, help="chats per measurement")
    parser.add_argument("--max-tokens", type=int, default=16, help="thinker tokens per chat")
    parser.add_argument("--talker-frames", type=int, default=64,
                        help="talker max_tokens (codec frames, 12.5 per second of speech)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--stage-devices", nargs="+", metavar="DEVICES",
                        help="runtime.devices per stage, in stage order ('-': as in the "
                             "YAML); on vLLM's CPU build, the cores of each stage's "
                             "workers, e.g. '- 1 1'")


def audio_pipeline_serve(args, tmp: Path) -> tuple[Path, list[str], dict, str]:
    """``vllm serve`` of the three-stage Qwen3-Omni pipeline on the tiny checkpoint
    (``args.checkpoint``, made under ``tmp`` when missing), the talker capped at
    ``args.talker_frames``, ``--max-model-len`` ``args.max_model_len`` (2048 when not
    set): (checkpoint, argv, env, base URL)."""
    ckpt = args.checkpoint or tmp / "ckpt"
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt)
    streaming = {field: getattr(args, option, None) for field, option in (
        ("chunk_size", "stream_chunk"), ("left_context", "stream_left_context"),
        ("first_chunk_size", "stream_first_chunk"))}
    streaming = {k: v for k, v in streaming.items() if v is not None}
    after = getattr(args, "talker_after_thinker", False)
    yaml_path = write_short_talker_yaml(Path(builtin_pipeline("qwen3_omni_moe")),
                                        tmp / "pipeline.yaml", args.talker_frames, streaming,
                                        stream_input=False if after else None,
                                        devices=getattr(args, "stage_devices", None))
    port = free_port()
    argv = [venv_bin("vllm"), "serve", str(ckpt), "--max-model-len",
            str(getattr(args, "max_model_len", 2048)), "--dtype",
            "float32", "--gpu-memory-utilization", "0.3", "--host", "127.0.0.1",
            "--port", str(port), "--stage-configs-path", str(yaml_path)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return ckpt, argv, env, f"http://127.0.0.1:{port}"


def audio_chat_load(url: str, model: str, requests: int, concurrency: int,
                    max_tokens: int) -> tuple[float, list[float], list[float]]:
    """``requests`` text + audio chats (greedy, ``max_tokens`` thinker tokens, prompts
    differing per request), ``concurrency`` at a time: (requests/s, per-request latencies
    in s, per-request seconds of speech)."""
    latencies: list[float] = []
    speech: list[float] = []

    def body(i):
        return {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "modalities": ["text", "audio"],
                "messages": [{"role": "user", "content": f"request {i}: say something"}]}

    def check(i, answer, latency):
        latencies.append(latency)
        speech.append(wav_seconds(answer["choices"][0]["message"]["audio"]["data"]))

    rate = chat_load(url, body, requests, concurrency, check)
    return rate, latencies, speech


def prefix_cache_counters(url: str) -> tuple[float, float]:
    """vLLM's prefix-cache counters on ``/metrics`` (the entry stage's engine): tokens
    looked up, tokens found."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]


def system_prompt(ckpt: Path, tokens: int) -> str:
    """A system message of at least ``tokens`` tokens of ``ckpt``'s tokenizer (a sentence
    repeated); empty for 0."""
    from transformers import AutoTokenizer

    if tokens <= 0:
        return ""
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    sentence = "You are a helpful assistant who answers questions about the weather. "
    text = sentence
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += sentence
    return text
