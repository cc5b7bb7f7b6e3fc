"""One Realtime response: a streamed chat completion of the conversation, its deltas
turned into Realtime server events.

A :class:`ResponseRun` is handed what it needs (the conversation, a ``send`` for its
events, a ``chat`` that streams one chat completion into it, its parameters) and
imports no connection. It is the ``sink`` of :meth:`.serving.RealtimeChat.stream`: the
chat's typed deltas (:mod:`~vllm_omni_plugin.entrypoints.chat_stream`) arrive as its
text (:meth:`ResponseRun.on_text`), speech samples (:meth:`ResponseRun.on_audio`, encoded
once, here), tool call pieces (:meth:`ResponseRun.on_tool_call`) and token counts
(:meth:`ResponseRun.on_usage`).

Events, in OpenAI's order: ``response.created``; with the first output the assistant
item (``response.output_item.added``, ``conversation.item.added``,
``response.content_part.added``); the deltas (``response.output_audio_transcript.delta``
and ``response.output_audio.delta``, or ``response.output_text.delta``); then the item
closed (``...done`` events) and each tool call as a ``function_call`` item; last
``response.done`` with status ``completed``, ``cancelled`` or ``failed``.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from vllm_omni_plugin.entrypoints.audio_encoding import STREAM_FORMAT, encode_audio
from vllm_omni_plugin.entrypoints.chat_stream import ToolCallDelta, UsageDelta
from vllm_omni_plugin.entrypoints.realtime.conversation import Conversation
from vllm_omni_plugin.entrypoints.realtime.metrics import RESPONSES_CANCELLED, TURN_LATENCY
from vllm_omni_plugin.entrypoints.realtime.protocol import (
    PCM_FORMAT,
    Audio,
    AudioDelta,
    AudioDone,
    AudioTranscriptDelta,
    AudioTranscriptDone,
    ContentPartAdded,
    ContentPartDone,
    Event,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    ItemAdded,
    ItemDone,
    MessageItem,
    OutputAudio,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    Response,
    ResponseCreated,
    ResponseDone,
    Text,
    TextDelta,
    TextDone,
    Usage,
    item_id,
)
from vllm_omni_plugin.entrypoints.realtime.session_config import ResponseParams
from vllm_omni_plugin.entrypoints.realtime.vad import INPUT_RATE


@dataclass(frozen=True)
class ChatEnd:
    """How a response's chat completion ended: ``failure`` None when it completed, else
    the message the response fails with; ``over_length`` when vLLM refused the prompt as
    longer than the model's context (then ``failure`` is that refusal)."""

    failure: str | None = None
    over_length: bool = False


#: ``chat(body, sink)``: stream one chat completion of ``body`` into ``sink`` (a
#: :class:`ResponseRun`), returning how it ended (:meth:`.serving.RealtimeChat.stream`)
Chat = Callable[[dict, "ResponseRun"], Awaitable[ChatEnd]]
#: ``send(event)``: send one server event
Send = Callable[[Event], Awaitable[None]]


class ResponseRun:
    """One response (see the module docstring).

    Args:
        send: sends a server event.
        conversation: the session's conversation; the response's items join it.
        session_id: for the log of dropped items.
        chat: streams one chat completion into the run.
        params: the response's parameters.
        turn_ended: ``time.monotonic()`` at the end of the turn it answers (its commit,
            else its ``response.create``): the start of its turn latency.
    """

    def __init__(self, send: Send, conversation: Conversation, session_id: str, chat: Chat,
                 params: ResponseParams, turn_ended: float) -> None:
        self.send = send
        self.conversation = conversation
        self.session_id = session_id
        self.chat = chat
        self.params = params
        self.turn_ended = turn_ended
        self.id = f"resp_{uuid.uuid4().hex[:20]}"
        self.audio = "audio" in params.modalities
        self.item: MessageItem | None = None
        self.text: list[str] = []
        self.audio_samples = 0
        self.calls: dict[int, dict] = {}  # tool call index -> {id, name, arguments}
        self.call_items: list[FunctionCallItem] = []
        self.usage: Usage | None = None
        self.finished = False

    def _response(self, status: str, details: dict | None = None) -> Response:
        output = [self.item] if self.item is not None else []
        return Response(id=self.id, status=status, status_details=details,
                        output=[*output, *self.call_items],
                        output_modalities=list(self.params.modalities),
                        max_output_tokens=self.params.max_tokens or "inf",
                        audio={"output": {"format": dict(PCM_FORMAT),
                                          "voice": self.params.voice}},
                        usage=self.usage)

    async def run(self) -> None:
        """Answer the conversation as it is. A conversation longer than the model's
        context loses its oldest items (:meth:`.Conversation.drop_oldest`) until it fits
        or one item is left."""
        await self.send(ResponseCreated(response=self._response("in_progress")))
        while True:
            end = await self.chat(self.chat_body(), self)
            if not end.over_length:
                break
            dropped = self.conversation.drop_oldest(self.session_id)
            if dropped is None:
                break
            await self.send(dropped)
        if end.failure is not None:
            await self._fail(end.failure)
        else:
            await self.completed()

    def chat_body(self) -> dict:
        """The streamed chat completion request of the conversation as it is."""
        params = self.params
        body = {"messages": self.conversation.chat_messages(params.instructions),
                "stream": True, "stream_options": {"include_usage": True},
                "modalities": ["text", "audio"] if self.audio else ["text"]}
        if self.audio:
            body["audio"] = {"format": STREAM_FORMAT}
            if params.voice:
                body["audio"]["voice"] = params.voice
        if params.model:
            body["model"] = params.model
        if params.max_tokens:
            body["max_completion_tokens"] = params.max_tokens
        if params.tools:
            body["tools"] = [{"type": "function", "function": {
                k: v for k, v in tool.items() if k in ("name", "description", "parameters")}}
                for tool in params.tools]
            choice = params.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {
                "type": "function", "function": {"name": choice["name"]}}
        return body

    # -- the chat's deltas ---------------------------------------------------------------
    async def _started(self) -> None:
        """The assistant message item and its content part, once output begins."""
        if self.item is not None:
            return
        self.item = MessageItem(id=item_id(), role="assistant", content=[],
                                status="in_progress")
        previous = self.conversation.append(self.item)
        await self.send(OutputItemAdded(response_id=self.id, output_index=0, item=self.item))
        await self.send(ItemAdded(item=self.item, previous_item_id=previous))
        await self.send(ContentPartAdded(**self._where(), part=self._part()))

    def _where(self) -> dict:
        return {"response_id": self.id, "item_id": self.item.id}

    def _part(self) -> Audio | Text:
        text = "".join(self.text)
        return Audio(text) if self.audio else Text(text)

    async def on_text(self, delta: str) -> None:
        """A piece of the answer's text (its transcript, when it speaks)."""
        await self._started()
        self.text.append(delta)
        kind = AudioTranscriptDelta if self.audio else TextDelta
        await self.send(kind(**self._where(), delta=delta))

    async def on_audio(self, samples: np.ndarray, rate: int) -> None:
        """A piece of speech: ``samples`` ``[n]`` float32 at ``rate`` Hz (the pipeline's,
        24 kHz for Qwen3-Omni: passed through as audio/pcm, not resampled), sent as one
        ``response.output_audio.delta`` of base64 pcm16, encoded here once."""
        if not len(samples):
            return
        await self._started()
        if not self.audio_samples:
            TURN_LATENCY.observe(time.monotonic() - self.turn_ended)
        self.audio_samples += len(samples)
        data = base64.b64encode(encode_audio(samples, rate, STREAM_FORMAT)).decode("ascii")
        await self.send(AudioDelta(**self._where(), delta=data))

    def on_tool_call(self, piece: ToolCallDelta) -> None:
        """Accumulate a piece of a tool call."""
        entry = self.calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
        entry["id"] = piece.id or entry["id"]
        entry["name"] += piece.name
        entry["arguments"] += piece.arguments

    def on_usage(self, usage: UsageDelta) -> None:
        """The chat's token counts."""
        self.usage = Usage(total_tokens=usage.total_tokens, input_tokens=usage.prompt_tokens,
                           output_tokens=usage.completion_tokens)

    # -- the end -------------------------------------------------------------------------
    async def completed(self) -> None:
        """The chat completed: close the item, add each tool call's item, and send
        ``response.done``."""
        if self.item is not None:
            await self._close_item("completed")
        for index, call in sorted(self.calls.items()):
            item = FunctionCallItem(id=item_id(), call_id=call["id"] or f"call_{index}",
                                    name=call["name"], arguments=call["arguments"])
            self.call_items.append(item)
            output_index = 1 + index if self.item is not None else index
            previous = self.conversation.append(item)
            where = {"response_id": self.id, "output_index": output_index}
            await self.send(OutputItemAdded(**where, item=item))
            await self.send(ItemAdded(item=item, previous_item_id=previous))
            await self.send(FunctionCallArgumentsDone(
                **where, item_id=item.id, call_id=item.call_id, name=item.name,
                arguments=item.arguments))
            await self.send(OutputItemDone(**where, item=item))
            await self.send(ItemDone(item=item, previous_item_id=previous))
        self.finished = True
        await self.send(ResponseDone(response=self._response("completed")))

    async def _close_item(self, status: str) -> None:
        text = "".join(self.text)
        if self.audio:
            await self.send(AudioDone(**self._where()))
            await self.send(AudioTranscriptDone(**self._where(), transcript=text))
        else:
            await self.send(TextDone(**self._where(), text=text))
        await self.send(ContentPartDone(**self._where(), part=self._part()))
        self.item.status = status
        self.item.content = [OutputAudio(text) if self.audio else OutputText(text)]
        await self.send(OutputItemDone(response_id=self.id, output_index=0, item=self.item))
        await self.send(ItemDone(item=self.item))

    async def cancelled(self, reason: str) -> None:
        """Report the response cancelled (``reason``: ``turn_detected``,
        ``client_cancelled`` or ``client_disconnected``); on a barge-in
        (``turn_detected``) the assistant item is truncated where its audio stopped."""
        if self.finished:
            return
        self.finished = True
        RESPONSES_CANCELLED.labels(reason=reason).inc()
        if reason == "client_disconnected":
            return
        if self.item is not None:
            await self._close_item("incomplete")
            if reason == "turn_detected" and self.audio:
                await self.send(Conversation.truncated(
                    self.item, 0, self.audio_samples * 1000 // INPUT_RATE))
        await self.send(ResponseDone(response=self._response(
            "cancelled", {"type": "cancelled", "reason": reason})))

    async def _fail(self, message: str) -> None:
        if self.finished:
            return
        self.finished = True
        if self.item is not None:
            await self._close_item("incomplete")
        await self.send(ResponseDone(response=self._response(
            "failed", {"type": "failed", "error": {"type": "server_error", "code": None,
                                                   "message": message}})))
