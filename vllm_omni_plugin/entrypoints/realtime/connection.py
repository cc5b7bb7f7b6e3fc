"""OpenAI's Realtime API, ``GET /v1/realtime`` (WebSocket), on the omni pipeline.

One session per connection, speaking the event protocol of OpenAI's Realtime API as
the official ``openai`` SDK does (``client.realtime.connect(model=...)``). Audio in and
out is ``audio/pcm``: 16-bit little-endian mono at 24 kHz (:data:`~.vad.INPUT_RATE`).
The output is the pipeline's own pcm16, passed through: 24 kHz is Qwen3-Omni's
code2wav rate (not checked against the pipeline).

Client events: ``session.update`` (``instructions``, ``output_modalities``
``["audio"]`` or ``["text"]``, ``audio.input.format``, ``audio.input.turn_detection``
(``server_vad`` with ``threshold``, ``prefix_padding_ms``, ``silence_duration_ms``,
``create_response``, ``interrupt_response``; or null), ``audio.output.voice``,
``audio.output.format``, ``tools``, ``tool_choice``, ``max_output_tokens``),
``input_audio_buffer.append / commit / clear``, ``conversation.item.create`` (user,
system and assistant messages of text and audio, ``function_call_output``),
``conversation.item.delete / truncate``, ``response.create``, ``response.cancel``.

Server events: ``session.created / updated``, ``input_audio_buffer.speech_started /
speech_stopped / committed / cleared``, ``conversation.item.added / done / deleted /
truncated``, ``response.created``, ``response.output_item.added / done``,
``response.content_part.added / done``, ``response.output_audio.delta / done``,
``response.output_audio_transcript.delta / done``, ``response.output_text.delta /
done``, ``response.function_call_arguments.done``, ``response.done``, and ``error``
(``{"type", "code", "message", "param", "event_id"}``, naming the field; the session
lives on).

A response is one streamed chat completion of the conversation so far (the session's
``instructions`` as the system message, then every item in order; user audio as an
``input_audio`` part), run through the same handler as ``/v1/chat/completions`` with
audio output (:mod:`.chat_audio`): the text streams as transcript (or text) deltas, the
speech as ``response.output_audio.delta`` chunks as the pipeline produces them. A
conversation longer than the model's context (vLLM refuses the prompt) loses its oldest
items first, each logged and announced as ``conversation.item.deleted``, until it
fits. An assistant turn goes into later prompts as its transcript. With
server VAD, the end of the user's speech commits the input audio and starts a
response; speech that starts while a response runs cancels it (barge-in: its
``response.done`` says ``cancelled``, ``turn_detected``, and the assistant item is
truncated where its audio stopped). A cancelled response, or a client that goes away,
stops every stage's work for it at once.

Limits: at most ``--omni-realtime-max-sessions`` sessions (one more gets an ``error``
event and is closed with code 1013); a session idle for
``--omni-realtime-idle-timeout`` seconds is closed (code 1000); an event over
:data:`MAX_EVENT_BYTES` or not a JSON object gets an ``error`` event; the input audio
buffer holds at most ``--omni-realtime-max-input-audio`` seconds (an append past it gets
an ``error`` event, ``input_audio_buffer_full``, and is dropped). With server VAD, the
buffer keeps only ``prefix_padding_ms`` of audio while no speech is under way.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from vllm_omni_plugin.compat.internals import websocket_metrics_middleware
from vllm_omni_plugin.config.settings import OmniSettings, RealtimeSettings
from vllm_omni_plugin.entrypoints.asgi import vllm_config
from vllm_omni_plugin.entrypoints.audio_encoding import STREAM_FORMAT, encode_audio
from vllm_omni_plugin.entrypoints.chat_audio import CHAT_PATH, parse_audio_request, serve_chat
from vllm_omni_plugin.entrypoints.media_input import MediaLimits, RequestError, check_media
from vllm_omni_plugin.entrypoints.realtime_metrics import RESPONSES_CANCELLED, TURN_LATENCY
from vllm_omni_plugin.entrypoints.vad import INPUT_RATE, ServerVad, VadParams
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.processors import Voices

logger = init_logger(__name__)

REALTIME_PATH = "/v1/realtime"
#: OpenAI's limit on one client event (an ``input_audio_buffer.append`` of 15 MiB).
MAX_EVENT_BYTES = 15 * 1024 * 1024
#: Input audio shorter than this cannot be committed (OpenAI's rule: 100 ms).
MIN_COMMIT_MS = 100
#: The one audio format in and out: OpenAI's ``audio/pcm`` at 24 kHz.
PCM_FORMAT = {"type": "audio/pcm", "rate": INPUT_RATE}
#: The rate (Hz) the user's audio goes to the model at: Whisper's, which Whisper-style
#: audio encoders such as Qwen3-Omni's take. Resampled here (soxr), so that vLLM's
#: processor has nothing to resample (its default resampler needs torchaudio).
MODEL_RATE = 16000
#: WebSocket close codes (RFC 6455 §7.4.1; 1013 is IANA's "try again later").
CLOSE_NORMAL = 1000
CLOSE_TRY_AGAIN_LATER = 1013


class RealtimeError(Exception):
    """A client event the session refuses: ``code`` (OpenAI's error codes where one
    exists), ``param`` the field it names, ``message`` the reason."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def _event_id() -> str:
    return f"event_{uuid.uuid4().hex[:20]}"


def _item_id() -> str:
    return f"item_{uuid.uuid4().hex[:20]}"


@dataclass
class TurnDetection:
    """``server_vad`` turn detection of a session (see :mod:`.vad`)."""

    vad: VadParams = field(default_factory=VadParams)
    create_response: bool = True
    interrupt_response: bool = True

    def as_dict(self) -> dict:
        """The ``turn_detection`` object of the session (``type`` ``server_vad``)."""
        return {"type": "server_vad", "threshold": self.vad.threshold,
                "prefix_padding_ms": self.vad.prefix_padding_ms,
                "silence_duration_ms": self.vad.silence_duration_ms,
                "create_response": self.create_response,
                "interrupt_response": self.interrupt_response}


@dataclass
class SessionConfig:
    """What ``session.update`` sets (OpenAI's defaults)."""

    voice: str | None  # None: the model has no voices
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    tools: list[dict] = field(default_factory=list)
    tool_choice: str | dict = "auto"
    max_output_tokens: int | None = None  # None: "inf"

    def as_dict(self, session_id: str, model: str | None) -> dict:
        """The session object of ``session.created`` / ``session.updated``."""
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id,
            "model": model, "instructions": self.instructions,
            "output_modalities": list(self.output_modalities),
            "audio": {"input": {"format": dict(PCM_FORMAT), "turn_detection":
                                self.turn_detection.as_dict() if self.turn_detection else None},
                      "output": {"format": dict(PCM_FORMAT), "voice": self.voice}},
            "tools": self.tools, "tool_choice": self.tool_choice,
            "max_output_tokens": self.max_output_tokens or "inf"}


class RealtimeEndpoint:
    """``/v1/realtime`` of one API server: counts its open sessions, and meters each
    connection with vLLM's WebSocket metrics (:mod:`.realtime_metrics`).

    Args:
        app: the ASGI app behind the omni middleware (vLLM's routes).
    """

    def __init__(self, app) -> None:
        self.app = app
        self.open = 0
        self._metered = websocket_metrics_middleware()

    async def serve(self, scope, receive, send, voices: Voices | None,
                    media_limits: MediaLimits) -> None:
        """Run one WebSocket connection's session to its end. ``voices`` and
        ``media_limits``: the served model's, as the middleware read them."""

        async def connection(scope, receive, send) -> None:
            await self._connection(scope, receive, send, voices, media_limits)

        if self._metered is None:
            return await connection(scope, receive, send)
        await self._metered(connection)(scope, receive, send)

    async def _connection(self, scope, receive, send, voices: Voices | None,
                          media_limits: MediaLimits) -> None:
        from starlette.websockets import WebSocket

        settings = OmniSettings.from_vllm_config(vllm_config(scope))
        limits = settings.realtime if settings is not None else RealtimeSettings()
        ws = WebSocket(scope, receive, send)
        await ws.accept()
        if self.open >= limits.max_sessions:
            logger.warning("realtime session refused: %d sessions are open "
                           "(--omni-realtime-max-sessions)", self.open)
            await ws.send_text(json.dumps(_error_event(RealtimeError(
                None, f"the server has {self.open} realtime sessions open, its limit "
                "(--omni-realtime-max-sessions); try again later",
                code="session_limit_reached"))))
            await ws.close(CLOSE_TRY_AGAIN_LATER)
            return
        self.open += 1
        try:
            session = RealtimeSession(self.app, ws, scope, limits, voices, media_limits)
            await session.run()
        finally:
            self.open -= 1


def _error_event(exc: RealtimeError, event_id: str | None = None) -> dict:
    kind = "server_error" if exc.code == "server_error" else "invalid_request_error"
    return {"type": "error", "event_id": _event_id(), "error": {
        "type": kind, "code": exc.code, "message": str(exc),
        "param": exc.param, "event_id": event_id}}


class RealtimeSession:
    """One client's conversation over one WebSocket (see the module docstring)."""

    def __init__(self, app, ws, scope, limits: RealtimeSettings, voices: Voices | None,
                 media_limits: MediaLimits) -> None:
        self.app = app
        self.ws = ws
        self.scope = scope
        self.idle_timeout = limits.idle_timeout
        self.max_input_audio = limits.max_input_audio
        self.voices = voices
        self.media_limits = media_limits
        self.id = f"sess_{uuid.uuid4().hex[:20]}"
        self.model = ws.query_params.get("model")
        self.config = SessionConfig(voice=voices.default if voices else None)
        self.items: list[dict] = []
        self.audio = bytearray()  # the input audio buffer: pcm16 at INPUT_RATE
        self.samples_in = 0  # samples of input audio appended in the session
        self.vad: ServerVad | None = None  # server VAD over the input audio
        self.vad_origin_ms = 0  # the session's input audio (ms) before the detector's
        self.speech_item: str | None = None  # the item id of the speech being detected
        #: ``time.monotonic()`` of the last commit no response has answered yet
        self.turn_ended: float | None = None
        self.response: asyncio.Task | None = None
        self.response_run: _ResponseRun | None = None
        self._send_lock = asyncio.Lock()

    # -- the connection ----------------------------------------------------------------
    async def run(self) -> None:
        """Serve the connection to its end: send ``session.created``, then handle each
        client event (:meth:`handle`) until the client disconnects or stays idle for
        ``idle_timeout`` seconds while no response runs (an ``error`` event, then close
        code 1000). A running response is cancelled on the way out."""
        from starlette.websockets import WebSocketDisconnect

        await self.send({"type": "session.created",
                         "session": self.config.as_dict(self.id, self.model)})
        try:
            while True:
                try:
                    message = await asyncio.wait_for(self.ws.receive(), self.idle_timeout)
                except asyncio.TimeoutError:
                    if self.response is not None and not self.response.done():
                        continue  # a response runs: not idle
                    await self.send(_error_event(RealtimeError(
                        None, f"no client event for {self.idle_timeout:g} s "
                        "(--omni-realtime-idle-timeout): closing the session",
                        code="idle_timeout")))
                    await self.ws.close(CLOSE_NORMAL)
                    return
                if message["type"] == "websocket.disconnect":
                    return
                await self.handle(message.get("text") or message.get("bytes") or "")
        except WebSocketDisconnect:
            return
        finally:
            await self._cancel_response("client_disconnected")

    async def send(self, event: dict) -> None:
        """Send one server event (an ``event_id`` is added); a closed socket is ignored."""
        event.setdefault("event_id", _event_id())
        async with self._send_lock:
            try:
                await self.ws.send_text(json.dumps(event))
            except Exception:  # the client went away: run() sees the disconnect
                pass

    async def handle(self, raw: str | bytes) -> None:
        """Handle one client event; a refused one gets an ``error`` event."""
        event_id = None
        try:
            if len(raw) > MAX_EVENT_BYTES:
                raise RealtimeError(None, f"the event is {len(raw)} bytes, over the limit "
                                    f"of {MAX_EVENT_BYTES}", code="event_too_large")
            try:
                event = json.loads(raw)
            except ValueError as exc:
                raise RealtimeError(None, f"the event is not JSON: {exc}",
                                    code="invalid_json") from exc
            if not isinstance(event, dict):
                raise RealtimeError(None, "the event must be a JSON object",
                                    code="invalid_json")
            event_id = event.get("event_id")
            kind = event.get("type")
            handler = self._HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise RealtimeError("type", f"unknown client event type {str(kind)[:60]!r}",
                                    code="invalid_event")
            await handler(self, event)
        except RealtimeError as exc:
            await self.send(_error_event(exc, event_id if isinstance(event_id, str) else None))
        except Exception as exc:  # a bug of ours: this event fails, the session goes on
            logger.exception("realtime session %s: an event failed", self.id)
            await self.send(_error_event(
                RealtimeError(None, f"{type(exc).__name__}: {exc}", code="server_error"),
                event_id if isinstance(event_id, str) else None))

    # -- session.update ----------------------------------------------------------------
    async def _session_update(self, event: dict) -> None:
        session = _object(event, "session")
        config = self.config
        changes: dict = {}
        for key, value in session.items():
            if key in ("type", "model", "object", "id"):
                if key == "type" and value != "realtime":
                    raise RealtimeError("session.type", f"{value!r} is not supported; this "
                                        "server runs \"realtime\" sessions")
            elif key == "instructions":
                changes["instructions"] = _str(value, "session.instructions")
            elif key == "output_modalities":
                changes["output_modalities"] = _modalities(value, "session.output_modalities")
            elif key == "audio":
                changes.update(self._audio_config(_object(session, "audio", "session")))
            elif key == "tools":
                changes["tools"] = _tools(value)
            elif key == "tool_choice":
                changes["tool_choice"] = _tool_choice(value, "session.tool_choice")
            elif key == "max_output_tokens":
                changes["max_output_tokens"] = _max_tokens(value, "session.max_output_tokens")
            elif key in ("tracing", "include", "prompt", "truncation"):
                continue  # accepted and not applied (the SDK may send them)
            else:
                raise RealtimeError(f"session.{key}", "is not supported by this server")
        for name, value in changes.items():
            setattr(config, name, value)
        if "turn_detection" in changes:  # a new detector with the next audio
            self.vad, self.speech_item = None, None
        await self.send({"type": "session.updated",
                         "session": config.as_dict(self.id, self.model)})

    def _audio_config(self, audio: dict) -> dict:
        changes: dict = {}
        for side, value in audio.items():
            if side not in ("input", "output"):
                raise RealtimeError(f"session.audio.{side}", "is not supported")
            if not isinstance(value, dict):
                raise RealtimeError(f"session.audio.{side}", "must be an object")
            for key, setting in value.items():
                where = f"session.audio.{side}.{key}"
                if key == "format":
                    _check_format(setting, where)
                elif side == "input" and key == "turn_detection":
                    changes["turn_detection"] = _turn_detection(setting, where)
                elif side == "output" and key == "voice":
                    changes["voice"] = self._voice(setting, where)
                elif side == "output" and key == "speed":
                    if setting != 1.0:
                        raise RealtimeError(where, "only 1.0 is supported")
                elif side == "input" and key in ("transcription", "noise_reduction"):
                    if setting is not None:
                        raise RealtimeError(where, "is not supported (use null)")
                else:
                    raise RealtimeError(where, "is not supported")
        return changes

    def _voice(self, value, where: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise RealtimeError(where, "must be a non-empty voice name")
        if self.voices is None:
            raise RealtimeError(where, "the served model has no voices")
        try:
            return self.voices.resolve(value)
        except ValueError as exc:
            raise RealtimeError(where, str(exc)) from exc

    # -- input audio ---------------------------------------------------------------------
    async def _append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise RealtimeError("audio", "must be a base64 string of pcm16 audio")
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RealtimeError("audio", f"is not valid base64: {exc}") from exc
        if len(pcm) % 2:
            raise RealtimeError("audio", f"{len(pcm)} bytes is not whole 16-bit samples: "
                                "the input format is audio/pcm, 16-bit mono at "
                                f"{INPUT_RATE} Hz")
        held = len(self.audio) // 2 / INPUT_RATE
        if held + len(pcm) // 2 / INPUT_RATE > self.max_input_audio:
            raise RealtimeError(
                "audio", f"the input audio buffer holds {held:.1f} s of audio and this "
                f"append would take it past its limit of {self.max_input_audio:g} s "
                "(--omni-realtime-max-input-audio): the append is dropped; commit or clear "
                "the buffer", code="input_audio_buffer_full")
        detection = self.config.turn_detection
        if detection is not None and self.vad is None:
            # loaded with the first audio (Silero's model: about 2 MB)
            self.vad = await asyncio.to_thread(ServerVad, detection.vad)
            self.vad_origin_ms = self.samples_in * 1000 // INPUT_RATE
        self.audio += pcm
        self.samples_in += len(pcm) // 2
        if self.vad is None:
            return
        for found in await asyncio.to_thread(self.vad.feed, pcm):
            if found.kind == "start":
                await self._speech_started(self.vad_origin_ms + found.ms)
            elif self.speech_item is not None:
                await self._speech_stopped(self.vad_origin_ms + found.ms)
        if self.speech_item is None:
            # no speech under way: keep only the padding a start would reach back into,
            # so that an open microphone's silence does not fill the buffer
            keep = 2 * (INPUT_RATE * self.vad.params.prefix_padding_ms // 1000)
            del self.audio[:max(0, len(self.audio) - keep)]

    async def _speech_started(self, ms: int) -> None:
        self.speech_item = _item_id()
        await self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": ms,
                         "item_id": self.speech_item})
        detection = self.config.turn_detection
        if detection is not None and detection.interrupt_response:
            await self._cancel_response("turn_detected")

    async def _speech_stopped(self, ms: int) -> None:
        item_id, self.speech_item = self.speech_item, None
        await self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ms,
                         "item_id": item_id})
        await self._commit(item_id)
        detection = self.config.turn_detection
        if detection is not None and detection.create_response:
            await self._start_response({})

    async def _commit_event(self, event: dict) -> None:
        await self._commit(self.speech_item or _item_id())
        self.speech_item = None

    async def _commit(self, item_id: str) -> None:
        ms = len(self.audio) // 2 * 1000 // INPUT_RATE
        if ms < MIN_COMMIT_MS:
            raise RealtimeError(None, f"the input audio buffer holds {ms} ms of audio; at "
                                f"least {MIN_COMMIT_MS} ms can be committed",
                                code="input_audio_buffer_commit_empty")
        pcm, self.audio = bytes(self.audio), bytearray()
        self.turn_ended = time.monotonic()
        previous = self.items[-1]["id"] if self.items else None
        item = {"id": item_id, "type": "message", "object": "realtime.item",
                "status": "completed", "role": "user",
                "content": [_input_audio_part(base64.b64encode(pcm).decode(), pcm)]}
        await self.send({"type": "input_audio_buffer.committed", "item_id": item_id,
                         "previous_item_id": previous})
        await self._add_item(item, previous)

    async def _clear(self, event: dict) -> None:
        self.audio = bytearray()
        await self.send({"type": "input_audio_buffer.cleared"})

    # -- conversation items --------------------------------------------------------------
    async def _item_create(self, event: dict) -> None:
        item = _conversation_item(_object(event, "item"))
        previous = event.get("previous_item_id")
        if previous is not None and previous != "root" and not any(
                i["id"] == previous for i in self.items):
            raise RealtimeError("previous_item_id", f"no item {str(previous)[:60]!r} in the "
                                "conversation", code="item_not_found")
        if any(i["id"] == item["id"] for i in self.items):
            raise RealtimeError("item.id", f"item {item['id']!r} exists already")
        await self._add_item(item, previous if previous is not None else (
            self.items[-1]["id"] if self.items else None), insert=previous is not None)

    async def _add_item(self, item: dict, previous: str | None, insert: bool = False) -> None:
        if insert:
            at = 0 if previous in (None, "root") else next(
                i for i, it in enumerate(self.items) if it["id"] == previous) + 1
            self.items.insert(at, item)
        else:
            self.items.append(item)
        # the item as OpenAI reports it: audio content without its bytes (the client
        # has them; a 4 s turn is about 250 kB of base64 an event), nor their chat part
        shown = {**item, "content": [{k: v for k, v in part.items()
                                      if k not in ("audio", "chat")}
                                     for part in item["content"]]} if "content" in item else item
        for kind in ("conversation.item.added", "conversation.item.done"):
            await self.send({"type": kind, "previous_item_id": previous, "item": shown})

    async def _item_delete(self, event: dict) -> None:
        item_id = event.get("item_id")
        for i, item in enumerate(self.items):
            if item["id"] == item_id:
                del self.items[i]
                await self.send({"type": "conversation.item.deleted", "item_id": item_id})
                return
        raise RealtimeError("item_id", f"no item {str(item_id)[:60]!r} in the conversation",
                            code="item_not_found")

    async def _item_truncate(self, event: dict) -> None:
        item_id, end = event.get("item_id"), event.get("audio_end_ms")
        item = next((i for i in self.items if i["id"] == item_id), None)
        if item is None or item.get("role") != "assistant":
            raise RealtimeError("item_id", f"no assistant item {str(item_id)[:60]!r} in the "
                                "conversation", code="item_not_found")
        if not isinstance(end, int) or end < 0:
            raise RealtimeError("audio_end_ms", "must be a non-negative integer")
        await self._truncated(item, int(event.get("content_index") or 0), end)

    async def _truncated(self, item: dict, content_index: int, audio_end_ms: int) -> None:
        item["status"] = "incomplete"
        await self.send({"type": "conversation.item.truncated", "item_id": item["id"],
                         "content_index": content_index, "audio_end_ms": audio_end_ms})

    # -- responses -----------------------------------------------------------------------
    async def _response_create(self, event: dict) -> None:
        overrides = event.get("response") or {}
        if not isinstance(overrides, dict):
            raise RealtimeError("response", "must be an object")
        await self._start_response(overrides)

    async def _response_cancel(self, event: dict) -> None:
        if self.response is None or self.response.done():
            raise RealtimeError(None, "there is no response to cancel",
                                code="response_cancel_not_active")
        await self._cancel_response("client_cancelled")

    async def _start_response(self, overrides: dict) -> None:
        if self.response is not None and not self.response.done():
            raise RealtimeError(None, "the conversation has a response in progress; cancel "
                                "it first (response.cancel)",
                                code="conversation_already_has_active_response")
        config = self.config
        modalities = config.output_modalities
        instructions = config.instructions
        max_tokens = config.max_output_tokens
        for key, value in overrides.items():
            if key == "output_modalities":
                modalities = _modalities(value, "response.output_modalities")
            elif key == "instructions":
                instructions = _str(value, "response.instructions")
            elif key == "max_output_tokens":
                max_tokens = _max_tokens(value, "response.max_output_tokens")
            elif key in ("metadata", "conversation"):
                continue
            else:
                raise RealtimeError(f"response.{key}", "is not supported by this server")
        run = _ResponseRun(self, modalities, instructions, max_tokens,
                           self.turn_ended or time.monotonic())
        self.turn_ended = None
        self.response_run = run
        self.response = asyncio.ensure_future(run.run())

    async def _cancel_response(self, reason: str) -> None:
        """Stop the running response, if any (its stages stop at once), and report it
        ``cancelled``; on barge-in the assistant item is truncated where its audio
        stopped."""
        task, run = self.response, self.response_run
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task})
        await run.cancelled(reason)

    async def drop_oldest_item(self) -> bool:
        """Drop the conversation's oldest item (never its newest) when a response's
        prompt is longer than the model's context, with a logged notice and a
        ``conversation.item.deleted`` event; False when only one item is left."""
        if len(self.items) < 2:
            return False
        item = self.items.pop(0)
        logger.warning("realtime session %s: the conversation is longer than the model's "
                       "context; its oldest item (%s, %s) is dropped (%d left)", self.id,
                       item["id"], item.get("role", item["type"]), len(self.items))
        await self.send({"type": "conversation.item.deleted", "item_id": item["id"]})
        return True

    _HANDLERS = {
        "session.update": _session_update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit_event,
        "input_audio_buffer.clear": _clear,
        "conversation.item.create": _item_create,
        "conversation.item.delete": _item_delete,
        "conversation.item.truncate": _item_truncate,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
    }


class _ResponseRun:
    """One response: a streamed chat completion of the conversation, its chunks turned
    into Realtime events."""

    def __init__(self, session: RealtimeSession, modalities, instructions: str,
                 max_tokens: int | None, turn_ended: float) -> None:
        self.session = session
        #: ``time.monotonic()`` at the end of the turn it answers (its commit, else its
        #: ``response.create``): the start of its turn latency
        self.turn_ended = turn_ended
        self.id = f"resp_{uuid.uuid4().hex[:20]}"
        self.modalities = tuple(modalities)
        self.audio = "audio" in self.modalities
        self.instructions = instructions
        self.max_tokens = max_tokens
        self.item: dict | None = None
        self.text: list[str] = []
        self.audio_samples = 0
        self.calls: dict[int, dict] = {}  # tool call index -> {id, name, arguments}
        self.usage: dict | None = None
        self.finished = False

    def _response(self, status: str, details: dict | None = None) -> dict:
        output = [self.item] if self.item is not None else []
        output += [call["item"] for call in self.calls.values() if "item" in call]
        return {"id": self.id, "object": "realtime.response", "status": status,
                "status_details": details, "output": output,
                "output_modalities": list(self.modalities), "conversation_id": None,
                "max_output_tokens": self.max_tokens or "inf", "metadata": None,
                "audio": {"output": {"format": dict(PCM_FORMAT),
                                     "voice": self.session.config.voice}},
                "usage": self.usage}

    async def run(self) -> None:
        session = self.session
        await session.send({"type": "response.created",
                            "response": self._response("in_progress")})
        while True:
            stream = await self._chat()
            if stream is None:
                return
            if not stream.over_length() or not await session.drop_oldest_item():
                break
        await stream.end()

    async def _chat(self) -> _ChatStream | None:
        """One streamed chat completion of the conversation as it is; its stream, or
        None when the response failed before it started."""
        session = self.session
        try:
            body = self._chat_body()
            asked = parse_audio_request(body)
            await asyncio.to_thread(check_media, body, session.media_limits)
        except RequestError as exc:
            await self._fail(f"the conversation cannot be sent to the model: {exc}")
            return None
        scope = {"type": "http", "asgi": session.scope.get("asgi", {"version": "3.0"}),
                 "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": CHAT_PATH, "raw_path": CHAT_PATH.encode(), "query_string": b"",
                 "root_path": session.scope.get("root_path", ""),
                 "headers": [(b"content-type", b"application/json"),
                             *[(k, v) for k, v in session.scope.get("headers", ())
                               if k.lower() == b"authorization"]],
                 "client": session.scope.get("client"), "server": session.scope.get("server"),
                 "app": session.scope.get("app"), "state": session.scope.get("state", {})}
        stream = _ChatStream(self)
        try:
            await serve_chat(session.app, scope, _never_disconnects, stream.send, body, asked)
        except Exception as exc:  # vLLM's handler raised: the response fails, not the session
            logger.exception("realtime response %s failed", self.id)
            await self._fail(f"{type(exc).__name__}: {exc}")
            return None
        return stream

    def _chat_body(self) -> dict:
        session = self.session
        messages = [{"role": "system", "content": self.instructions}] \
            if self.instructions else []
        messages += [m for item in session.items for m in _chat_messages(item)]
        body = {"messages": messages, "stream": True,
                "stream_options": {"include_usage": True},
                "modalities": ["text", "audio"] if self.audio else ["text"]}
        if self.audio:
            body["audio"] = {"format": STREAM_FORMAT}
            if session.config.voice:
                body["audio"]["voice"] = session.config.voice
        if session.model:
            body["model"] = session.model
        if self.max_tokens:
            body["max_completion_tokens"] = self.max_tokens
        if session.config.tools:
            body["tools"] = [{"type": "function", "function": {
                k: v for k, v in tool.items() if k in ("name", "description", "parameters")}}
                for tool in session.config.tools]
            choice = session.config.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {
                "type": "function", "function": {"name": choice["name"]}}
        return body

    # -- events --------------------------------------------------------------------------
    async def started(self) -> None:
        """The assistant message item and its content part, once output begins."""
        if self.item is not None:
            return
        session = self.session
        self.item = {"id": _item_id(), "type": "message", "object": "realtime.item",
                     "status": "in_progress", "role": "assistant", "content": []}
        previous = session.items[-1]["id"] if session.items else None
        session.items.append(self.item)
        await session.send({"type": "response.output_item.added", "response_id": self.id,
                            "output_index": 0, "item": self.item})
        await session.send({"type": "conversation.item.added", "previous_item_id": previous,
                            "item": self.item})
        await session.send({"type": "response.content_part.added", **self._where(),
                            "part": self._part()})

    def _where(self) -> dict:
        return {"response_id": self.id, "item_id": self.item["id"], "output_index": 0,
                "content_index": 0}

    def _part(self) -> dict:
        text = "".join(self.text)
        return {"type": "audio", "transcript": text} if self.audio else \
            {"type": "text", "text": text}

    async def on_text(self, delta: str) -> None:
        await self.started()
        self.text.append(delta)
        kind = "response.output_audio_transcript.delta" if self.audio \
            else "response.output_text.delta"
        await self.session.send({"type": kind, **self._where(), "delta": delta})

    async def on_audio(self, data: str) -> None:
        await self.started()
        if not self.audio_samples:
            TURN_LATENCY.observe(time.monotonic() - self.turn_ended)
        self.audio_samples += len(base64.b64decode(data)) // 2
        await self.session.send({"type": "response.output_audio.delta", **self._where(),
                                 "delta": data})

    async def on_tool_call(self, call: dict) -> None:
        """Accumulate a chat chunk's ``delta.tool_calls`` entry."""
        index = int(call.get("index", 0))
        entry = self.calls.setdefault(index, {"id": None, "name": "", "arguments": ""})
        entry["id"] = call.get("id") or entry["id"]
        function = call.get("function") or {}
        entry["name"] += function.get("name") or ""
        entry["arguments"] += function.get("arguments") or ""

    async def completed(self) -> None:
        session = self.session
        if self.item is not None:
            await self._close_item("completed")
        for index, call in sorted(self.calls.items()):
            item = {"id": _item_id(), "type": "function_call", "object": "realtime.item",
                    "status": "completed", "call_id": call["id"] or f"call_{index}",
                    "name": call["name"], "arguments": call["arguments"]}
            call["item"] = item
            output_index = 1 + index if self.item is not None else index
            previous = session.items[-1]["id"] if session.items else None
            session.items.append(item)
            await session.send({"type": "response.output_item.added", "response_id": self.id,
                                "output_index": output_index, "item": item})
            await session.send({"type": "conversation.item.added",
                                "previous_item_id": previous, "item": item})
            await session.send({"type": "response.function_call_arguments.done",
                                "response_id": self.id, "item_id": item["id"],
                                "output_index": output_index, "call_id": item["call_id"],
                                "name": item["name"], "arguments": item["arguments"]})
            await session.send({"type": "response.output_item.done", "response_id": self.id,
                                "output_index": output_index, "item": item})
            await session.send({"type": "conversation.item.done",
                                "previous_item_id": previous, "item": item})
        self.finished = True
        await session.send({"type": "response.done", "response": self._response("completed")})

    async def _close_item(self, status: str) -> None:
        session = self.session
        text = "".join(self.text)
        if self.audio:
            await session.send({"type": "response.output_audio.done", **self._where()})
            await session.send({"type": "response.output_audio_transcript.done",
                                **self._where(), "transcript": text})
        else:
            await session.send({"type": "response.output_text.done", **self._where(),
                                "text": text})
        await session.send({"type": "response.content_part.done", **self._where(),
                            "part": self._part()})
        self.item["status"] = status
        self.item["content"] = [{"type": "output_audio", "transcript": text}] if self.audio \
            else [{"type": "output_text", "text": text}]
        await session.send({"type": "response.output_item.done", "response_id": self.id,
                            "output_index": 0, "item": self.item})
        await session.send({"type": "conversation.item.done", "item": self.item})

    async def cancelled(self, reason: str) -> None:
        """Report the response cancelled (``reason``: ``turn_detected``,
        ``client_cancelled`` or ``client_disconnected``)."""
        if self.finished:
            return
        self.finished = True
        RESPONSES_CANCELLED.labels(reason=reason).inc()
        if reason == "client_disconnected":
            return
        if self.item is not None:
            await self._close_item("incomplete")
            if reason == "turn_detected" and self.audio:
                await self.session._truncated(self.item, 0,
                                              self.audio_samples * 1000 // INPUT_RATE)
        await self.session.send({"type": "response.done", "response": self._response(
            "cancelled", {"type": "cancelled", "reason": reason})})

    async def _fail(self, message: str, code: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        if self.item is not None:
            await self._close_item("incomplete")
        await self.session.send({"type": "response.done", "response": self._response(
            "failed", {"type": "failed", "error": {"type": "server_error", "code": code,
                                                   "message": message}})})


class _ChatStream:
    """The ASGI ``send`` of a response's streamed chat completion: its SSE chunks
    become the response's events."""

    def __init__(self, run: _ResponseRun) -> None:
        self.run = run
        self.status = 200
        self.sse = False
        self.buffer = b""
        self.error_body = b""
        self.done = False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            kind = dict((k.lower(), v) for k, v in message.get("headers", ()))
            self.sse = self.status == 200 and kind.get(b"content-type", b"").startswith(
                b"text/event-stream")
            return
        if message["type"] != "http.response.body":
            return
        if not self.sse:
            self.error_body += message.get("body", b"")
            return
        self.buffer += message.get("body", b"")
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            await self._event(event.removeprefix(b"data: ").strip())

    async def _event(self, data: bytes) -> None:
        if data == b"[DONE]" or not data:
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if "error" in chunk:
            self.done = True
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            return await self.run._fail(str(error.get("message", chunk["error"])))
        if chunk.get("usage"):
            usage = chunk["usage"]
            self.run.usage = {"total_tokens": usage.get("total_tokens", 0),
                              "input_tokens": usage.get("prompt_tokens", 0),
                              "output_tokens": usage.get("completion_tokens", 0)}
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                await self.run.on_text(delta["content"])
            audio = delta.get("audio")
            if isinstance(audio, dict) and audio.get("data"):
                await self.run.on_audio(audio["data"])
            for call in delta.get("tool_calls") or ():
                await self.run.on_tool_call(call)

    def error_message(self) -> str:
        """The message of the handler's error answer (not an event stream)."""
        try:
            error = json.loads(self.error_body).get("error", {})
            return str(error.get("message") if isinstance(error, dict) else error)
        except (ValueError, AttributeError):
            return self.error_body.decode(errors="replace")[:500]

    def over_length(self) -> bool:
        """Whether vLLM refused the conversation as longer than the model's context
        (HTTP 400, "This model's maximum context length is ...")."""
        return not self.sse and self.status == 400 and \
            "maximum context length" in self.error_message()

    async def end(self) -> None:
        """The chat completion ended: complete the response, or fail it with the
        handler's error."""
        if self.done:
            return
        if not self.sse:
            return await self.run._fail(f"HTTP {self.status}: {self.error_message()}")
        await self.run.completed()


async def _never_disconnects():
    """The ``receive`` of a response's inner chat request after its body: the request
    ends when the response task is cancelled, never by a disconnect of its own."""
    await asyncio.Event().wait()


def _input_audio_part(audio: str, pcm: bytes) -> dict:
    """A user item's ``input_audio`` content part (``audio``: base64 of ``pcm``,
    audio/pcm at :data:`INPUT_RATE`) with, under ``chat``, the chat completion part it
    becomes in every later prompt: a WAV at :data:`MODEL_RATE`, encoded once here."""
    import soxr

    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    wav = encode_audio(soxr.resample(samples, INPUT_RATE, MODEL_RATE), MODEL_RATE, "wav")
    return {"type": "input_audio", "audio": audio, "transcript": None,
            "chat": {"type": "input_audio", "input_audio": {
                "data": base64.b64encode(wav).decode(), "format": "wav"}}}


def _chat_messages(item: dict) -> list[dict]:
    """The chat messages of one conversation item (none for an item with nothing to say)."""
    kind = item["type"]
    if kind == "function_call":
        return [{"role": "assistant", "content": None, "tool_calls": [{
            "id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}]}]
    if kind == "function_call_output":
        return [{"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}]
    role, parts = item["role"], []
    for part in item["content"]:
        if part["type"] in ("input_text", "text", "output_text"):
            parts.append({"type": "text", "text": part.get("text") or ""})
        elif part["type"] == "input_audio":
            parts.append(part["chat"])
        elif part["type"] in ("audio", "output_audio"):
            if part.get("transcript"):
                parts.append({"type": "text", "text": part["transcript"]})
    if not parts:
        return []
    if role != "user":  # system and assistant turns are text
        return [{"role": role, "content": "".join(p.get("text", "") for p in parts)}]
    return [{"role": role, "content": parts}]


# -- field checks ------------------------------------------------------------------------
def _object(parent: dict, key: str, where: str | None = None) -> dict:
    value = parent.get(key)
    if not isinstance(value, dict):
        raise RealtimeError(f"{where}.{key}" if where else key, "must be an object")
    return value


def _str(value, where: str) -> str:
    if not isinstance(value, str):
        raise RealtimeError(where, "must be a string")
    return value


def _modalities(value, where: str) -> tuple[str, ...]:
    if value not in (["audio"], ["text"]):
        raise RealtimeError(where, f"must be [\"audio\"] or [\"text\"], got {value!r}"[:200])
    return tuple(value)


def _max_tokens(value, where: str) -> int | None:
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise RealtimeError(where, "must be an integer from 1 to 4096, or \"inf\"")
    return value


def _check_format(value, where: str) -> None:
    if not isinstance(value, dict) or value.get("type") != "audio/pcm":
        kind = value.get("type") if isinstance(value, dict) else value
        raise RealtimeError(f"{where}.type", f"{str(kind)[:40]!r} is not supported; the "
                            f"audio format is audio/pcm (16-bit mono at {INPUT_RATE} Hz)")
    if value.get("rate", INPUT_RATE) != INPUT_RATE:
        raise RealtimeError(f"{where}.rate", f"audio/pcm is {INPUT_RATE} Hz here, got "
                            f"{str(value.get('rate'))[:20]}")


def _turn_detection(value, where: str) -> TurnDetection | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeError(where, "must be an object or null")
    if value.get("type", "server_vad") != "server_vad":
        raise RealtimeError(f"{where}.type", f"{str(value.get('type'))[:40]!r} is not "
                            "supported; use \"server_vad\" or null")
    defaults = VadParams()
    threshold = value.get("threshold", defaults.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not 0.0 <= threshold <= 1.0:
        raise RealtimeError(f"{where}.threshold", "must be a number from 0 to 1")
    ms = {}
    for name in ("prefix_padding_ms", "silence_duration_ms"):
        got = value.get(name, getattr(defaults, name))
        if isinstance(got, bool) or not isinstance(got, int) or not 0 <= got <= 10000:
            raise RealtimeError(f"{where}.{name}", "must be an integer from 0 to 10000")
        ms[name] = got
    flags = {}
    for name in ("create_response", "interrupt_response"):
        got = value.get(name, True)
        if not isinstance(got, bool):
            raise RealtimeError(f"{where}.{name}", "must be true or false")
        flags[name] = got
    for name in value:
        if name not in ("type", "threshold", "prefix_padding_ms", "silence_duration_ms",
                        "create_response", "interrupt_response", "idle_timeout_ms"):
            raise RealtimeError(f"{where}.{name}", "is not supported")
    return TurnDetection(VadParams(float(threshold), **ms), **flags)


def _tools(value) -> list[dict]:
    if not isinstance(value, list):
        raise RealtimeError("session.tools", "must be a list of function tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"session.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RealtimeError(f"{where}.type", "only \"function\" tools are supported")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RealtimeError(f"{where}.name", "must be a non-empty string")
        if not isinstance(tool.get("parameters", {}), dict):
            raise RealtimeError(f"{where}.parameters", "must be a JSON schema object")
        tools.append({k: tool[k] for k in ("type", "name", "description", "parameters")
                      if k in tool})
    return tools


def _tool_choice(value, where: str) -> str | dict:
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" \
            and isinstance(value.get("name"), str):
        return {"type": "function", "name": value["name"]}
    raise RealtimeError(where, "must be \"auto\", \"none\", \"required\" or "
                        "{\"type\": \"function\", \"name\": ...}")


def _conversation_item(item: dict) -> dict:
    """A ``conversation.item.create`` item, checked, with an id and status."""
    kind = item.get("type")
    out = {"id": item.get("id") or _item_id(), "object": "realtime.item",
           "status": "completed"}
    if not isinstance(out["id"], str) or len(out["id"]) > 64:
        raise RealtimeError("item.id", "must be a string of at most 64 characters")
    if kind == "function_call_output":
        for name in ("call_id", "output"):
            if not isinstance(item.get(name), str):
                raise RealtimeError(f"item.{name}", "must be a string")
        return {**out, "type": kind, "call_id": item["call_id"], "output": item["output"]}
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise RealtimeError(f"item.{name}", "must be a string")
        return {**out, "type": kind, **{k: item[k] for k in ("call_id", "name", "arguments")}}
    if kind != "message":
        raise RealtimeError("item.type", f"{str(kind)[:40]!r} is not supported; use "
                            "\"message\", \"function_call\" or \"function_call_output\"")
    role = item.get("role")
    allowed = {"user": ("input_text", "input_audio"), "system": ("input_text",),
               "assistant": ("output_text", "text", "output_audio", "audio")}
    if role not in allowed:
        raise RealtimeError("item.role", "must be \"user\", \"system\" or \"assistant\"")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise RealtimeError("item.content", "must be a non-empty list of content parts")
    parts = []
    for i, part in enumerate(content):
        where = f"item.content[{i}]"
        if not isinstance(part, dict) or part.get("type") not in allowed[role]:
            got = part.get("type") if isinstance(part, dict) else part
            raise RealtimeError(f"{where}.type", f"{str(got)[:40]!r} is not allowed in a "
                                f"{role} message; use one of {', '.join(allowed[role])}")
        if part["type"] == "input_audio":
            audio = part.get("audio")
            try:
                pcm = base64.b64decode(audio if isinstance(audio, str) else "", validate=True)
            except (binascii.Error, ValueError) as exc:
                raise RealtimeError(f"{where}.audio", f"is not valid base64: {exc}") from exc
            if not pcm or len(pcm) % 2:
                raise RealtimeError(f"{where}.audio", "must be base64 of audio/pcm, 16-bit "
                                    f"mono at {INPUT_RATE} Hz")
            parts.append(_input_audio_part(audio, pcm))
        elif part["type"] in ("output_audio", "audio"):
            parts.append({"type": "output_audio", "transcript": str(part.get("transcript")
                                                                    or "")})
        else:
            text = part.get("text")
            if not isinstance(text, str):
                raise RealtimeError(f"{where}.text", "must be a string")
            parts.append({"type": part["type"], "text": text})
    return {**out, "type": "message", "role": role, "content": parts}
