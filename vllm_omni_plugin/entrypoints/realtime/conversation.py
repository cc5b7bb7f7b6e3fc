"""A Realtime session's conversation: its items in order, the client's edits of them
(insert, delete, truncate), dropping the oldest when the conversation outgrows the
model's context, and its chat form (the messages of a chat completion).

Items are OpenAI's ``realtime.item`` objects (``message``, ``function_call``,
``function_call_output``). A user's audio part also carries, under ``chat``, the chat
completion part it becomes in every prompt (a WAV at :data:`MODEL_RATE`, encoded once,
when the item is added); :meth:`Conversation.shown` leaves that and the audio bytes out
of what the client is sent. The methods that change the conversation return the server
events that report the change; the caller sends them.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from vllm_omni_plugin.entrypoints.audio_encoding import encode_audio
from vllm_omni_plugin.entrypoints.realtime.protocol import RealtimeError, item_id
from vllm_omni_plugin.entrypoints.realtime.vad import INPUT_RATE
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: The rate (Hz) the user's audio goes to the model at: Whisper's, which Whisper-style
#: audio encoders such as Qwen3-Omni's take. Resampled here (soxr), so that vLLM's
#: processor has nothing to resample (its default resampler needs torchaudio).
MODEL_RATE = 16000

#: the content part types each role's message may hold
ALLOWED_PARTS = {"user": ("input_text", "input_audio"), "system": ("input_text",),
                 "assistant": ("output_text", "text", "output_audio", "audio")}


class Conversation:
    """The items of one session's conversation, oldest first."""

    def __init__(self) -> None:
        self.items: list[dict] = []

    def last_id(self) -> str | None:
        """The newest item's id (None: the conversation is empty)."""
        return self.items[-1]["id"] if self.items else None

    def find(self, wanted: str | None) -> dict | None:
        """The item ``wanted`` (an id), None when there is none."""
        return next((item for item in self.items if item["id"] == wanted), None)

    def append(self, item: dict) -> str | None:
        """Append ``item`` as it is (a response's output); the id of the item before it."""
        previous = self.last_id()
        self.items.append(item)
        return previous

    def add(self, item: dict, previous: str | None = None, insert: bool = False) -> list[dict]:
        """Append ``item``, or with ``insert`` put it after the item ``previous`` (``None``
        or ``"root"``: first); the ``conversation.item.added`` and ``.done`` events.

        Raises:
            RealtimeError: ``previous`` or the item's id names no item, or an existing one.
        """
        if insert and previous not in (None, "root") and self.find(previous) is None:
            raise RealtimeError("previous_item_id", f"no item {str(previous)[:60]!r} in the "
                                "conversation", code="item_not_found")
        if self.find(item["id"]) is not None:
            raise RealtimeError("item.id", f"item {item['id']!r} exists already")
        if insert:
            at = 0 if previous in (None, "root") else self.items.index(self.find(previous)) + 1
            self.items.insert(at, item)
        else:
            previous = self.append(item)
        shown = self.shown(item)
        return [{"type": kind, "previous_item_id": previous, "item": shown}
                for kind in ("conversation.item.added", "conversation.item.done")]

    @staticmethod
    def shown(item: dict) -> dict:
        """``item`` as OpenAI reports it: audio content without its bytes (the client has
        them; a 4 s turn is about 250 kB of base64 an event), nor their chat part."""
        if "content" not in item:
            return item
        return {**item, "content": [{k: v for k, v in part.items() if k not in ("audio", "chat")}
                                    for part in item["content"]]}

    def delete(self, wanted) -> dict:
        """Delete the item ``wanted``; the ``conversation.item.deleted`` event.

        Raises:
            RealtimeError: no such item.
        """
        item = self.find(wanted)
        if item is None:
            raise RealtimeError("item_id", f"no item {str(wanted)[:60]!r} in the conversation",
                                code="item_not_found")
        self.items.remove(item)
        return {"type": "conversation.item.deleted", "item_id": wanted}

    def truncate(self, wanted, content_index, audio_end_ms) -> dict:
        """Truncate the assistant item ``wanted``'s audio at ``audio_end_ms``; the
        ``conversation.item.truncated`` event.

        Raises:
            RealtimeError: no such assistant item, or a bad ``audio_end_ms``.
        """
        item = self.find(wanted)
        if item is None or item.get("role") != "assistant":
            raise RealtimeError("item_id", f"no assistant item {str(wanted)[:60]!r} in the "
                                "conversation", code="item_not_found")
        if not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            raise RealtimeError("audio_end_ms", "must be a non-negative integer")
        return self.truncated(item, int(content_index or 0), audio_end_ms)

    @staticmethod
    def truncated(item: dict, content_index: int, audio_end_ms: int) -> dict:
        """Mark ``item`` (an assistant message) cut at ``audio_end_ms``; the
        ``conversation.item.truncated`` event."""
        item["status"] = "incomplete"
        return {"type": "conversation.item.truncated", "item_id": item["id"],
                "content_index": content_index, "audio_end_ms": audio_end_ms}

    def drop_oldest(self, session_id: str) -> dict | None:
        """Drop the oldest item (never the newest), logged: the conversation is longer
        than the model's context. The ``conversation.item.deleted`` event; None when only
        one item is left."""
        if len(self.items) < 2:
            return None
        item = self.items.pop(0)
        logger.warning("realtime session %s: the conversation is longer than the model's "
                       "context; its oldest item (%s, %s) is dropped (%d left)", session_id,
                       item["id"], item.get("role", item["type"]), len(self.items))
        return {"type": "conversation.item.deleted", "item_id": item["id"]}

    def chat_messages(self, instructions: str) -> list[dict]:
        """The conversation as chat completion messages: ``instructions`` as the system
        message, then each item's (an assistant turn as its transcript)."""
        messages = [{"role": "system", "content": instructions}] if instructions else []
        return messages + [m for item in self.items for m in _chat_messages(item)]


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


def input_audio_part(audio: str, pcm: bytes) -> dict:
    """A user item's ``input_audio`` content part (``audio``: base64 of ``pcm``,
    audio/pcm at :data:`INPUT_RATE`) with, under ``chat``, the chat completion part it
    becomes in every later prompt: a WAV at :data:`MODEL_RATE`, encoded once here."""
    import soxr

    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    wav = encode_audio(soxr.resample(samples, INPUT_RATE, MODEL_RATE), MODEL_RATE, "wav")
    return {"type": "input_audio", "audio": audio, "transcript": None,
            "chat": {"type": "input_audio", "input_audio": {
                "data": base64.b64encode(wav).decode(), "format": "wav"}}}


def user_audio_item(wanted: str, pcm: bytes) -> dict:
    """The user message item of committed input audio ``pcm`` (audio/pcm)."""
    return {"id": wanted, "type": "message", "object": "realtime.item", "status": "completed",
            "role": "user",
            "content": [input_audio_part(base64.b64encode(pcm).decode(), pcm)]}


def conversation_item(item: dict) -> dict:
    """A ``conversation.item.create`` item, checked, with an id and status.

    Raises:
        RealtimeError: naming the item's bad field.
    """
    kind = item.get("type")
    out = {"id": item.get("id") or item_id(), "object": "realtime.item",
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
    if role not in ALLOWED_PARTS:
        raise RealtimeError("item.role", "must be \"user\", \"system\" or \"assistant\"")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise RealtimeError("item.content", "must be a non-empty list of content parts")
    return {**out, "type": "message", "role": role,
            "content": [_content_part(part, role, f"item.content[{i}]")
                        for i, part in enumerate(content)]}


def _content_part(part, role: str, where: str) -> dict:
    if not isinstance(part, dict) or part.get("type") not in ALLOWED_PARTS[role]:
        got = part.get("type") if isinstance(part, dict) else part
        raise RealtimeError(f"{where}.type", f"{str(got)[:40]!r} is not allowed in a "
                            f"{role} message; use one of {', '.join(ALLOWED_PARTS[role])}")
    if part["type"] == "input_audio":
        audio = part.get("audio")
        try:
            pcm = base64.b64decode(audio if isinstance(audio, str) else "", validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RealtimeError(f"{where}.audio", f"is not valid base64: {exc}") from exc
        if not pcm or len(pcm) % 2:
            raise RealtimeError(f"{where}.audio", "must be base64 of audio/pcm, 16-bit "
                                f"mono at {INPUT_RATE} Hz")
        return input_audio_part(audio, pcm)
    if part["type"] in ("output_audio", "audio"):
        return {"type": "output_audio", "transcript": str(part.get("transcript") or "")}
    text = part.get("text")
    if not isinstance(text, str):
        raise RealtimeError(f"{where}.text", "must be a string")
    return {"type": part["type"], "text": text}
