"""``entrypoints/chat_stream.py``: a chat completion with audio as typed deltas, on a
scripted chat serving standing in for vLLM's (the real one needs an engine: the realtime
tests of ``e2e/test_e2e_serve.py`` run it), with vLLM's own request model, error
answers and exceptions."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from vllm_omni_plugin.engine.omni_request import (
    AUDIO,
    TEXT,
    OmniRequest,
    StageResult,
    current_omni_request,
)
from vllm_omni_plugin.entrypoints.chat_stream import (
    AudioDelta,
    ChatFailure,
    TextDelta,
    ToolCallDelta,
    UsageDelta,
    stream_chat,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
PIECE = torch.full((480,), 0.25)
WHOLE = torch.cat([PIECE, torch.full((240,), -0.5)])


def _event(chunk) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def _text(content, finish=None, tool_calls=None) -> str:
    delta = {"content": content} if tool_calls is None else {"tool_calls": tool_calls}
    return _event({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


class _Serving:
    """vLLM's chat serving, scripted: ``script(omni)`` is the body of the answer's event
    stream (an async generator); ``raises`` is raised by ``create_chat_completion``.
    Errors become vLLM's ``ErrorResponse`` as vLLM's own serving makes them."""

    def __init__(self, script=None, raises: Exception | None = None) -> None:
        self.script, self.raises, self.requests = script, raises, []

    @staticmethod
    def create_error_response(exc):
        from vllm.entrypoints.serve.engine.serving import BaseServing

        return BaseServing.create_error_response(exc)

    async def create_chat_completion(self, request, raw_request):
        self.requests.append(request)
        if self.raises is not None:
            raise self.raises
        return self.script(current_omni_request())


def _collect(serving, modalities=(TEXT, AUDIO)) -> list:
    async def run():
        return [d async for d in stream_chat(serving, dict(BODY), OmniRequest(modalities))]
    return asyncio.run(run())


def test_text_speech_tool_calls_and_usage_arrive_as_typed_deltas():
    """The streamed piece of speech as it comes, the finish chunk's text before the rest
    of the waveform, tool call pieces and usage from vLLM's chunks; the request reaches
    the serving as vLLM's own ``ChatCompletionRequest`` in the request's scope."""
    async def script(omni):
        yield _text("Hel")
        omni.partials.put_nowait({"waveform": PIECE, "sample_rate": torch.tensor([24000])})
        await asyncio.sleep(0)
        yield _text(None, tool_calls=[{"index": 0, "id": "call_1", "function": {
            "name": "f", "arguments": "{\"a\""}}])
        omni.result = StageResult("audio", payload={"waveform": WHOLE}, sample_rate=24000)
        yield _text("lo", "stop")
        yield _event({"id": "c", "choices": [], "usage": {
            "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
        yield "data: [DONE]\n\n"

    serving = _Serving(script)
    deltas = _collect(serving)
    kinds = [type(d).__name__ for d in deltas]
    assert kinds == ["TextDelta", "AudioDelta", "ToolCallDelta", "TextDelta", "AudioDelta",
                     "UsageDelta"], kinds
    assert [d.text for d in deltas if isinstance(d, TextDelta)] == ["Hel", "lo"]
    first, last = [d for d in deltas if isinstance(d, AudioDelta)]
    assert (first.rate, first.last, last.rate, last.last) == (24000, False, 24000, True)
    assert np.array_equal(np.concatenate([first.samples, last.samples]), WHOLE.numpy())
    assert deltas[2] == ToolCallDelta(0, "call_1", "f", "{\"a\"")
    assert deltas[-1] == UsageDelta(5, 2, 7)
    assert serving.requests[0].stream is True  # vLLM's request model, validated


def test_vllms_refusal_of_an_over_long_prompt_is_a_failure_naming_input_tokens():
    """What vLLM's renderer raises for a prompt over the context (its
    ``VLLMValidationError`` on ``input_tokens``) ends the stream as vLLM's route would
    answer it: 400, the field it names, ``over_length``."""
    from vllm.exceptions import VLLMValidationError

    refusal = VLLMValidationError("This model's maximum context length is 2048 tokens.",
                                  parameter="input_tokens", value=2049)
    (failure,) = _collect(_Serving(raises=refusal))
    assert failure == ChatFailure(400, failure.message, "input_tokens") and failure.over_length
    other = _collect(_Serving(raises=VLLMValidationError("bad", parameter="temperature")))
    assert other[0].status == 400 and not other[0].over_length


def test_the_pipelines_failure_wins_over_vllms_500():
    """A stage failed (the orchestrator recorded 503 naming it): vLLM reports an error
    event of its own in the stream; the failure delta is the pipeline's."""
    async def script(omni):
        yield _text("Hel")
        omni.result = StageResult.failure("stage 1 (talker): replica 0 was lost", 503)
        yield _event({"error": {"message": "internal", "type": "InternalServerError",
                                "code": 500}})

    deltas = _collect(_Serving(script))
    assert deltas == [TextDelta("Hel"), ChatFailure(503, "stage 1 (talker): replica 0 "
                                                         "was lost")]


def test_a_text_only_chat_has_no_audio_and_a_bug_is_a_500():
    async def script(omni):
        assert omni.partials is None  # nothing to stream for a text answer
        yield _text("ok", "stop")

    assert _collect(_Serving(script), (TEXT,)) == [TextDelta("ok")]
    (failure,) = _collect(_Serving(raises=KeyError("x")))
    assert failure.status == 500 and not failure.over_length


def test_leaving_early_cancels_the_answer_in_vllm():
    cancelled = []

    async def script(omni):
        try:
            yield _text("Hel")
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def run():
        async for delta in stream_chat(_Serving(script), dict(BODY), OmniRequest((TEXT,))):
            return delta

    assert asyncio.run(run()) == TextDelta("Hel")
    assert cancelled == [True]


@pytest.mark.parametrize("body_change", [{"messages": "not a list"}, {"n": "x"}])
def test_a_body_vllm_refuses_is_a_400(body_change):
    async def run():
        body = {**BODY, **body_change}
        return [d async for d in stream_chat(_Serving(), body, OmniRequest((TEXT,)))]

    (failure,) = asyncio.run(run())
    assert failure.status == 400, failure
