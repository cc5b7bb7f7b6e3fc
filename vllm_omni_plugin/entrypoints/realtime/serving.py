"""The model work of a Realtime session: each response is one streamed chat completion
with audio output, run through the same handler as ``/v1/chat/completions``
(:func:`~vllm_omni_plugin.entrypoints.chat_audio.serve_chat`, vLLM's chat handler
inside), and its chunks handed to the response as deltas.
"""

from __future__ import annotations

import asyncio
import json

from vllm_omni_plugin.entrypoints.chat_audio import CHAT_PATH, parse_audio_request, serve_chat
from vllm_omni_plugin.entrypoints.media_input import MediaLimits, RequestError, check_media
from vllm_omni_plugin.entrypoints.realtime.response import ChatEnd, ResponseRun
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


class RealtimeChat:
    """Streams a session's chat completions through vLLM's handler.

    Args:
        app: the ASGI app behind the omni middleware (vLLM's routes).
        scope: the session's WebSocket scope (its client, server, app state and
            ``Authorization`` header go with each chat request).
        media_limits: the served model's, which each conversation is checked against.
    """

    def __init__(self, app, scope: dict, media_limits: MediaLimits) -> None:
        self.app = app
        self.scope = scope
        self.media_limits = media_limits

    async def stream(self, body: dict, sink: ResponseRun) -> ChatEnd:
        """Run the chat completion ``body`` (streamed, with audio when it asks) and hand
        its deltas to ``sink``; how it ended. A conversation the chat refuses (its media
        over the limits), a handler that raised, an error answer or an error event in
        the stream end it with a failure; nothing is raised."""
        try:
            asked = parse_audio_request(body)
            await asyncio.to_thread(check_media, body, self.media_limits)
        except RequestError as exc:
            return ChatEnd(f"the conversation cannot be sent to the model: {exc}")
        scope = self.scope
        chat_scope = {
            "type": "http", "asgi": scope.get("asgi", {"version": "3.0"}),
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": CHAT_PATH,
            "raw_path": CHAT_PATH.encode(), "query_string": b"",
            "root_path": scope.get("root_path", ""),
            "headers": [(b"content-type", b"application/json"),
                        *[(k, v) for k, v in scope.get("headers", ())
                          if k.lower() == b"authorization"]],
            "client": scope.get("client"), "server": scope.get("server"),
            "app": scope.get("app"), "state": scope.get("state", {})}
        stream = _ChatStream(sink)
        try:
            await serve_chat(self.app, chat_scope, _never_disconnects, stream.send, body, asked)
        except Exception as exc:  # vLLM's handler raised: the response fails, not the session
            logger.exception("realtime response %s failed", sink.id)
            return ChatEnd(f"{type(exc).__name__}: {exc}")
        return stream.end()


class _ChatStream:
    """The ASGI ``send`` of a response's streamed chat completion: its SSE chunks
    become the sink's deltas."""

    def __init__(self, sink: ResponseRun) -> None:
        self.sink = sink
        self.status = 200
        self.sse = False
        self.buffer = b""
        self.error_body = b""
        self.failure: str | None = None  # an error event in the stream

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
        if data == b"[DONE]" or not data or self.failure is not None:
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            self.failure = str(error.get("message", chunk["error"]))
            return
        if chunk.get("usage"):
            self.sink.on_usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                await self.sink.on_text(delta["content"])
            audio = delta.get("audio")
            if isinstance(audio, dict) and audio.get("data"):
                await self.sink.on_audio(audio["data"])
            for call in delta.get("tool_calls") or ():
                await self.sink.on_tool_call(call)

    def _error_message(self) -> str:
        """The message of the handler's error answer (not an event stream)."""
        try:
            error = json.loads(self.error_body).get("error", {})
            return str(error.get("message") if isinstance(error, dict) else error)
        except (ValueError, AttributeError):
            return self.error_body.decode(errors="replace")[:500]

    def end(self) -> ChatEnd:
        """How the chat completion ended: an error event, an error answer (vLLM's
        refusal of a prompt longer than the model's context, HTTP 400 "This model's
        maximum context length is ...", marked ``over_length``), or completed."""
        if self.failure is not None:
            return ChatEnd(self.failure)
        if not self.sse:
            message = self._error_message()
            return ChatEnd(f"HTTP {self.status}: {message}", over_length=(
                self.status == 400 and "maximum context length" in message))
        return ChatEnd()


async def _never_disconnects():
    """The ``receive`` of a response's inner chat request after its body: the request
    ends when the response task is cancelled, never by a disconnect of its own."""
    await asyncio.Event().wait()
