"""A chat completion with audio as a stream of typed deltas.

* :class:`SpokenAnswer`: the speech of one answer as the pipeline delivers it (each
  chunk of a streamed final stage, then the rest of the waveform or the failure), as
  :class:`AudioDelta` and :class:`ChatFailure`. Its two consumers: the HTTP SSE writer
  of ``/v1/chat/completions`` (:class:`~.chat_audio.AudioStream`, which writes each
  delta as a ``delta.audio`` chunk between vLLM's own events) and the Realtime response
  (through :func:`stream_chat`).
* :func:`stream_chat`: a streamed chat completion run in this process on vLLM's chat
  serving (``OpenAIServingChat.create_chat_completion``, the handler behind vLLM's
  route), as an async iterator of deltas: :class:`TextDelta`, :class:`ToolCallDelta`,
  :class:`UsageDelta` from vLLM's chunks, :class:`AudioDelta` from the pipeline, and a
  :class:`ChatFailure` that ends it. Audio is never encoded on the way: a delta holds
  the samples and their rate.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from vllm_omni_plugin.compat.internals import chat_completion_types
from vllm_omni_plugin.engine.omni_request import OmniRequest, omni_request_scope
from vllm_omni_plugin.entrypoints.audio_encoding import sample_rate_of
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: the ``param`` of vLLM's refusal of a prompt longer than the model's context: its
#: renderer counts the prompt's tokens (or, for text, bounds its characters) before the
#: request reaches the engine (``vllm/renderers/params.py``, ``VLLMValidationError``)
OVER_LENGTH_PARAMS = ("input_tokens", "input_text")


@dataclass(frozen=True)
class TextDelta:
    """A piece of the answer's text."""

    text: str


@dataclass(frozen=True)
class AudioDelta:
    """A piece of the answer's speech: ``samples`` ``[n]`` float32 in ``[-1, 1]``, mono,
    at ``rate`` Hz; ``last``: the rest of the waveform, after which no audio follows."""

    samples: np.ndarray
    rate: int
    last: bool = False


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call (OpenAI's chunk ``delta.tool_calls[i]``): its ``index`` in
    the answer, and the pieces of its ``id``, function ``name`` and ``arguments``."""

    index: int
    id: str | None
    name: str
    arguments: str


@dataclass(frozen=True)
class UsageDelta:
    """The request's token counts (OpenAI's chat ``usage``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class ChatFailure:
    """Why the chat failed: the HTTP ``status`` it answers with, the ``message``, and
    ``param``, the request field vLLM named (``input_tokens``: the prompt is longer than
    the model's context, :attr:`over_length`)."""

    status: int
    message: str
    param: str | None = None

    @property
    def over_length(self) -> bool:
        """Whether vLLM refused the prompt as longer than the model's context."""
        return self.status == 400 and self.param in OVER_LENGTH_PARAMS


ChatDelta = TextDelta | AudioDelta | ToolCallDelta | UsageDelta | ChatFailure


class SpokenAnswer:
    """The speech of one answer of ``request`` (an :class:`OmniRequest` asking for audio):
    the chunks the orchestrator puts into ``request.partials`` while the answer streams,
    then the rest of ``request.result``'s waveform (or its failure) at the end."""

    def __init__(self, request: OmniRequest) -> None:
        self.request = request
        self.samples_sent = 0
        self.done = False  # the rest (or the failure) was taken: no more audio

    def chunk(self, payload: dict) -> AudioDelta | None:
        """The delta of one chunk the orchestrator put into ``partials`` (a payload with
        ``waveform`` ``[n]`` and ``sample_rate``); None once the answer is done."""
        if self.done:
            return None
        samples = payload["waveform"]
        self.samples_sent += samples.shape[0]
        return AudioDelta(_numpy(samples), sample_rate_of(payload))

    def rest(self) -> AudioDelta | ChatFailure | None:
        """At the end of the answer: the waveform's samples not sent yet, or the
        pipeline's failure; None when the result is not there yet or was taken."""
        result = self.request.result
        if self.done or result is None:
            return None
        self.done = True
        if (failed := pipeline_failure(self.request)) is not None:
            return failed
        return AudioDelta(_numpy(result.payload["waveform"][self.samples_sent:]),
                          result.sample_rate, last=True)


def pipeline_failure(request: OmniRequest) -> ChatFailure | None:
    """The failure the orchestrator recorded for ``request`` (its status, the stage it
    names), None when it recorded none."""
    result = request.result
    if result is None or not result.error:
        return None
    return ChatFailure(result.status, result.error)


def _vllms_failure(answer) -> ChatFailure:
    """vLLM's ``ErrorResponse`` ``answer`` as a failure."""
    return ChatFailure(answer.error.code, answer.error.message, answer.error.param)


def _numpy(samples) -> np.ndarray:
    return np.asarray(samples.numpy() if hasattr(samples, "numpy") else samples,
                      dtype=np.float32)


def chunk_deltas(chunk: dict) -> list[ChatDelta]:
    """The deltas of one of vLLM's ``chat.completion.chunk`` objects (text, tool call
    pieces, usage), or of an error event in its stream."""
    if "error" in chunk:
        error = chunk["error"] if isinstance(chunk["error"], dict) else {}
        return [ChatFailure(int(error.get("code") or 500),
                            str(error.get("message", chunk["error"])), error.get("param"))]
    deltas: list[ChatDelta] = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content"):
            deltas.append(TextDelta(delta["content"]))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            deltas.append(ToolCallDelta(int(call.get("index", 0)), call.get("id"),
                                        function.get("name") or "",
                                        function.get("arguments") or ""))
    if usage := chunk.get("usage"):
        deltas.append(UsageDelta(usage.get("prompt_tokens", 0),
                                 usage.get("completion_tokens", 0),
                                 usage.get("total_tokens", 0)))
    return deltas


#: the end of a stream's deltas (on the queue between the producers and the iterator)
_END = object()


async def stream_chat(serving, body: dict, request: OmniRequest) -> AsyncIterator[ChatDelta]:
    """A streamed chat completion of ``body`` (OpenAI's request, ``stream: true``, the
    omni fields already taken out into ``request``) on vLLM's chat ``serving``, run in
    ``request``'s scope, as deltas (see the module docstring). The answer's text comes
    before its last audio. A failure (vLLM's refusal, with its status and the field it
    names; the pipeline's; an error event; what vLLM's serving raised, as vLLM's route
    would answer it: ``serving.create_error_response``) is the last delta. Leaving the
    iteration early (or cancelling the task iterating) cancels the request in vLLM and in
    every stage.
    """
    request_class, error_class = chat_completion_types()
    out: asyncio.Queue = asyncio.Queue()
    spoken = SpokenAnswer(request) if not request.text_only else None
    if spoken is not None:
        request.partials = asyncio.Queue()

    def failure(vllms: ChatFailure) -> ChatFailure:
        """The pipeline's own failure where it recorded one (vLLM reports it as a 500 of
        its own), else vLLM's."""
        return pipeline_failure(request) or vllms

    async def produce() -> None:
        try:
            try:
                chat_request = request_class.model_validate(body)
            except ValueError as exc:  # pydantic's ValidationError
                return out.put_nowait(ChatFailure(400, str(exc)))
            answer = await serving.create_chat_completion(chat_request, None)
            if isinstance(answer, error_class):
                return out.put_nowait(failure(_vllms_failure(answer)))
            async for event in answer:
                data = event.removeprefix("data: ").strip()
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                for delta in chunk_deltas(chunk):
                    if isinstance(delta, ChatFailure):
                        return out.put_nowait(failure(delta))
                    out.put_nowait(delta)
                if any(c.get("finish_reason") for c in chunk.get("choices") or ()):
                    put_rest()
            put_rest()
        except Exception as exc:  # what vLLM's route would answer for it: its refusals
            answer = serving.create_error_response(exc)  # by status and field, others 500
            if answer.error.code >= 500 and pipeline_failure(request) is None:
                logger.exception("a chat completion run in process failed")
            out.put_nowait(failure(_vllms_failure(answer)))
        finally:
            out.put_nowait(_END)

    def put_rest() -> None:
        """The answer's last audio (or the pipeline's failure), once."""
        if spoken is not None and (rest := spoken.rest()) is not None:
            out.put_nowait(rest)

    async def pump() -> None:
        while True:
            delta = spoken.chunk(await request.partials.get())
            if delta is not None:
                out.put_nowait(delta)

    with omni_request_scope(request):  # the tasks run in the request's scope
        tasks = [asyncio.ensure_future(produce())]
        if spoken is not None:
            tasks.append(asyncio.ensure_future(pump()))
    try:
        while (delta := await out.get()) is not _END:
            yield delta
            if isinstance(delta, ChatFailure):
                return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
