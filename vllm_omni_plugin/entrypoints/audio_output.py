"""OpenAI chat-audio output for ``/v1/chat/completions`` in omni mode, and the
API's boundary in front of the pipeline.

An ASGI middleware, installed through vLLM's own ``--middleware`` mechanism
(the plugin appends it in omni mode). For every JSON ``POST`` it

* refuses a ``vllm_xargs`` that is not an object, or that carries a key in the
  plugin's namespace (``omni_plugin_*``), with HTTP 400 naming the field: the
  pipeline's control data is not the client's to write.

For a chat completion request it

* checks its media content parts (:mod:`.media_input`: part types, data-URL media
  types, inline images and audio that do not decode, item counts, audio length),
  answering HTTP 400 naming the field;
* validates ``modalities`` (``["text"]`` or ``["text", "audio"]``; ``["image"]`` is
  an image request, see below) and the
  optional ``audio`` object (``{"voice": str, "format": str}``, a format of
  :data:`~vllm_omni_plugin.entrypoints.audio_encoding.AUDIO_FORMATS`; streamed:
  ``pcm16`` only, as OpenAI); anything else is answered with HTTP 400 naming the
  field, before vLLM sees it;
* runs vLLM's handler inside an :class:`~vllm_omni_plugin.engine.omni_request.OmniRequest`
  scope carrying them, where the orchestrator finds them and leaves its result;
* not streamed: after vLLM's response, sets ``choices[0].message.audio`` to
  ``{"id", "data" (base64 of the encoded audio, mono), "expires_at", "transcript"}``,
  OpenAI's chat-audio shape, or replaces the response with the pipeline's
  error (HTTP 400/429/500/503 naming the stage, ``Retry-After`` on 429/503);
* streamed (``stream: true``): passes vLLM's text deltas through and, before the
  chunk that carries ``finish_reason``, sends the audio as ``delta.audio`` chunks
  (:class:`_AudioStream`); a failure before any chunk answers with its status, a
  later one is an ``{"error": ...}`` event in the stream.

Non-streamed text-only chat and completion requests get the same error
replacement when the entry stage's worker failed them; streamed ones pass
through untouched (vLLM reports the failure in the stream).

It also serves OpenAI's ``POST /v1/images/generations`` (:mod:`.images`: a completion
whose downstream stages draw the image, for a model whose plugin plans images), and
chat completions with ``"modalities": ["image"]`` the same way, answered with an image
content part,
``POST /v1/audio/speech`` (:mod:`.speech`: a chat completion
with the text as an open assistant turn, answered as audio) and ``GET
/v1/audio/voices`` (the checkpoint's voices, from the ``omni_list_voices`` hook); a
voice not among them is a 400 naming ``audio.voice`` or ``voice``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
import uuid
from dataclasses import dataclass

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.engine.omni_request import (
    AUDIO,
    IMAGE,
    TEXT,
    OmniRequest,
    StageResult,
    omni_request_scope,
)
from vllm_omni_plugin.entrypoints.audio_encoding import (
    AUDIO_FORMATS,
    STREAM_FORMAT,
    encode_audio,
)
from vllm_omni_plugin.entrypoints.images import (
    IMAGES_PATH,
    chat_image_body,
    chat_image_response,
    completion_body,
    encode_image,
    images_response,
    parse_image_request,
)
from vllm_omni_plugin.entrypoints.media_input import MediaLimits, RequestError, check_media
from vllm_omni_plugin.entrypoints.speech import (
    SPEECH_PATH,
    SpeechRequest,
    parse_speech_request,
    speech_chat_body,
    sse_delta,
    sse_done,
    sse_error,
)
from vllm_omni_plugin.processors import Voices, list_voices, plan_image

MIDDLEWARE_QUALNAME = "vllm_omni_plugin.entrypoints.audio_output.OmniAudioMiddleware"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
VOICES_PATH = "/v1/audio/voices"
MAX_BODY_BYTES = 64 * 1024 * 1024
#: ``audio.format`` when the client leaves it out, not streamed (streamed: ``pcm16``).
DEFAULT_FORMAT = "wav"
#: Seconds a returned audio's ``expires_at`` lies ahead (there is nothing to fetch later:
#: the audio is in the answer; OpenAI uses the field for multi-turn references).
AUDIO_EXPIRY_S = 3600
#: Longest voice name accepted (speaker names in Qwen3-Omni's config are short words).
MAX_VOICE_CHARS = 64
_UNSET = object()
_ERROR_TYPES = {400: "BadRequestError", 413: "RequestTooLargeError", 429: "RateLimitError",
                503: "ServiceUnavailableError"}


def check_vllm_xargs(body: dict) -> None:
    """Refuse a ``vllm_xargs`` that is not an object or writes the plugin's namespace.

    Raises:
        RequestError: naming ``vllm_xargs`` or ``vllm_xargs.<key>``.
    """
    extra = body.get("vllm_xargs")
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise RequestError("vllm_xargs", "must be an object of extra sampling arguments")
    reserved = xargs.reserved_keys(extra)
    if reserved:
        key = reserved[0][:80]
        raise RequestError(f"vllm_xargs.{key}", f"keys starting with "
                           f"{xargs.RESERVED_PREFIX!r} are reserved for the omni pipeline")


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
        if fmt not in AUDIO_FORMATS:
            shown = fmt[:40] if isinstance(fmt, str) else type(fmt).__name__
            raise RequestError("audio.format", f"{shown!r} is not supported; use one of "
                               f"{', '.join(AUDIO_FORMATS)}")
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


def _error_body(message: str, code: int, param: str | None = None) -> bytes:
    kind = _ERROR_TYPES.get(code, "InternalServerError")
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()


async def _send_json(send, status: int, body: bytes,
                     retry_after: float | None = None) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(retry_after))).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_failure(send, result: StageResult) -> None:
    await _send_json(send, result.status, _error_body(result.error or "", result.status),
                     result.retry_after)


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


def _is_json(scope) -> bool:
    """Whether FastAPI would parse the body as JSON: no (or an empty) content
    type, ``application/json`` or ``application/*+json``."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-type":
            kind = value.split(b";")[0].strip().lower()
            return not kind or kind == b"application/json" or (
                kind.startswith(b"application/") and kind.endswith(b"+json"))
    return True


class OmniAudioMiddleware:
    """Pure ASGI middleware; see the module docstring."""

    def __init__(self, app):
        self.app = app
        self._limits: MediaLimits | None = None
        self._voices: Voices | None | object = _UNSET

    def media_limits(self, scope) -> MediaLimits:
        """The served model's media limits, read once from vLLM's app state."""
        if self._limits is None:
            config = _vllm_config(scope)
            self._limits = MediaLimits() if config is None else \
                MediaLimits.from_vllm_config(config)
        return self._limits

    def voices(self, scope) -> Voices | None:
        """The served checkpoint's voices (the ``omni_list_voices`` hook), read once."""
        if self._voices is _UNSET:
            hf_config = _hf_config(scope)
            self._voices = None if hf_config is None else list_voices(hf_config)
        return self._voices

    def check_voice(self, scope, voice: str | None, field: str) -> None:
        """Refuse a voice the checkpoint does not have.

        Raises:
            RequestError: naming ``field`` and listing the voices.
        """
        known = self.voices(scope)
        if voice is None or known is None:
            return
        if voice.lower() not in {name.lower() for name in known.names}:
            raise RequestError(field, f"unknown voice {voice[:MAX_VOICE_CHARS]!r}; known: "
                               f"{', '.join(known.names)} (GET {VOICES_PATH})")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == VOICES_PATH:
            known = self.voices(scope)
            return await _send_json(send, 200, json.dumps({
                "object": "list", "default": known.default if known else None,
                "data": [{"id": name, "object": "voice"} for name in
                         (known.names if known else [])]}).encode())
        if scope["type"] != "http" or scope["method"] != "POST" or not _is_json(scope):
            return await self.app(scope, receive, send)
        raw = b""
        more = True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
            if len(raw) > MAX_BODY_BYTES:
                return await _send_json(send, 413, _error_body("request body too large", 413))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # vLLM answers malformed JSON itself
        path = scope["path"]
        asked = speech = image = None
        chat_image = False
        if isinstance(body, dict):
            try:
                check_vllm_xargs(body)
                if path == CHAT_PATH and _asks_image(body):
                    image = self.plan_image(scope, chat_image_body(body), "modalities")
                    chat_image = True
                elif path == CHAT_PATH:
                    asked = parse_audio_request(body)
                    self.check_voice(scope, asked and asked.voice, "audio.voice")
                    # decoding inline media takes a while: off the event loop
                    await asyncio.to_thread(check_media, body, self.media_limits(scope))
                elif path == SPEECH_PATH:
                    speech = parse_speech_request(body, MAX_VOICE_CHARS)
                    self.check_voice(scope, speech.voice, "voice")
                elif path == IMAGES_PATH:
                    image = self.plan_image(scope, body)
            except RequestError as exc:
                return await _send_json(send, 400, _error_body(f"invalid request: {exc}", 400,
                                                               exc.field))
        if speech is not None:
            return await self._speech(scope, receive, send, speech)
        if image is not None:
            return await self._image(scope, receive, send, *image, chat=chat_image)
        forwarded = json.dumps(body).encode() if isinstance(body, dict) else raw
        if path not in (CHAT_PATH, COMPLETIONS_PATH) or not isinstance(body, dict):
            return await self.app(scope, _replay(forwarded, receive), send)
        asked = asked or AudioRequest((TEXT,))
        request = OmniRequest(modalities=asked.modalities, voice=asked.voice)
        if body.get("stream"):
            if request.text_only:
                with omni_request_scope(request):
                    return await self.app(scope, _replay(forwarded, receive), send)
            request.partials = asyncio.Queue()
            stream = _AudioStream(send, request, asked.format)
            with omni_request_scope(request):
                pump = asyncio.create_task(stream.pump())
                try:
                    return await self.app(scope, _replay(forwarded, receive), stream)
                finally:
                    pump.cancel()
        captured = await self._captured(scope, receive, forwarded, request)
        result = request.result
        if result is not None and result.error:
            return await _send_failure(send, result)
        payload = captured.body
        if captured.status == 200 and result is not None:
            response = json.loads(payload)
            payload = json.dumps(attach_audio(response, result, asked.format)).encode()
        await captured.replay(send, payload)

    def plan_image(self, scope, body: dict, field: str = "model"):
        """Validate an image request and plan it with the served model's plugin.

        Returns:
            ``(ImageRequest, ImagePlan, output_format, output_compression)``.

        Raises:
            RequestError: naming the field; ``field`` when the served model draws no
                images.
        """
        request, fmt, compression = parse_image_request(body)
        hf_config = _hf_config(scope)
        plan = None if hf_config is None else plan_image(hf_config, request)
        if plan is None:
            raise RequestError(field, "the served model does not generate images")
        return request, plan, fmt, compression

    async def _image(self, scope, receive, send, request, plan, fmt: str,
                     compression: int | None, chat: bool = False) -> None:
        """``POST /v1/images/generations``, or a chat completion asking for an image
        (``chat``): the completion of :func:`completion_body`, whose downstream stages
        draw the image, answered as OpenAI's ``ImagesResponse`` or as a
        ``chat.completion`` with an image content part (see :mod:`.images`)."""
        omni = OmniRequest(modalities=(IMAGE,), options={"image": plan.options},
                           companions=dict(plan.companions))
        completions = {**scope, "path": COMPLETIONS_PATH, "raw_path": COMPLETIONS_PATH.encode()}
        captured = await self._captured(
            completions, receive, json.dumps(completion_body(request, plan.prompt)).encode(),
            omni)
        result = omni.result
        if result is not None and result.error:
            return await _send_failure(send, result)
        if captured.status != 200:
            return await captured.replay(send, captured.body)  # vLLM's own error
        if result is None or "image" not in result.payload:
            return await _send_json(send, 500, _error_body(
                "the pipeline's final stage produced no image", 500))
        encoded = await asyncio.to_thread(encode_image, result.payload["image"], fmt,
                                          compression)
        answer = chat_image_response(encoded, fmt, request.model,
                                     json.loads(captured.body).get("usage")) if chat \
            else images_response(encoded, fmt, plan.width, plan.height)
        await _send_json(send, 200, json.dumps(answer).encode())

    async def _captured(self, scope, receive, body: bytes, request: OmniRequest) -> _Capture:
        """vLLM's whole answer to ``body`` at ``scope``, run in ``request``'s scope."""
        captured = _Capture()
        with omni_request_scope(request):
            try:
                await self.app(scope, _replay(body, receive), captured.send)
            except Exception:
                # a failure the orchestrator recorded (and logged) answers with its own
                # status (vLLM's handler for exceptions would make every one a 500)
                if request.result is None or not request.result.error:
                    raise
        return captured

    async def _speech(self, scope, receive, send, speech: SpeechRequest) -> None:
        """``POST /v1/audio/speech``: the chat completion of :func:`speech_chat_body`,
        answered as audio bytes or as OpenAI's speech events; ``pcm`` chunk by chunk as
        the pipeline produces them (see :mod:`.speech`)."""
        streamed = speech.format == STREAM_FORMAT
        request = OmniRequest(modalities=(TEXT, AUDIO), voice=speech.voice,
                              partials=asyncio.Queue() if streamed else None)
        chat_scope = {**scope, "path": CHAT_PATH, "raw_path": CHAT_PATH.encode()}
        chat = asyncio.ensure_future(self._captured(
            chat_scope, receive, json.dumps(speech_chat_body(speech)).encode(), request))
        try:
            sent = await self._speech_chunks(send, speech, request, chat) if streamed else None
            captured = await chat
        finally:
            if not chat.done():  # the client went away mid-stream
                chat.cancel()
        result = request.result
        if sent is not None:  # the response started: finish it
            if result is None or result.error:
                if speech.stream_format == "sse":
                    status = result.status if result is not None else 500
                    error = result.error if result is not None else "no speech was produced"
                    await send({"type": "http.response.body", "more_body": False,
                                "body": sse_error(_error_body(error, status))})
                else:  # raw audio cannot carry an error: the client sees it cut short
                    await send({"type": "http.response.body", "body": b"",
                                "more_body": False})
                return
            rest = encode_audio(result.payload["waveform"][sent:].numpy(),
                                result.sample_rate, speech.format)
            body = rest if speech.stream_format == "audio" else (
                sse_delta(rest) + sse_done(json.loads(captured.body).get("usage")))
            return await send({"type": "http.response.body", "body": body,
                               "more_body": False})
        if result is not None and result.error:
            return await _send_failure(send, result)
        if captured.status != 200 or result is None:
            return await captured.replay(send, captured.body)  # vLLM's own error
        encoded = encode_audio(result.payload["waveform"].numpy(), result.sample_rate,
                               speech.format)
        if speech.stream_format == "sse":
            usage = json.loads(captured.body).get("usage")
            body = sse_delta(encoded) + sse_done(usage)
        else:
            body = encoded
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", _media_type(speech)),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _speech_chunks(self, send, speech: SpeechRequest, request: OmniRequest,
                             chat: asyncio.Future) -> int | None:
        """Send each chunk of speech the orchestrator produces while ``chat`` runs (the
        response starts with the first); the samples sent, or None when none came."""
        partials, sent = request.partials, None
        while True:
            getter = asyncio.ensure_future(partials.get())
            await asyncio.wait({getter, chat}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                return sent  # the rest of the waveform is in the result
            payload = getter.result()
            if sent is None:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", _media_type(speech))]})
                sent = 0
            samples = payload["waveform"]
            encoded = encode_audio(samples.numpy(), _rate_of(payload), speech.format)
            sent += samples.shape[0]
            await send({"type": "http.response.body", "more_body": True,
                        "body": encoded if speech.stream_format == "audio"
                        else sse_delta(encoded)})
            partials.task_done()


def _asks_image(body: dict) -> bool:
    """Whether a chat body's ``modalities`` ask for an image."""
    modalities = body.get("modalities")
    return isinstance(modalities, list) and IMAGE in modalities


def _vllm_config(scope):
    """The served model's ``VllmConfig`` from vLLM's app state, or None."""
    return getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)


def _hf_config(scope):
    """The served checkpoint's HF config, or None."""
    return getattr(getattr(_vllm_config(scope), "model_config", None), "hf_config", None)


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that yields ``body`` once, then the client's own
    messages (so vLLM still sees a real disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _AudioStream:
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
        self._samples_sent = 0
        self._audio_id = f"audio_{uuid.uuid4().hex}"
        self._chunk: dict = {}  # id, created, model of vLLM's chunks
        self._done = False  # all audio or the error sent
        self._closed = False

    async def __call__(self, message) -> None:
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
                    return await _send_failure(self._send, result)
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
                if self._done or self._closed:
                    return
                samples = payload["waveform"]
                event = self._audio_event(samples, _rate_of(payload))
                self._samples_sent += samples.shape[0]
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
        if not choices[0].get("finish_reason") or self._done:
            return [event]
        events = []
        if delta.get("content"):
            text = {**chunk, "choices": [{**choices[0], "finish_reason": None}]}
            events.append(_sse(text))
            choices[0]["delta"] = {k: v for k, v in delta.items() if k != "content"}
            event = _sse(chunk)
        return [*events, *self._audio_or_error(), event]

    def _audio_or_error(self) -> list[bytes]:
        """The last audio chunk (the waveform's samples not sent yet, ``expires_at``), or
        the error event."""
        result = self._request.result
        if self._done or result is None:
            return []
        self._done = True
        if result.error:
            return [b"data: " + _error_body(result.error, result.status) + b"\n\n"]
        rest = result.payload["waveform"][self._samples_sent:]
        return [self._audio_event(rest, result.sample_rate,
                                  expires_at=int(time.time()) + AUDIO_EXPIRY_S)]

    def _audio_event(self, samples, sample_rate: int, expires_at: int | None = None) -> bytes:
        """One ``delta.audio`` chunk of ``samples`` (``[n]`` float) as ``pcm16``."""
        transcript = "".join(self._transcript[self._transcript_sent:])
        self._transcript_sent = len(self._transcript)
        audio = {"id": self._audio_id,
                 "data": base64.b64encode(encode_audio(samples.numpy(), sample_rate,
                                                       self._format)).decode("ascii"),
                 "transcript": transcript}
        if expires_at is not None:
            audio["expires_at"] = expires_at
        return _sse({**self._chunk, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"audio": audio}, "logprobs": None, "finish_reason": None}]})


def _media_type(speech: SpeechRequest) -> bytes:
    """The content type of a speech answer: SSE, or the audio format's media type."""
    return b"text/event-stream" if speech.stream_format == "sse" else \
        AUDIO_FORMATS[speech.format].media_type.encode()


def _rate_of(payload: dict) -> int:
    """The sample rate (Hz) in a final stage's output payload (``sample_rate`` ``[k]``)."""
    return int(payload["sample_rate"].reshape(-1)[0])


def _sse(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class _Capture:
    def __init__(self):
        self.status, self.headers, self.body = 500, [], b""

    async def replay(self, send, body: bytes) -> None:
        """Send the captured status and headers with ``body``."""
        headers = [(k, v) for k, v in self.headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
