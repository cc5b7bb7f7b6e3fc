"""What one API request asks of the pipeline beyond vLLM's own fields, and what it got.

The API layer (:mod:`vllm_omni_plugin.entrypoints.middleware`) validates the
client's ``modalities`` and ``audio`` fields, builds an :class:`OmniRequest` and
runs vLLM's handler inside :func:`omni_request_scope`; the orchestrator, called
by vLLM's handler in the same task (or a task created from it), finds it with
:func:`current_omni_request` and puts the pipeline's result there. Clients
cannot write into it: it never travels in a request body or in
``SamplingParams.extra_args``, and it lives exactly as long as its HTTP request.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

#: Output modalities the pipeline accepts (OpenAI chat ``modalities``).
TEXT = "text"
AUDIO = "audio"
IMAGE = "image"


@dataclass
class StageResult:
    """What the final downstream stage produced for one request, or why it failed.

    Attributes:
        output_type: the stage's ``final_output_type`` (``"audio"``, ...), or
            ``"error"``.
        payload: output tensors (for audio: ``waveform`` ``[samples]`` float32).
        sample_rate: Hz, for audio.
        stage_outputs: every downstream stage's output for this request, by stage id
            (an ``UpstreamOutput``: prompt and output token ids, payload; e.g. the
            talker's codec codes).
        error: the message for the client when the request failed.
        status: HTTP status for the client when ``error`` is set.
        retry_after: seconds the client should wait before retrying (HTTP
            ``Retry-After``), for 429 and 503 answers.
    """

    output_type: str
    payload: dict[str, Any] = field(default_factory=dict)
    sample_rate: int | None = None
    stage_outputs: dict[int, Any] = field(default_factory=dict)
    error: str | None = None
    status: int = 200
    retry_after: float | None = None

    @classmethod
    def failure(cls, message: str, status: int,
                retry_after: float | None = None) -> StageResult:
        """A failed request's result (``output_type`` ``"error"``).

        Args:
            message: The error message for the client.
            status: The HTTP status for the client.
            retry_after: Seconds the client should wait before retrying (``Retry-After``),
                None for none.
        """
        return cls(output_type="error", error=message, status=status, retry_after=retry_after)


@dataclass
class OmniRequest:
    """One API request's pipeline options and outcome.

    Attributes:
        modalities: output modalities, ``("text",)``, ``("text", "audio")`` or
            ``("image",)``.
        voice: talker speaker name, None for the checkpoint's default.
        options: more per-request data for the stage input processors, their
            ``StageRequest.options`` (an image request's ``{"image": ...}``, what the
            model's ``omni_plan_image`` planned).
        companions: prompts (text) the entry stage also runs for this request, by name,
            after the request itself and on the same engine, publishing their rows like
            it (one output token each); their outputs reach the stage input processors
            as ``StageRequest.companions[name]`` (e.g. a CFG branch's context).
        result: set by the orchestrator: the pipeline's output, or a failure
            (also set for a text-only request whose stage failed).
        partials: set by the API layer for a request it streams to the client: the
            orchestrator puts each chunk of a streamed final stage's output here as it
            is ready (a payload ``{name: tensor}``, rows on dim 0; the chunks' rows in
            order are those of ``result.payload``). None: not streamed.
    """

    modalities: tuple[str, ...] = (TEXT,)
    voice: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    companions: dict[str, str] = field(default_factory=dict)
    result: StageResult | None = None
    partials: asyncio.Queue | None = None

    @property
    def text_only(self) -> bool:
        """Whether the request asks for text alone (``modalities`` is ``("text",)``)."""
        return tuple(self.modalities) == (TEXT,)


_CURRENT: contextvars.ContextVar[OmniRequest | None] = contextvars.ContextVar(
    "vllm_omni_plugin_request", default=None)


@contextmanager
def omni_request_scope(request: OmniRequest) -> Iterator[OmniRequest]:
    """Make ``request`` the current one for the code run inside the ``with`` block."""
    token = _CURRENT.set(request)
    try:
        yield request
    finally:
        _CURRENT.reset(token)


def current_omni_request() -> OmniRequest | None:
    """The request of the enclosing :func:`omni_request_scope`, else None."""
    return _CURRENT.get()
