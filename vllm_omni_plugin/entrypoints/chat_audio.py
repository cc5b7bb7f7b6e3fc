"""Chat completions with audio output: OpenAI's chat-audio fields on ``/v1/chat/completions``.

The request's ``modalities`` (``["text"]`` or ``["text", "audio"]``) and optional
``audio`` object (``{"voice": str, "format": str}``, a format of
:data:`~vllm_omni_plugin.entrypoints.audio_encoding.AUDIO_FORMATS`; streamed: ``pcm16``
only, as OpenAI) are validated and removed before vLLM sees the body; vLLM's handler
then runs inside an :class:`~vllm_omni_plugin.engine.omni_request.OmniRequest` scope
carrying them, where the orchestrator finds them and leaves its result.

* Not streamed: after vLLM's response, ``choices[0].message.audio`` is set to
  ``{"id", "data" (base64 of the encoded audio, mono), "expires_at", "transcript"}``,
  OpenAI's chat-audio shape, or the response is replaced with the pipeline's error
  (HTTP 400/429/500/503 naming the stage, ``Retry-After`` on 429/503).
* Streamed (``stream: true``): vLLM's text deltas pass through and, before the chunk
  that carries ``finish_reason``, the audio goes out as ``delta.audio`` chunks
  (:class:`AudioStream`); a failure before any chunk answers with its status, a later
  one is an ``{"error": ...}`` event in the stream.

Non-streamed text-only chat and completion requests get the same error replacement
when the entry stage's worker failed them; streamed ones pass through untouched (vLLM
reports the failure in the stream).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from dataclasses import dataclass

from vllm_omni_plugin.engine.omni_request import (
    AUDIO,
    TEXT,
    OmniRequest,
    StageResult,
    omni_request_scope,
)
from vllm_omni_plugin.entrypoints.asgi import (
    answer_or_failure,
    captured,
    error_body,
    replay,
    send_failure,
    sse,
)
from vllm_omni_plugin.entrypoints.audio_encoding import AUDIO_FORMATS, STREAM_FORMAT, encode_audio
from vllm_omni_plugin.entrypoints.chat_stream import AudioDelta, ChatFailure, SpokenAnswer
from vllm_omni_plugin.entrypoints.media_input import RequestError, is_choice, not_a_choice
from vllm_omni_plugin.processors.hookspecs import MAX_VOICE_CHARS

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: ``audio.format`` when the client leaves it out, not streamed (streamed: ``pcm16``).
DEFAULT_FORMAT = "wav"
#: Seconds a returned audio's ``expires_at`` lies ahead (there is nothing to fetch later:
#: the audio is in the answer; OpenAI uses the field for multi-turn references).
AUDIO_EXPIRY_S = 3600


@dataclass(frozen=True)
class AudioRequest:
    """A chat request's validated output fields.

    Attributes:
        modalities: ``("text",)`` or ``("text", "audio")``.
        voice: the talker's speaker name, None for the checkpoint's default.
        format: a key of :data:`AUDIO_FORMATS`.
        stream: whether the client asked for ``stream: true``.
    """

    modalities: tuple[str, ...]
    voice: str | None = None
    format: str = DEFAULT_FORMAT
    stream: bool = False


def parse_audio_request(body: dict) -> AudioRequest | None:
    """Validate and remove ``modalities``/``audio``; None when both are absent.

    Raises:
        RequestError: naming the offending field.
    """
    modalities = body.pop("modalities", None)
    audio = body.pop("audio", None)
    stream = bool(body.get("stream"))
    if modalities is None:
        if audio is not None:
            raise RequestError("audio", "requires \"modalities\": [\"text\", \"audio\"]")
        return None
    if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
        raise RequestError("modalities", "must be a list of strings")
    unknown = sorted(set(modalities) - {TEXT, AUDIO})
    if unknown:
        shown = [u[:40] for u in unknown[:5]]
        raise RequestError("modalities", f"unsupported value(s) {shown}; "
                           "supported: [\"text\"] or [\"text\", \"audio\"]")
    if TEXT not in modalities:
        raise RequestError("modalities", "must include \"text\"")
    voice = None
    fmt = STREAM_FORMAT if stream else DEFAULT_FORMAT
    if audio is not None:
        if not isinstance(audio, dict):
            raise RequestError("audio", "must be an object {\"voice\": ..., \"format\": ...}")
        fmt = audio.get("format", fmt)
        if not is_choice(fmt, AUDIO_FORMATS):
            raise not_a_choice("audio.format", fmt, AUDIO_FORMATS)
        if stream and fmt != STREAM_FORMAT:
            raise RequestError("audio.format", f"streamed audio is {STREAM_FORMAT!r} only "
                               f"(got {fmt!r}); leave out stream for other formats")
        voice = audio.get("voice")
        if voice is not None:
            if not isinstance(voice, str) or not voice.strip():
                raise RequestError("audio.voice", "must be a non-empty string (or left out "
                                   "for the default voice)")
            if len(voice) > MAX_VOICE_CHARS:
                raise RequestError("audio.voice", f"is {len(voice)} characters long; voice "
                                   f"names have at most {MAX_VOICE_CHARS}")
    if AUDIO in modalities and body.get("n") not in (None, 1):
        raise RequestError("n", "audio output supports n=1 only")
    return AudioRequest(tuple(sorted(set(modalities), key=[TEXT, AUDIO].index)), voice, fmt,
                        stream)


def audio_object(result: StageResult, fmt: str, transcript: str) -> dict:
    """OpenAI's chat-audio object for the waveform in ``result.payload["waveform"]``
    (``[num_samples]`` float, ``result.sample_rate`` Hz): ``{"id", "data" (base64 of the
    audio encoded as ``fmt``), "expires_at" (Unix seconds), "transcript"}``."""
    encoded = encode_audio(result.payload["waveform"].numpy(), result.sample_rate, fmt)
    return {"id": f"audio_{uuid.uuid4().hex}",
            "data": base64.b64encode(encoded).decode("ascii"),
            "expires_at": int(time.time()) + AUDIO_EXPIRY_S,
            "transcript": transcript}


def attach_audio(response: dict, result: StageResult, fmt: str) -> dict:
    """Put the request's audio into ``choices[0].message.audio`` of a chat completion."""
    message = response["choices"][0]["message"]
    message["audio"] = audio_object(result, fmt, message.get("content") or "")
    return response


async def serve_chat(app, scope, receive, send, body: dict, asked: AudioRequest | None,
                     raw: bytes | None = None):
    """A chat or text completion (``body``, already checked; ``asked``: its parsed audio
    fields, None for text) through vLLM's handler ``app``; see the module docstring.
    ``raw``: the body's bytes as the client sent them, when ``body`` is unchanged (they
    are forwarded instead of ``body`` encoded again). A text answer passes through as
    vLLM sends it (:func:`~.asgi.answer_or_failure`)."""
    forwarded = raw if raw is not None else json.dumps(body).encode()
    asked = asked or AudioRequest((TEXT,))
    request = OmniRequest(modalities=asked.modalities, voice=asked.voice)
    if request.text_only:
        return await answer_or_failure(app, scope, replay(forwarded, receive), send, request)
    if body.get("stream"):
        request.partials = asyncio.Queue()
        stream = AudioStream(send, request, asked.format)
        with omni_request_scope(request):
            pump = asyncio.create_task(stream.pump())
            try:
                return await app(scope, replay(forwarded, receive), stream)
            finally:
                pump.cancel()
    answer = await captured(app, scope, receive, forwarded, request)
    result = request.result
    if result is not None and result.error:
        return await send_failure(send, result)
    payload = answer.body
    if answer.status == 200 and result is not None:
        response = json.loads(payload)
        payload = json.dumps(attach_audio(response, result, asked.format)).encode()
    await answer.replay(send, payload)


class AudioStream:
    """The ASGI ``send`` of a streamed chat completion with audio.

    vLLM's SSE events pass through. The audio goes out as chunks whose
    ``choices[0].delta.audio`` is ``{"id" (one per answer), "data" (base64 little-endian
    16-bit PCM, mono, at the pipeline's sample rate), "transcript" (the text streamed since
    the previous audio chunk)}``: each chunk of a streamed final stage as soon as the
    orchestrator has it (:meth:`pump`), and the rest of the waveform, with ``expires_at``,
    before the chunk carrying ``finish_reason`` (the orchestrator holds vLLM's last output
    back until the last stage ran; that chunk's text, if any, goes out first on its own).
    A pipeline failure recorded before vLLM's first event answers with its own status;
    a later one goes out as an ``{"error": ...}`` event, which the OpenAI SDK raises.
    Anything but a ``200 text/event-stream`` response (vLLM's own errors) passes
    through untouched.
    """

    def __init__(self, send, request: OmniRequest, fmt: str) -> None:
        self._send = send
        self._request = request
        self._format = fmt
        self._start: dict | None = None
        self._sse: bool | None = None  # decided by the response start
        self._started = asyncio.Event()  # the response start went out
        self._lock = asyncio.Lock()  # one event at a time from vLLM's sends and pump()
        self._buffer = b""
        self._transcript: list[str] = []
        self._transcript_sent = 0  # pieces of _transcript sent with audio
        self._spoken = SpokenAnswer(request)
        self._audio_id = f"audio_{uuid.uuid4().hex}"
        self._chunk: dict = {}  # id, created, model of vLLM's chunks
        self._closed = False

    async def __call__(self, message) -> None:
        """Take one ASGI ``message`` of vLLM's handler. A non-SSE response passes through.
        For SSE the response start is held until the first body, which instead answers
        with the pipeline's error if one was recorded by then; each body is split into
        its SSE events, rewritten (:meth:`_rewrite`: the audio, or the error, joins the
        chunk carrying ``finish_reason``) and sent. Nothing is sent once closed."""
        if self._closed:
            return
        if message["type"] == "http.response.start":
            kind = dict((k.lower(), v) for k, v in message.get("headers", ()))
            self._sse = message["status"] == 200 and kind.get(
                b"content-type", b"").startswith(b"text/event-stream")
            self._start = message
            if not self._sse:
                await self._send(message)
            return
        if message["type"] != "http.response.body" or not self._sse:
            return await self._send(message)
        async with self._lock:
            if self._start is not None:
                result = self._request.result
                if result is not None and result.error:  # failed before anything streamed
                    self._closed = True
                    return await send_failure(self._send, result)
                await self._send(self._start)
                self._start = None
                self._started.set()
            self._buffer += message.get("body", b"")
            out = []
            while b"\n\n" in self._buffer:
                event, self._buffer = self._buffer.split(b"\n\n", 1)
                out.extend(self._rewrite(event + b"\n\n"))
            more = message.get("more_body", False)
            if not more:
                out.append(self._buffer)
            await self._send({"type": "http.response.body", "body": b"".join(out),
                              "more_body": more})

    async def pump(self) -> None:
        """Send each chunk the orchestrator puts into the request's ``partials`` as an
        audio chunk, between vLLM's events, once the response has started. Ends when the
        answer is done; stops at a send that fails (the client went away: vLLM's
        handler sees the disconnect itself)."""
        partials = self._request.partials
        while True:
            payload = await partials.get()
            await self._started.wait()
            async with self._lock:
                delta = self._spoken.chunk(payload)
                if delta is None or self._closed:
                    return
                event = self._audio_event(delta)
                try:
                    await self._send({"type": "http.response.body", "body": event,
                                      "more_body": True})
                except Exception:
                    return
            partials.task_done()

    def _rewrite(self, event: bytes) -> list[bytes]:
        """vLLM's ``event`` and what goes with it: the audio (or the error) before the
        ``[DONE]`` or the chunk carrying ``finish_reason``; that chunk's text, if any, is
        sent first on its own, so that the audio follows all the text."""
        data = event.removeprefix(b"data: ").strip()
        if data == b"[DONE]":
            return [*self._audio_or_error(), event]
        try:
            chunk = json.loads(data)
        except ValueError:
            return [event]
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not choices:
            return [event]
        self._chunk = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        delta = choices[0].get("delta") or {}
        if delta.get("content"):
            self._transcript.append(delta["content"])
        if not choices[0].get("finish_reason") or self._spoken.done:
            return [event]
        events = []
        if delta.get("content"):
            text = {**chunk, "choices": [{**choices[0], "finish_reason": None}]}
            events.append(sse(text))
            choices[0]["delta"] = {k: v for k, v in delta.items() if k != "content"}
            event = sse(chunk)
        return [*events, *self._audio_or_error(), event]

    def _audio_or_error(self) -> list[bytes]:
        """The last audio chunk (the waveform's samples not sent yet, ``expires_at``), or
        the error event."""
        rest = self._spoken.rest()
        if rest is None:
            return []
        if isinstance(rest, ChatFailure):
            return [b"data: " + error_body(rest.message, rest.status) + b"\n\n"]
        return [self._audio_event(rest, expires_at=int(time.time()) + AUDIO_EXPIRY_S)]

    def _audio_event(self, delta: AudioDelta, expires_at: int | None = None) -> bytes:
        """One ``delta.audio`` chunk of ``delta``'s samples as ``pcm16``."""
        transcript = "".join(self._transcript[self._transcript_sent:])
        self._transcript_sent = len(self._transcript)
        audio = {"id": self._audio_id,
                 "data": base64.b64encode(encode_audio(delta.samples, delta.rate,
                                                       self._format)).decode("ascii"),
                 "transcript": transcript}
        if expires_at is not None:
            audio["expires_at"] = expires_at
        return sse({**self._chunk, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"audio": audio}, "logprobs": None, "finish_reason": None}]})
