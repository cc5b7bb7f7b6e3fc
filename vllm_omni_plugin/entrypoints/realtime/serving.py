"""The model work of a Realtime session: each response is one streamed chat completion
with audio output, run in this process on vLLM's chat serving
(:func:`~vllm_omni_plugin.entrypoints.chat_stream.stream_chat`: the handler behind
``/v1/chat/completions``, the omni pipeline behind it), its typed deltas handed to the
response.
"""

from __future__ import annotations

from contextlib import aclosing

from vllm_omni_plugin.compat.internals import chat_serving
from vllm_omni_plugin.engine.omni_request import OmniRequest
from vllm_omni_plugin.entrypoints.chat_audio import parse_audio_request
from vllm_omni_plugin.entrypoints.chat_stream import (
    AudioDelta,
    ChatFailure,
    TextDelta,
    ToolCallDelta,
    UsageDelta,
    stream_chat,
)
from vllm_omni_plugin.entrypoints.media_input import MediaLimits, RequestError, check_media
from vllm_omni_plugin.entrypoints.realtime.response import ChatEnd, ResponseRun
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


class RealtimeChat:
    """Streams a session's chat completions on vLLM's chat serving.

    Args:
        app: vLLM's API server app (its state holds the chat serving).
        media_limits: the served model's, which each conversation is checked against.
    """

    def __init__(self, app, media_limits: MediaLimits) -> None:
        self.serving = chat_serving(app)
        self.media_limits = media_limits

    async def stream(self, body: dict, sink: ResponseRun) -> ChatEnd:
        """Run the chat completion ``body`` (streamed, with audio when it asks) and hand
        its deltas to ``sink``; how it ended. A conversation the chat refuses (more
        media items than the model takes, vLLM's own refusal), the pipeline's failure,
        or an error of ours end it with a failure; nothing is raised. The conversation's
        audio is not decoded again: the session made each clip and checked its length as
        it joined the conversation (:func:`.conversation.clip_fits`)."""
        try:
            asked = parse_audio_request(body)
            check_media(body, self.media_limits, decode=False)
        except RequestError as exc:
            return ChatEnd(f"the conversation cannot be sent to the model: {exc}")
        if self.serving is None:
            return ChatEnd("the served model has no chat completions")
        request = OmniRequest(modalities=asked.modalities, voice=asked.voice)
        try:
            async with aclosing(stream_chat(self.serving, body, request)) as deltas:
                async for delta in deltas:
                    await self._hand(delta, sink)
                    if isinstance(delta, ChatFailure):
                        return ChatEnd(f"HTTP {delta.status}: {delta.message}",
                                       over_length=delta.over_length)
        except Exception as exc:  # a bug of ours: the response fails, not the session
            logger.exception("realtime response %s failed", sink.id)
            return ChatEnd(f"{type(exc).__name__}: {exc}")
        return ChatEnd()

    @staticmethod
    async def _hand(delta, sink: ResponseRun) -> None:
        """Hand one delta of the chat to the response."""
        if isinstance(delta, TextDelta):
            await sink.on_text(delta.text)
        elif isinstance(delta, AudioDelta):
            await sink.on_audio(delta.samples, delta.rate)
        elif isinstance(delta, ToolCallDelta):
            sink.on_tool_call(delta)
        elif isinstance(delta, UsageDelta):
            sink.on_usage(delta)
