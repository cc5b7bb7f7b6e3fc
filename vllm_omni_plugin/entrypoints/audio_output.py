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
* validates ``modalities`` (``["text"]`` or ``["text", "audio"]``) and the
  optional ``audio`` object (``{"voice": str, "format": "wav"}``); anything
  else is answered with HTTP 400 naming the field, before vLLM sees it;
* runs vLLM's handler inside an :class:`~vllm_omni_plugin.engine.omni_request.OmniRequest`
  scope carrying them, where the orchestrator finds them and leaves its result;
* after vLLM's response, sets ``choices[0].message.audio`` to
  ``{"id", "data" (base64 WAV, 16-bit PCM mono), "expires_at", "transcript"}``,
  OpenAI's chat-audio shape, or replaces the response with the pipeline's
  error (HTTP 400/429/500/503 naming the stage, ``Retry-After`` on 429/503).

Non-streamed text-only chat and completion requests get the same error
replacement when the entry stage's worker failed them; streamed ones pass
through untouched (vLLM reports the failure in the stream).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
import uuid

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.engine.omni_request import (
    AUDIO,
    TEXT,
    OmniRequest,
    StageResult,
    omni_request_scope,
)
from vllm_omni_plugin.entrypoints.media_input import MediaLimits, RequestError, check_media

MIDDLEWARE_QUALNAME = "vllm_omni_plugin.entrypoints.audio_output.OmniAudioMiddleware"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MAX_BODY_BYTES = 64 * 1024 * 1024
AUDIO_FORMATS = ("wav",)
#: Longest voice name accepted (speaker names in Qwen3-Omni's config are short words).
MAX_VOICE_CHARS = 64
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


def parse_audio_request(body: dict) -> tuple[list[str] | None, str | None]:
    """Validate ``modalities``/``audio``; returns ``(modalities, voice)``.

    Raises:
        RequestError: naming the offending field.
    """
    modalities = body.pop("modalities", None)
    audio = body.pop("audio", None)
    if modalities is None:
        if audio is not None:
            raise RequestError("audio", "requires \"modalities\": [\"text\", \"audio\"]")
        return None, None
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
    if audio is not None:
        if not isinstance(audio, dict):
            raise RequestError("audio", "must be an object {\"voice\": ..., \"format\": \"wav\"}")
        fmt = audio.get("format", "wav")
        if fmt not in AUDIO_FORMATS:
            shown = fmt[:40] if isinstance(fmt, str) else type(fmt).__name__
            raise RequestError("audio.format",
                               f"{shown!r} is not supported; use one of {AUDIO_FORMATS}")
        voice = audio.get("voice")
        if voice is not None:
            if not isinstance(voice, str) or not voice.strip():
                raise RequestError("audio.voice", "must be a non-empty string (or left out "
                                   "for the default voice)")
            if len(voice) > MAX_VOICE_CHARS:
                raise RequestError("audio.voice", f"is {len(voice)} characters long; voice "
                                   f"names have at most {MAX_VOICE_CHARS}")
    if AUDIO in modalities and body.get("stream"):
        raise RequestError("stream", "audio output is not available with stream=true yet")
    if AUDIO in modalities and body.get("n") not in (None, 1):
        raise RequestError("n", "audio output supports n=1 only")
    return sorted(set(modalities), key=[TEXT, AUDIO].index), voice


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


def attach_audio(response: dict, result, sample_rate: int) -> dict:
    """Put ``result.payload["waveform"]`` into ``choices[0].message.audio``."""
    from vllm_omni_plugin.entrypoints.wav import encode_wav

    wav = encode_wav(result.payload["waveform"].numpy(), sample_rate)
    message = response["choices"][0]["message"]
    message["audio"] = {
        "id": f"audio_{uuid.uuid4().hex}",
        "data": base64.b64encode(wav).decode("ascii"),
        "expires_at": int(time.time()) + 3600,
        "transcript": message.get("content") or "",
    }
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

    def media_limits(self, scope) -> MediaLimits:
        """The served model's media limits, read once from vLLM's app state."""
        if self._limits is None:
            config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
            self._limits = MediaLimits() if config is None else \
                MediaLimits.from_vllm_config(config)
        return self._limits

    async def __call__(self, scope, receive, send):
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
        modalities = voice = None
        if isinstance(body, dict):
            try:
                check_vllm_xargs(body)
                if path == CHAT_PATH:
                    modalities, voice = parse_audio_request(body)
                    # decoding inline media takes a while: off the event loop
                    await asyncio.to_thread(check_media, body, self.media_limits(scope))
            except RequestError as exc:
                return await _send_json(send, 400, _error_body(f"invalid request: {exc}", 400,
                                                               exc.field))
        forwarded = json.dumps(body).encode() if isinstance(body, dict) else raw
        if path not in (CHAT_PATH, COMPLETIONS_PATH) or not isinstance(body, dict):
            return await self.app(scope, _replay(forwarded, receive), send)
        request = OmniRequest(modalities=tuple(modalities or (TEXT,)), voice=voice)
        if request.text_only and body.get("stream"):
            with omni_request_scope(request):
                return await self.app(scope, _replay(forwarded, receive), send)
        captured = _Capture()
        with omni_request_scope(request):
            try:
                await self.app(scope, _replay(forwarded, receive), captured.send)
            except Exception:
                # a failure the orchestrator recorded (and logged) answers with its own
                # status (vLLM's handler for exceptions would make every one a 500)
                if request.result is None or not request.result.error:
                    raise
        result = request.result
        if result is not None and result.error:
            return await _send_failure(send, result)
        status, payload = captured.status, captured.body
        if status == 200 and result is not None:
            response = json.loads(payload)
            payload = json.dumps(attach_audio(response, result, result.sample_rate)).encode()
        headers = [(k, v) for k, v in captured.headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


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


class _Capture:
    def __init__(self):
        self.status, self.headers, self.body = 500, [], b""

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
