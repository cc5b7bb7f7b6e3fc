"""ASGI helpers the omni API middleware's handlers share: OpenAI-shaped error bodies,
JSON answers, a captured inner response, a replayed request body, vLLM's app state."""

from __future__ import annotations

import json
import math

from vllm_omni_plugin.compat.internals import served_vllm_config
from vllm_omni_plugin.engine.omni_request import OmniRequest, StageResult, omni_request_scope

#: OpenAI's error ``type`` per HTTP status (others: ``InternalServerError``).
ERROR_TYPES = {400: "BadRequestError", 413: "RequestTooLargeError", 429: "RateLimitError",
               503: "ServiceUnavailableError"}


def error_body(message: str, code: int, param: str | None = None) -> bytes:
    """OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, as JSON."""
    kind = ERROR_TYPES.get(code, "InternalServerError")
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()


async def send_json(send, status: int, body: bytes, retry_after: float | None = None) -> None:
    """Answer with the JSON ``body``; ``Retry-After`` (whole seconds, at least 1) when
    ``retry_after`` is given."""
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(retry_after))).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_failure(send, result: StageResult) -> None:
    """Answer with a failed pipeline request's status and error."""
    await send_json(send, result.status, error_body(result.error or "", result.status),
                    result.retry_after)


def sse(chunk: dict) -> bytes:
    """One server-sent event carrying ``chunk`` as JSON."""
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def is_json(scope) -> bool:
    """Whether FastAPI would parse the body as JSON: no (or an empty) content
    type, ``application/json`` or ``application/*+json``."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-type":
            kind = value.split(b";")[0].strip().lower()
            return not kind or kind == b"application/json" or (
                kind.startswith(b"application/") and kind.endswith(b"+json"))
    return True


def replay(body: bytes, receive):
    """An ASGI ``receive`` that yields ``body`` once, then the client's own
    messages (so vLLM still sees a real disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def vllm_config(scope):
    """The served model's ``VllmConfig`` from vLLM's app state, or None
    (:func:`~vllm_omni_plugin.compat.internals.served_vllm_config`)."""
    return served_vllm_config(scope.get("app"))


def hf_config(scope):
    """The served checkpoint's HF config, or None."""
    return getattr(getattr(vllm_config(scope), "model_config", None), "hf_config", None)


class Capture:
    """An ASGI ``send`` that keeps a whole response (status, headers, body)."""

    def __init__(self):
        self.status, self.headers, self.body = 500, [], b""

    async def replay(self, send, body: bytes) -> None:
        """Send the captured status and headers with ``body``."""
        headers = [(k, v) for k, v in self.headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def send(self, message):
        """Keep one ASGI ``message`` instead of sending it: the status and headers of
        ``http.response.start``, the body of each ``http.response.body`` appended; any
        other message is dropped."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


async def answer_or_failure(app, scope, receive, send, request: OmniRequest) -> None:
    """vLLM's (``app``'s) answer, sent as it comes, run in ``request``'s scope; but when
    the pipeline recorded a failure for ``request`` by the time the answer starts (a
    whole answer starts once generated), or when ``app`` raises before it starts, the
    failure's own status and error are sent instead (vLLM would make any of them a 500).

    Raises:
        Exception: what ``app`` raised, when no failure was recorded or the answer had
            started.
    """
    started = dropped = False

    async def gated(message):
        nonlocal started, dropped
        if message["type"] == "http.response.start":
            started = True
            if request.result is not None and request.result.error:
                dropped = True
                return await send_failure(send, request.result)
        elif dropped and message["type"] == "http.response.body":
            return
        await send(message)

    with omni_request_scope(request):
        try:
            await app(scope, receive, gated)
        except Exception:
            if started or request.result is None or not request.result.error:
                raise
            await send_failure(send, request.result)


async def sent_failure(send, answer: Capture, request: OmniRequest) -> bool:
    """Answer with the failure the pipeline recorded for ``request``, or else with vLLM's
    own answer when it is not a success (HTTP status other than 200), ``answer`` being
    :func:`captured`'s; returns whether one was sent (False: carry on)."""
    if request.result is not None and request.result.error:
        await send_failure(send, request.result)
        return True
    if answer.status != 200:
        await answer.replay(send, answer.body)  # vLLM's own error
        return True
    return False


async def captured(app, scope, receive, body: bytes, request: OmniRequest) -> Capture:
    """vLLM's (``app``'s) whole answer to ``body`` at ``scope``, run in ``request``'s
    scope."""
    capture = Capture()
    with omni_request_scope(request):
        try:
            await app(scope, replay(body, receive), capture.send)
        except Exception:
            # a failure the orchestrator recorded (and logged) answers with its own
            # status (vLLM's handler for exceptions would make every one a 500)
            if request.result is None or not request.result.error:
                raise
    return capture
