"""One Realtime session over one WebSocket: the client's events, the input audio buffer
with server VAD, the conversation's edits, and the responses' lifecycle.

Client events: ``session.update``, ``input_audio_buffer.append / commit / clear``,
``conversation.item.create / delete / truncate``, ``response.create``,
``response.cancel``. A refused event gets an ``error`` event naming the field
(:func:`.protocol.error_event`); the session lives on.

With server VAD, the end of the user's speech commits the input audio and starts a
response; speech that starts while a response runs cancels it (barge-in: its
``response.done`` says ``cancelled``, ``turn_detected``, and the assistant item is
truncated where its audio stopped). A cancelled response, or a client that goes away,
stops every stage's work for it at once. The input audio buffer holds at most
``--omni-realtime-max-input-audio`` seconds; with server VAD it keeps only
``prefix_padding_ms`` of audio while no speech is under way.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
import uuid

from vllm_omni_plugin.config.settings import RealtimeSettings
from vllm_omni_plugin.entrypoints.realtime import session_config
from vllm_omni_plugin.entrypoints.realtime.conversation import (
    Conversation,
    clip_fits,
    conversation_item,
    user_audio_item,
)
from vllm_omni_plugin.entrypoints.realtime.input_audio import InputAudioBuffer
from vllm_omni_plugin.entrypoints.realtime.protocol import (
    CLOSE_NORMAL,
    MAX_EVENT_BYTES,
    MIN_COMMIT_MS,
    Event,
    InputAudioCleared,
    InputAudioCommitted,
    RealtimeError,
    SessionCreated,
    SessionUpdated,
    SpeechStarted,
    SpeechStopped,
    encode,
    error_event,
    item_id,
)
from vllm_omni_plugin.entrypoints.realtime.response import ResponseRun
from vllm_omni_plugin.entrypoints.realtime.serving import RealtimeChat
from vllm_omni_plugin.entrypoints.realtime.session_config import ResponseParams, SessionConfig
from vllm_omni_plugin.entrypoints.realtime.vad import INPUT_RATE
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.processors import Voices

logger = init_logger(__name__)


class RealtimeConnection:
    """One client's session over one WebSocket (see the module docstring).

    Args:
        ws: the accepted WebSocket (Starlette's).
        chat: runs the session's chat completions.
        limits: the server's Realtime settings.
        voices: the served model's voices (None: it has none).
    """

    def __init__(self, ws, chat: RealtimeChat, limits: RealtimeSettings,
                 voices: Voices | None) -> None:
        self.ws = ws
        self.chat = chat
        self.idle_timeout = limits.idle_timeout
        self.max_input_audio = limits.max_input_audio
        self.voices = voices
        self.id = f"sess_{uuid.uuid4().hex[:20]}"
        self.model = ws.query_params.get("model")
        self.config = SessionConfig(voice=voices.default if voices else None)
        self.conversation = Conversation()
        self.audio = InputAudioBuffer()
        self.samples_in = 0  # samples of input audio appended in the session
        self.vad = None  # the turn detector over the input audio (ServerVad, SemanticVad)
        self.vad_origin_ms = 0  # the session's input audio (ms) before the detector's
        self.speech_item: str | None = None  # the item id of the speech being detected
        #: ``time.monotonic()`` of the last commit no response has answered yet
        self.turn_ended: float | None = None
        self.response: asyncio.Task | None = None
        self.response_run: ResponseRun | None = None
        self._send_lock = asyncio.Lock()

    # -- the connection ----------------------------------------------------------------
    async def run(self) -> None:
        """Serve the connection to its end: send ``session.created``, then handle each
        client event (:meth:`handle`) until the client disconnects or stays idle for
        ``idle_timeout`` seconds while no response runs (an ``error`` event, then close
        code 1000). A running response is cancelled on the way out."""
        from starlette.websockets import WebSocketDisconnect

        await self.send(SessionCreated(session=self.config.as_dict(self.id, self.model)))
        try:
            while True:
                try:
                    message = await asyncio.wait_for(self.ws.receive(), self.idle_timeout)
                except asyncio.TimeoutError:
                    if self.response is not None and not self.response.done():
                        continue  # a response runs: not idle
                    await self.send(error_event(RealtimeError(
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

    async def send(self, event: Event) -> None:
        """Send one server event; a closed socket is ignored."""
        async with self._send_lock:
            try:
                await self.ws.send_text(encode(event))
            except Exception:  # the client went away: run() sees the disconnect
                pass

    async def _send_all(self, events: list[Event]) -> None:
        for event in events:
            await self.send(event)

    async def handle(self, raw: str | bytes) -> None:
        """Handle one client event; a refused one gets an ``error`` event."""
        client_event_id = None
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
            client_event_id = event.get("event_id")
            kind = event.get("type")
            handler = self._HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise RealtimeError("type", f"unknown client event type {str(kind)[:60]!r}",
                                    code="invalid_event")
            await handler(self, event)
        except RealtimeError as exc:
            await self.send(error_event(exc, client_event_id
                                        if isinstance(client_event_id, str) else None))
        except Exception as exc:  # a bug of ours: this event fails, the session goes on
            logger.exception("realtime session %s: an event failed", self.id)
            await self.send(error_event(
                RealtimeError(None, f"{type(exc).__name__}: {exc}", code="server_error"),
                client_event_id if isinstance(client_event_id, str) else None))

    # -- session.update ----------------------------------------------------------------
    async def _session_update(self, event: dict) -> None:
        session = session_config.object_field(event, "session")
        changes: dict = {}
        for key, value in session.items():
            if key in ("type", "model", "object", "id"):
                if key == "type" and value != "realtime":
                    raise RealtimeError("session.type", f"{value!r} is not supported; this "
                                        "server runs \"realtime\" sessions")
            elif key == "instructions":
                changes["instructions"] = session_config.string(value, "session.instructions")
            elif key == "output_modalities":
                changes["output_modalities"] = session_config.modalities(
                    value, "session.output_modalities")
            elif key == "audio":
                changes.update(session_config.audio_config(
                    session_config.object_field(session, "audio", "session"), self.voices))
            elif key == "tools":
                changes["tools"] = session_config.tools(value)
            elif key == "tool_choice":
                changes["tool_choice"] = session_config.tool_choice(value, "session.tool_choice")
            elif key == "max_output_tokens":
                changes["max_output_tokens"] = session_config.max_tokens(
                    value, "session.max_output_tokens")
            elif key in ("tracing", "include", "prompt", "truncation"):
                continue  # accepted and not applied (the SDK may send them)
            else:
                raise RealtimeError(f"session.{key}", "is not supported by this server")
        for name, value in changes.items():
            setattr(self.config, name, value)
        if "turn_detection" in changes:  # a new detector with the next audio
            self.vad, self.speech_item = None, None
        await self.send(SessionUpdated(session=self.config.as_dict(self.id, self.model)))

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
            # loaded with the first audio (Silero's model: about 2 MB; smart-turn's 9 MB)
            self.vad = await asyncio.to_thread(detection.detector)
            self.vad_origin_ms = self.samples_in * 1000 // INPUT_RATE
        self.audio.append(pcm)
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
            self.audio.keep_last(keep)

    async def _speech_started(self, ms: int) -> None:
        self.speech_item = item_id()
        await self.send(SpeechStarted(audio_start_ms=ms, item_id=self.speech_item))
        detection = self.config.turn_detection
        if detection is not None and detection.interrupt_response:
            await self._cancel_response("turn_detected")

    async def _speech_stopped(self, ms: int) -> None:
        speech_item, self.speech_item = self.speech_item, None
        await self.send(SpeechStopped(audio_end_ms=ms, item_id=speech_item))
        await self._commit(speech_item)
        detection = self.config.turn_detection
        if detection is not None and detection.create_response:
            await self._start_response({})

    async def _commit_event(self, event: dict) -> None:
        await self._commit(self.speech_item or item_id())
        self.speech_item = None

    async def _commit(self, committed: str) -> None:
        ms = self.audio.ms
        if ms < MIN_COMMIT_MS:
            raise RealtimeError(None, f"the input audio buffer holds {ms} ms of audio; at "
                                f"least {MIN_COMMIT_MS} ms can be committed",
                                code="input_audio_buffer_commit_empty")
        clip_fits(ms / 1000, None, self.chat.media_limits)
        self.turn_ended = time.monotonic()
        part = self.audio.take()
        await self.send(InputAudioCommitted(item_id=committed,
                                            previous_item_id=self.conversation.last_id()))
        item, audio = user_audio_item(committed, part)
        await self._send_all(self.conversation.add(item, audio))

    async def _clear(self, event: dict) -> None:
        self.audio.clear()
        await self.send(InputAudioCleared())

    # -- conversation items --------------------------------------------------------------
    async def _item_create(self, event: dict) -> None:
        item, audio = conversation_item(session_config.object_field(event, "item"),
                                        self.chat.media_limits)
        previous = event.get("previous_item_id")
        await self._send_all(self.conversation.add(item, audio, previous,
                                                   insert=previous is not None))

    async def _item_delete(self, event: dict) -> None:
        await self.send(self.conversation.delete(event.get("item_id")))

    async def _item_truncate(self, event: dict) -> None:
        await self.send(self.conversation.truncate(
            event.get("item_id"), event.get("content_index"), event.get("audio_end_ms")))

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
        run = ResponseRun(self.send, self.conversation, self.id, self.chat.stream,
                          ResponseParams.of(self.config, overrides, self.model),
                          self.turn_ended or time.monotonic())
        self.turn_ended = None
        self.response_run = run
        self.response = asyncio.ensure_future(run.run())

    async def _cancel_response(self, reason: str) -> None:
        """Stop the running response, if any (its stages stop at once), and report it
        ``cancelled``."""
        task, run = self.response, self.response_run
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task})
        await run.cancelled(reason)

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
