"""The Realtime API's wire protocol as this server speaks it: constants, the error a
refused client event gets, and the server events as typed models (msgspec ``Struct``s
tagged by their ``type``, encoded by :func:`encode`): the conversation items and their
content parts, the response object, and one model per server event. Each model holds
what goes on the wire and nothing else; ``plugin_tests/unit/test_realtime_protocol.py``
checks every one against the installed ``openai`` SDK's ``RealtimeServerEvent``.

Audio in and out is ``audio/pcm``: 16-bit little-endian mono at 24 kHz
(:data:`~.vad.INPUT_RATE`), OpenAI's only ``audio/pcm`` rate.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from vllm_omni_plugin.entrypoints.realtime.vad import INPUT_RATE

#: OpenAI's limit on one client event (an ``input_audio_buffer.append`` of 15 MiB).
MAX_EVENT_BYTES = 15 * 1024 * 1024
#: Input audio shorter than this cannot be committed (OpenAI's rule: 100 ms).
MIN_COMMIT_MS = 100
#: The one audio format in and out: OpenAI's ``audio/pcm`` at 24 kHz.
PCM_FORMAT = {"type": "audio/pcm", "rate": INPUT_RATE}
#: WebSocket close codes (RFC 6455 §7.4.1; 1013 is IANA's "try again later").
CLOSE_NORMAL = 1000
CLOSE_TRY_AGAIN_LATER = 1013
#: The largest ``max_output_tokens`` a session or response may ask for.
MAX_OUTPUT_TOKENS = 4096


class RealtimeError(Exception):
    """A client event the session refuses: ``code`` (OpenAI's error codes where one
    exists), ``param`` the field it names, ``message`` the reason."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def event_id() -> str:
    """A new server event id."""
    return f"event_{uuid.uuid4().hex[:20]}"


def item_id() -> str:
    """A new conversation item id."""
    return f"item_{uuid.uuid4().hex[:20]}"


def error_event(exc: RealtimeError, client_event_id: str | None = None) -> ErrorEvent:
    """The ``error`` server event for ``exc``, answering the client event
    ``client_event_id`` (None: no event, or one without an id)."""
    kind = "server_error" if exc.code == "server_error" else "invalid_request_error"
    return ErrorEvent(error=ErrorDetail(kind, exc.code, str(exc), exc.param, client_event_id))


_ENCODER = msgspec.json.Encoder()


def encode(event: Event) -> str:
    """The JSON text of one server event."""
    return _ENCODER.encode(event).decode()


# -- content parts and conversation items ------------------------------------------------
class InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    """A user's or system's text."""

    text: str


class InputAudio(msgspec.Struct, tag="input_audio", tag_field="type"):
    """A user's audio: its bytes are not sent back (the client has them)."""

    transcript: str | None = None


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    """The text of a text answer."""

    text: str


class OutputAudio(msgspec.Struct, tag="output_audio", tag_field="type"):
    """A spoken answer, as its transcript."""

    transcript: str


class Text(msgspec.Struct, tag="text", tag_field="type"):
    """The part of a text answer in ``response.content_part.*``."""

    text: str


class Audio(msgspec.Struct, tag="audio", tag_field="type"):
    """The part of a spoken answer in ``response.content_part.*``."""

    transcript: str


ContentPart = InputText | InputAudio | OutputText | OutputAudio


class MessageItem(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    """A ``message`` item: a user, system or assistant turn."""

    id: str
    role: str  # user, system, assistant
    content: list[ContentPart]
    status: str = "completed"  # in_progress, completed, incomplete
    object: str = "realtime.item"


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    """A ``function_call`` item: a tool call the model made."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    object: str = "realtime.item"


class FunctionCallOutputItem(msgspec.Struct, tag="function_call_output", tag_field="type",
                             kw_only=True):
    """A ``function_call_output`` item: the client's answer to a tool call."""

    id: str
    call_id: str
    output: str
    status: str = "completed"
    object: str = "realtime.item"


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


class Usage(msgspec.Struct):
    """A response's token counts."""

    total_tokens: int
    input_tokens: int
    output_tokens: int


class Response(msgspec.Struct, kw_only=True):
    """The ``realtime.response`` object of ``response.created`` / ``response.done``."""

    id: str
    status: str  # in_progress, completed, cancelled, failed
    output: list[Item]
    output_modalities: list[str]
    max_output_tokens: int | str  # "inf"
    audio: dict[str, Any]
    status_details: dict[str, Any] | None = None
    usage: Usage | None = None
    object: str = "realtime.response"
    conversation_id: None = None
    metadata: None = None


# -- server events -------------------------------------------------------------------------
class Event(msgspec.Struct, tag_field="type", kw_only=True):
    """A server event; its ``type`` is the subclass's tag."""

    event_id: str = msgspec.field(default_factory=event_id)


class ErrorDetail(msgspec.Struct):
    """The ``error`` object of an ``error`` event."""

    type: str  # invalid_request_error, server_error
    code: str
    message: str
    param: str | None
    event_id: str | None  # the client event refused


class ErrorEvent(Event, tag="error"):
    """``error``: a client event refused, naming its field; the session lives on."""

    error: ErrorDetail


class SessionCreated(Event, tag="session.created"):
    """``session.created``: the session object, first event of a connection."""

    session: dict[str, Any]


class SessionUpdated(Event, tag="session.updated"):
    """``session.updated``: the session object after a ``session.update``."""

    session: dict[str, Any]


class SpeechStarted(Event, tag="input_audio_buffer.speech_started"):
    """``input_audio_buffer.speech_started``: server VAD heard speech begin."""

    audio_start_ms: int
    item_id: str


class SpeechStopped(Event, tag="input_audio_buffer.speech_stopped"):
    """``input_audio_buffer.speech_stopped``: server VAD heard speech end."""

    audio_end_ms: int
    item_id: str


class InputAudioCommitted(Event, tag="input_audio_buffer.committed"):
    """``input_audio_buffer.committed``: the buffer became a user item."""

    item_id: str
    previous_item_id: str | None


class InputAudioCleared(Event, tag="input_audio_buffer.cleared"):
    """``input_audio_buffer.cleared``."""


class ItemAdded(Event, tag="conversation.item.added"):
    """``conversation.item.added``."""

    item: Item
    previous_item_id: str | None = None


class ItemDone(Event, tag="conversation.item.done"):
    """``conversation.item.done``."""

    item: Item
    previous_item_id: str | None = None


class ItemDeleted(Event, tag="conversation.item.deleted"):
    """``conversation.item.deleted``."""

    item_id: str


class ItemTruncated(Event, tag="conversation.item.truncated"):
    """``conversation.item.truncated``: an assistant's audio cut where it stopped."""

    item_id: str
    content_index: int
    audio_end_ms: int


class ResponseCreated(Event, tag="response.created"):
    """``response.created``."""

    response: Response


class ResponseDone(Event, tag="response.done"):
    """``response.done``: completed, cancelled or failed."""

    response: Response


class OutputItemAdded(Event, tag="response.output_item.added"):
    """``response.output_item.added``."""

    response_id: str
    output_index: int
    item: Item


class OutputItemDone(Event, tag="response.output_item.done"):
    """``response.output_item.done``."""

    response_id: str
    output_index: int
    item: Item


class FunctionCallArgumentsDone(Event, tag="response.function_call_arguments.done"):
    """``response.function_call_arguments.done``: a whole tool call."""

    response_id: str
    output_index: int
    item_id: str
    call_id: str
    name: str
    arguments: str


class InContent(Event, kw_only=True):
    """An event about one content part of a response's message item."""

    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0


class ContentPartAdded(InContent, tag="response.content_part.added"):
    """``response.content_part.added``."""

    part: Audio | Text


class ContentPartDone(InContent, tag="response.content_part.done"):
    """``response.content_part.done``."""

    part: Audio | Text


class AudioTranscriptDelta(InContent, tag="response.output_audio_transcript.delta"):
    """``response.output_audio_transcript.delta``."""

    delta: str


class AudioTranscriptDone(InContent, tag="response.output_audio_transcript.done"):
    """``response.output_audio_transcript.done``."""

    transcript: str


class TextDelta(InContent, tag="response.output_text.delta"):
    """``response.output_text.delta``."""

    delta: str


class TextDone(InContent, tag="response.output_text.done"):
    """``response.output_text.done``."""

    text: str


class AudioDelta(InContent, tag="response.output_audio.delta"):
    """``response.output_audio.delta``: base64 of audio/pcm."""

    delta: str


class AudioDone(InContent, tag="response.output_audio.done"):
    """``response.output_audio.done``."""
