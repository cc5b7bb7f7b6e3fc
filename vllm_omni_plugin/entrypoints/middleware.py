"""The omni API: one ASGI middleware in front of vLLM's OpenAI server, routing each omni
request to its handler and guarding the pipeline's boundary.

Installed through vLLM's own ``--middleware`` mechanism (the plugin appends it in omni
mode). For every JSON ``POST`` it refuses a ``vllm_xargs`` that is not an object, or
that carries a key in the plugin's namespace (``omni_plugin_*``), with HTTP 400 naming
the field: the pipeline's control data is not the client's to write; and a body over
:data:`MAX_BODY_BYTES` with HTTP 413. Then, by path:

* ``POST /v1/chat/completions``: media content parts are checked (:mod:`.media_input`:
  part types, data-URL media types, inline images and audio that do not decode, item
  counts, audio length) and the request runs with audio output (:mod:`.chat_audio`);
  ``"modalities": ["image"]`` draws an image instead (:mod:`.images`).
* ``POST /v1/completions``: a text completion, with the pipeline's error replacing a
  failed entry stage's answer (:mod:`.chat_audio`).
* ``POST /v1/images/generations``: OpenAI's image generation, for a model whose plugin
  plans images (:mod:`.images`); ``POST /v1/images/edits`` (a ``multipart/form-data``
  body): OpenAI's image editing, the same way with input images.
* ``POST /v1/audio/speech``: OpenAI's text to speech (:mod:`.speech`).
* ``GET /v1/audio/voices``: the checkpoint's voices (the ``omni_list_voices`` hook).
* ``GET /v1/realtime`` (WebSocket): OpenAI's Realtime API (:mod:`.realtime`).

Everything this middleware answers or reads (the routes above and every JSON ``POST``)
first passes vLLM's own API-key check, as vLLM configured it (``--api-key``,
``VLLM_API_KEY``): without the key it gets vLLM's HTTP 401 (a WebSocket the same answer
before it is accepted), before a body is read or media decoded. A request that fails a
check gets HTTP 400 naming the field before vLLM sees it; a voice the checkpoint lacks is a
400 naming ``audio.voice`` or ``voice``.
"""

from __future__ import annotations

import asyncio
import json

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.compat.api_auth import authenticated
from vllm_omni_plugin.engine.omni_request import IMAGE
from vllm_omni_plugin.entrypoints.asgi import (
    error_body,
    hf_config,
    is_json,
    replay,
    send_json,
    vllm_config,
)
from vllm_omni_plugin.entrypoints.chat_audio import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    parse_audio_request,
    serve_chat,
)
from vllm_omni_plugin.entrypoints.images import (
    EDITS_PATH,
    IMAGES_PATH,
    chat_image_body,
    fetch_images,
    parse_edit_form,
    plan_image_request,
    serve_image,
)
from vllm_omni_plugin.entrypoints.media_input import (
    MediaLimits,
    RequestError,
    check_media,
    has_media_parts,
)
from vllm_omni_plugin.entrypoints.realtime import REALTIME_PATH, RealtimeEndpoint
from vllm_omni_plugin.entrypoints.speech import SPEECH_PATH, parse_speech_request, serve_speech
from vllm_omni_plugin.processors import Voices, list_voices
from vllm_omni_plugin.processors.hookspecs import MAX_VOICE_CHARS

VOICES_PATH = "/v1/audio/voices"
MAX_BODY_BYTES = 64 * 1024 * 1024
_UNSET = object()


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


class OmniApiMiddleware:
    """Pure ASGI middleware; see the module docstring."""

    def __init__(self, app):
        self.app = app
        self.realtime = RealtimeEndpoint()
        self._limits: MediaLimits | None = None
        self._voices: Voices | None | object = _UNSET
        #: :meth:`_serve` behind vLLM's API-key check, built at the first request (when
        #: vLLM's own middleware is known)
        self._authenticated = None

    def media_limits(self, scope) -> MediaLimits:
        """The served model's media limits, read once from vLLM's app state."""
        if self._limits is None:
            config = vllm_config(scope)
            self._limits = MediaLimits() if config is None else \
                MediaLimits.from_vllm_config(config)
        return self._limits

    def voices(self, scope) -> Voices | None:
        """The served checkpoint's voices (the ``omni_list_voices`` hook), read once."""
        if self._voices is _UNSET:
            config = hf_config(scope)
            self._voices = None if config is None else list_voices(config)
        return self._voices

    def check_voice(self, scope, voice: str | None, field: str) -> None:
        """Refuse a voice the checkpoint does not have.

        Raises:
            RequestError: naming ``field`` and listing the voices.
        """
        known = self.voices(scope)
        if voice is None or known is None:
            return
        try:
            known.resolve(voice)
        except ValueError as exc:
            raise RequestError(field, f"{exc} (GET {VOICES_PATH})") from exc

    async def __call__(self, scope, receive, send):
        """Route one ASGI connection (see the module docstring). What this middleware
        answers or reads (the Realtime WebSocket, ``GET`` of the voices, every JSON
        ``POST``) first passes vLLM's own API-key check (``--api-key``,
        :mod:`~vllm_omni_plugin.compat.api_auth`): without the key it gets vLLM's 401
        before a body is read or a session opened. Anything else goes to vLLM untouched."""
        if not _reads(scope):
            return await self.app(scope, receive, send)
        if self._authenticated is None:
            self._authenticated = authenticated(scope.get("app"), self._serve)
        await self._authenticated(scope, receive, send)

    async def _serve(self, scope, receive, send):
        """Serve an authenticated connection :func:`_reads` picked: the Realtime WebSocket,
        the voices, or a JSON ``POST`` (its body read whole, checked, then served by its
        handler or passed on to vLLM). A refused request is answered here with HTTP 400
        or 413."""
        if scope["type"] == "websocket":
            return await self.realtime.serve(scope, receive, send, self.voices(scope),
                                             self.media_limits(scope))
        if scope["method"] == "GET":
            known = self.voices(scope)
            return await send_json(send, 200, json.dumps({
                "object": "list", "default": known.default if known else None,
                "data": [{"id": name, "object": "voice"} for name in
                         (known.names if known else [])]}).encode())
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > MAX_BODY_BYTES:
                return await send_json(send, 413, error_body("request body too large", 413))
        raw = b"".join(chunks)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # vLLM answers malformed JSON itself
        path = scope["path"]
        asked = speech = image = None
        chat_image = False
        if path == EDITS_PATH:
            try:
                form, files = await parse_edit_form(scope, raw)
                image = await asyncio.to_thread(plan_image_request, scope, form, "model",
                                                [("image", data) for data in files])
            except RequestError as exc:
                return await send_json(send, 400, error_body(f"invalid request: {exc}", 400,
                                                             exc.field))
            return await serve_image(self.app, scope, receive, send, *image)
        if isinstance(body, dict):
            try:
                check_vllm_xargs(body)
                if path == CHAT_PATH and _asks_image(body):
                    image_body, parts = chat_image_body(body)
                    images = await fetch_images(
                        getattr(vllm_config(scope), "model_config", None), parts)
                    image = await asyncio.to_thread(plan_image_request, scope, image_body,
                                                    "modalities", images)
                    chat_image = True
                elif path == CHAT_PATH:
                    asked = parse_audio_request(body)
                    self.check_voice(scope, asked and asked.voice, "audio.voice")
                    if has_media_parts(body):
                        # decoding inline media takes a while: off the event loop
                        await asyncio.to_thread(check_media, body, self.media_limits(scope))
                elif path == SPEECH_PATH:
                    speech = parse_speech_request(body, MAX_VOICE_CHARS)
                    self.check_voice(scope, speech.voice, "voice")
                elif path == IMAGES_PATH:
                    image = plan_image_request(scope, body)
            except RequestError as exc:
                return await send_json(send, 400, error_body(f"invalid request: {exc}", 400,
                                                             exc.field))
        if speech is not None:
            return await serve_speech(self.app, scope, receive, send, speech)
        if image is not None:
            return await serve_image(self.app, scope, receive, send, *image, chat=chat_image)
        if path not in (CHAT_PATH, COMPLETIONS_PATH) or not isinstance(body, dict):
            forwarded = json.dumps(body).encode() if isinstance(body, dict) else raw
            return await self.app(scope, replay(forwarded, receive), send)
        # a body the checks left as it came (no audio fields popped) goes on as it came
        await serve_chat(self.app, scope, receive, send, body, asked,
                         raw=raw if asked is None else None)


def _reads(scope) -> bool:
    """Whether the middleware answers or reads this connection itself: the Realtime
    WebSocket, ``GET`` of the voices, a ``POST`` with a JSON body, or an image edit."""
    if scope["type"] == "websocket":
        return scope["path"] == REALTIME_PATH
    if scope["type"] != "http":
        return False
    if scope["method"] == "GET":
        return scope["path"] == VOICES_PATH
    return scope["method"] == "POST" and (is_json(scope) or scope["path"] == EDITS_PATH)


def _asks_image(body: dict) -> bool:
    """Whether a chat body's ``modalities`` ask for an image."""
    modalities = body.get("modalities")
    return isinstance(modalities, list) and IMAGE in modalities
