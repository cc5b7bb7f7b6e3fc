"""Helpers for Realtime API clients (tests and benchmarks): the official ``openai`` SDK's
realtime connection, every server event checked against the SDK's own types, and the
speech fixture as the session's input audio."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time

import numpy as np

#: The Realtime API's audio/pcm rate (Hz).
RATE = 24000
SPEECH = os.path.join(os.path.dirname(__file__), "fixtures", "speech", "hello.flac")


def session(max_output_tokens: int = 8, turn_detection: dict | None = None,
            modalities=("audio",), **extra) -> dict:
    """A ``session.update`` body: ``audio/pcm`` in and out, voice ``ethan``."""
    return {"type": "realtime", "output_modalities": list(modalities),
            "max_output_tokens": max_output_tokens,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE},
                                "turn_detection": turn_detection},
                      "output": {"format": {"type": "audio/pcm", "rate": RATE},
                                 "voice": "ethan"}}, **extra}


def speech_pcm(before_s: float = 0.5, after_s: float = 1.0) -> bytes:
    """The speech fixture (2.76 s, "Hello there. What is the weather like today?") as
    24 kHz pcm16, after ``before_s`` and before ``after_s`` seconds of silence."""
    import soundfile as sf
    import soxr

    samples, rate = sf.read(SPEECH, dtype="float32")
    speech = (np.clip(soxr.resample(samples, rate, RATE), -1, 1) * 32767).astype("<i2")
    return np.concatenate([np.zeros(int(before_s * RATE), "<i2"), speech,
                           np.zeros(int(after_s * RATE), "<i2")]).tobytes()


def chunks(pcm: bytes, ms: int = 100) -> list[str]:
    """``pcm`` in base64 pieces of ``ms`` milliseconds (for ``input_audio_buffer.append``)."""
    size = RATE * 2 * ms // 1000
    return [base64.b64encode(pcm[i:i + size]).decode() for i in range(0, len(pcm), size)]


def text_item(text: str, role: str = "user") -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


class Events:
    """The server events of one connection, read with a bound; with ``validate``, each
    is checked against the SDK's ``RealtimeServerEvent`` union (strict validation, not
    the SDK's lenient parse); each is kept, with the time it came
    (``time.perf_counter``)."""

    def __init__(self, connection, validate: bool = True) -> None:
        from openai.types.realtime import RealtimeServerEvent
        from pydantic import TypeAdapter

        self.connection = connection
        self.seen: list[dict] = []
        self.times: list[float] = []
        self._adapter = TypeAdapter(RealtimeServerEvent) if validate else None

    async def next(self, timeout: float = 120) -> dict:
        raw = await asyncio.wait_for(self.connection.recv_bytes(), timeout)
        event = json.loads(raw)
        if self._adapter is not None:
            self._adapter.validate_python(event)
        self.seen.append(event)
        self.times.append(time.perf_counter())
        return event

    async def until(self, kind: str, timeout: float = 120, **match) -> list[dict]:
        """Events up to and including the first of type ``kind`` whose fields equal
        ``match``; raises ``TimeoutError`` after ``timeout`` seconds in all."""
        deadline = time.monotonic() + timeout
        got = []
        while True:
            event = await self.next(max(0.1, deadline - time.monotonic()))
            got.append(event)
            if event["type"] == kind and all(event.get(k) == v for k, v in match.items()):
                return got


def kinds(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def audio_of(events: list[dict]) -> bytes:
    """The pcm16 of every ``response.output_audio.delta`` in ``events``, joined."""
    return b"".join(base64.b64decode(e["delta"]) for e in events
                    if e["type"] == "response.output_audio.delta")
