"""A Realtime session's conversation: its items in order (:data:`.protocol.Item`), the
client's edits of them (insert, delete, truncate), dropping the oldest when the
conversation outgrows the model's context, and its chat form (the messages of a chat
completion).

A user's audio is kept in the chat completion part it becomes in every prompt (a WAV at
:data:`.input_audio.MODEL_RATE`, encoded once, when the item is added), beside the item: the item
itself holds only what the client is sent. The methods that change the conversation
return the server events that report the change; the caller sends them.
"""

from __future__ import annotations

import base64
import binascii

from vllm_omni_plugin.entrypoints.media_input import (
    MediaLimits,
    RequestError,
    check_clip_seconds,
    is_choice,
)
from vllm_omni_plugin.entrypoints.realtime.input_audio import chat_audio_part
from vllm_omni_plugin.entrypoints.realtime.protocol import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputAudio,
    InputText,
    Item,
    ItemAdded,
    ItemDeleted,
    ItemDone,
    ItemTruncated,
    MessageItem,
    OutputAudio,
    OutputText,
    RealtimeError,
    item_id,
)
from vllm_omni_plugin.entrypoints.realtime.vad import INPUT_RATE
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: the content part types each role's message may hold
ALLOWED_PARTS = {"user": ("input_text", "input_audio"), "system": ("input_text",),
                 "assistant": ("output_text", "text", "output_audio", "audio")}


class Conversation:
    """The items of one session's conversation, oldest first."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        #: item id -> the chat completion parts of its user audio, in content order
        self._audio: dict[str, list[dict]] = {}

    def last_id(self) -> str | None:
        """The newest item's id (None: the conversation is empty)."""
        return self.items[-1].id if self.items else None

    def find(self, wanted) -> Item | None:
        """The item ``wanted`` (an id), None when there is none."""
        return next((item for item in self.items if item.id == wanted), None)

    def append(self, item: Item) -> str | None:
        """Append ``item`` as it is (a response's output); the id of the item before it."""
        previous = self.last_id()
        self.items.append(item)
        return previous

    def add(self, item: Item, audio: list[dict] = (), previous: str | None = None,
            insert: bool = False) -> list:
        """Append ``item`` (``audio``: the chat parts of its user audio), or with ``insert``
        put it after the item ``previous`` (``None`` or ``"root"``: first); the
        ``conversation.item.added`` and ``.done`` events.

        Raises:
            RealtimeError: ``previous`` or the item's id names no item, or an existing one.
        """
        if insert and previous not in (None, "root") and self.find(previous) is None:
            raise RealtimeError("previous_item_id", f"no item {str(previous)[:60]!r} in the "
                                "conversation", code="item_not_found")
        if self.find(item.id) is not None:
            raise RealtimeError("item.id", f"item {item.id!r} exists already")
        if insert:
            at = 0 if previous in (None, "root") else self.items.index(self.find(previous)) + 1
            self.items.insert(at, item)
        else:
            previous = self.append(item)
        if audio:
            self._audio[item.id] = list(audio)
        return [ItemAdded(item=item, previous_item_id=previous),
                ItemDone(item=item, previous_item_id=previous)]

    def _remove(self, item: Item) -> ItemDeleted:
        self.items.remove(item)
        self._audio.pop(item.id, None)
        return ItemDeleted(item_id=item.id)

    def delete(self, wanted) -> ItemDeleted:
        """Delete the item ``wanted``; the ``conversation.item.deleted`` event.

        Raises:
            RealtimeError: no such item.
        """
        item = self.find(wanted)
        if item is None:
            raise RealtimeError("item_id", f"no item {str(wanted)[:60]!r} in the conversation",
                                code="item_not_found")
        return self._remove(item)

    def truncate(self, wanted, content_index, audio_end_ms) -> ItemTruncated:
        """Truncate the assistant item ``wanted``'s audio at ``audio_end_ms``; the
        ``conversation.item.truncated`` event.

        Raises:
            RealtimeError: no such assistant item, or a bad ``audio_end_ms``.
        """
        item = self.find(wanted)
        if not isinstance(item, MessageItem) or item.role != "assistant":
            raise RealtimeError("item_id", f"no assistant item {str(wanted)[:60]!r} in the "
                                "conversation", code="item_not_found")
        if not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            raise RealtimeError("audio_end_ms", "must be a non-negative integer")
        return self.truncated(item, int(content_index or 0), audio_end_ms)

    @staticmethod
    def truncated(item: MessageItem, content_index: int, audio_end_ms: int) -> ItemTruncated:
        """Mark ``item`` (an assistant message) cut at ``audio_end_ms``; the
        ``conversation.item.truncated`` event."""
        item.status = "incomplete"
        return ItemTruncated(item_id=item.id, content_index=content_index,
                             audio_end_ms=audio_end_ms)

    def drop_oldest(self, session_id: str) -> ItemDeleted | None:
        """Drop the oldest item (never the newest), logged: the conversation is longer
        than the model's context. The ``conversation.item.deleted`` event; None when only
        one item is left."""
        if len(self.items) < 2:
            return None
        item = self.items[0]
        logger.warning("realtime session %s: the conversation is longer than the model's "
                       "context; its oldest item (%s, %s) is dropped (%d left)", session_id,
                       item.id, getattr(item, "role", None) or type(item).__struct_config__.tag,
                       len(self.items) - 1)
        return self._remove(item)

    def chat_messages(self, instructions: str) -> list[dict]:
        """The conversation as chat completion messages: ``instructions`` as the system
        message, then each item's (an assistant turn as its transcript)."""
        messages = [{"role": "system", "content": instructions}] if instructions else []
        return messages + [m for item in self.items for m in self._chat_messages(item)]

    def _chat_messages(self, item: Item) -> list[dict]:
        """The chat messages of one item (none for an item with nothing to say)."""
        if isinstance(item, FunctionCallItem):
            return [{"role": "assistant", "content": None, "tool_calls": [{
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}]}]
        if isinstance(item, FunctionCallOutputItem):
            return [{"role": "tool", "tool_call_id": item.call_id, "content": item.output}]
        audio = iter(self._audio.get(item.id, ()))
        parts = []
        for part in item.content:
            if isinstance(part, (InputText, OutputText)):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, InputAudio):
                parts.append(next(audio))
            elif part.transcript:  # OutputAudio
                parts.append({"type": "text", "text": part.transcript})
        if not parts:
            return []
        if item.role != "user":  # system and assistant turns are text
            return [{"role": item.role, "content": "".join(p.get("text", "") for p in parts)}]
        return [{"role": item.role, "content": parts}]


def clip_fits(seconds: float, where: str | None, limits: MediaLimits) -> None:
    """Check a clip of user audio (``seconds`` long) as it joins the conversation, so
    that a response sends the model no audio longer than it takes without decoding the
    conversation's audio again.

    Raises:
        RealtimeError: naming ``where`` (None: the input audio buffer).
    """
    try:
        check_clip_seconds(seconds, where or "input_audio_buffer", limits)
    except RequestError as exc:
        raise RealtimeError(where, exc.message) from None


def user_audio_item(wanted: str, part: dict) -> tuple[MessageItem, list[dict]]:
    """The user message item of committed input audio, and its chat ``part``
    (:meth:`.input_audio.InputAudioBuffer.take`)."""
    return MessageItem(id=wanted, role="user", content=[InputAudio()]), [part]


def conversation_item(item: dict, limits: MediaLimits | None = None
                      ) -> tuple[Item, list[dict]]:
    """A ``conversation.item.create`` item, checked (its audio clips against the served
    model's ``limits``; None: no limit), with an id and status, and the chat parts of its
    user audio.

    Raises:
        RealtimeError: naming the item's bad field.
    """
    kind = item.get("type")
    wanted = item.get("id") or item_id()
    if not isinstance(wanted, str) or len(wanted) > 64:
        raise RealtimeError("item.id", "must be a string of at most 64 characters")
    if kind in ("function_call_output", "function_call"):
        names = ("call_id", "output") if kind == "function_call_output" else (
            "call_id", "name", "arguments")
        for name in names:
            if not isinstance(item.get(name), str):
                raise RealtimeError(f"item.{name}", "must be a string")
        model = FunctionCallOutputItem if kind == "function_call_output" else FunctionCallItem
        return model(id=wanted, **{name: item[name] for name in names}), []
    if kind != "message":
        raise RealtimeError("item.type", f"{str(kind)[:40]!r} is not supported; use "
                            "\"message\", \"function_call\" or \"function_call_output\"")
    role = item.get("role")
    if not is_choice(role, ALLOWED_PARTS):
        raise RealtimeError("item.role", "must be \"user\", \"system\" or \"assistant\"")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise RealtimeError("item.content", "must be a non-empty list of content parts")
    parts, audio = [], []
    for i, part in enumerate(content):
        checked, chat = _content_part(part, role, f"item.content[{i}]",
                                      limits or MediaLimits())
        parts.append(checked)
        if chat is not None:
            audio.append(chat)
    return MessageItem(id=wanted, role=role, content=parts), audio


def _content_part(part, role: str, where: str, limits: MediaLimits
                  ) -> tuple[ContentPart, dict | None]:
    if not isinstance(part, dict) or not is_choice(part.get("type"), ALLOWED_PARTS[role]):
        got = part.get("type") if isinstance(part, dict) else part
        raise RealtimeError(f"{where}.type", f"{str(got)[:40]!r} is not allowed in a "
                            f"{role} message; use one of {', '.join(ALLOWED_PARTS[role])}")
    kind = part["type"]
    if kind == "input_audio":
        audio = part.get("audio")
        try:
            pcm = base64.b64decode(audio if isinstance(audio, str) else "", validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RealtimeError(f"{where}.audio", f"is not valid base64: {exc}") from exc
        if not pcm or len(pcm) % 2:
            raise RealtimeError(f"{where}.audio", "must be base64 of audio/pcm, 16-bit "
                                f"mono at {INPUT_RATE} Hz")
        clip_fits(len(pcm) // 2 / INPUT_RATE, f"{where}.audio", limits)
        return InputAudio(), chat_audio_part(pcm)
    if kind in ("output_audio", "audio"):
        return OutputAudio(str(part.get("transcript") or "")), None
    text = part.get("text")
    if not isinstance(text, str):
        raise RealtimeError(f"{where}.text", "must be a string")
    # an assistant's "text" part (the Realtime API's beta name) is its output_text
    return (InputText if kind == "input_text" else OutputText)(text), None
