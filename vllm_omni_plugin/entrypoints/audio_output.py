"""OpenAI chat-audio output for ``/v1/chat/completions`` in omni mode.

An ASGI middleware, installed through vLLM's own ``--middleware`` mechanism
(the plugin appends it in omni mode). For a chat completion request it

* validates ``modalities`` (``["text"]`` or ``["text", "audio"]``) and the
  optional ``audio`` object (``{"voice": str, "format": "wav"}``); anything
  else is answered with HTTP 400 naming the field, before vLLM sees it;
* forwards them to the engine client in ``vllm_xargs`` (an upstream request
  field that reaches ``SamplingParams.extra_args``) with a result key;
* after vLLM's response, sets ``choices[0].message.audio`` to
  ``{"id", "data" (base64 WAV, 16-bit PCM mono), "expires_at", "transcript"}``,
  OpenAI's chat-audio shape, or replaces the response with HTTP 500 naming the
  failed stage.

Without ``modalities`` the request passes through untouched (plain vLLM).
"""

from __future__ import annotations

import base64
import json
import time
import uuid

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.engine.orchestrator import RESULTS

MIDDLEWARE_QUALNAME = "vllm_omni_plugin.entrypoints.audio_output.OmniAudioMiddleware"
CHAT_PATH = "/v1/chat/completions"
MAX_BODY_BYTES = 64 * 1024 * 1024
AUDIO_FORMATS = ("wav",)


class RequestError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"'{field}': {message}")
        self.field = field


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
    unknown = sorted(set(modalities) - {"text", "audio"})
    if unknown:
        raise RequestError("modalities", f"unsupported value(s) {unknown}; "
                           "supported: [\"text\"] or [\"text\", \"audio\"]")
    if "text" not in modalities:
        raise RequestError("modalities", "must include \"text\"")
    voice = None
    if audio is not None:
        if not isinstance(audio, dict):
            raise RequestError("audio", "must be an object {\"voice\": ..., \"format\": \"wav\"}")
        fmt = audio.get("format", "wav")
        if fmt not in AUDIO_FORMATS:
            raise RequestError("audio.format",
                               f"{fmt!r} is not supported; use one of {AUDIO_FORMATS}")
        voice = audio.get("voice")
        if voice is not None and not isinstance(voice, str):
            raise RequestError("audio.voice", "must be a string")
    if "audio" in modalities and body.get("stream"):
        raise RequestError("stream", "audio output is not available with stream=true yet")
    if "audio" in modalities and body.get("n", 1) != 1:
        raise RequestError("n", "audio output supports n=1 only")
    return sorted(set(modalities), key=["text", "audio"].index), voice


def _error_body(message: str, code: int, param: str | None = None) -> bytes:
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(
        code, "InternalServerError")
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()


async def _send_json(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


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


class OmniAudioMiddleware:
    """Pure ASGI middleware; see the module docstring."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != CHAT_PATH:
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
            body = None
        modalities = voice = None
        if isinstance(body, dict):
            try:
                modalities, voice = parse_audio_request(body)
            except RequestError as exc:
                return await _send_json(send, 400, _error_body(f"invalid request: {exc}", 400,
                                                               exc.field))
        if not modalities or modalities == ["text"]:
            forwarded = json.dumps(body).encode() if isinstance(body, dict) else raw
            return await self.app(scope, _replay(forwarded, receive), send)

        result_key = uuid.uuid4().hex
        forwarded = dict(body.get("vllm_xargs") or {})
        forwarded.update({xargs.MODALITIES: modalities, xargs.RESULT: result_key})
        if voice:
            forwarded[xargs.SPEAKER] = voice
        body["vllm_xargs"] = forwarded
        captured = _Capture()
        await self.app(scope, _replay(json.dumps(body).encode(), receive), captured.send)
        result = RESULTS.pop(result_key)
        status, payload = captured.status, captured.body
        if status == 200 and result is not None:
            if result.error:
                return await _send_json(send, result.status,
                                        _error_body(result.error, result.status))
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
