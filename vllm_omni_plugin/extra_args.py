"""The plugin's namespace in ``SamplingParams.extra_args``: its only internal channel
from the orchestrator to the stage workers.

``extra_args`` is an upstream vLLM field that travels with a request to the
engine and its worker, so the plugin passes the payload-store keys of a request
through it instead of patching vLLM's request classes. The OpenAI server also
fills it from a request's ``vllm_xargs``, so the namespace is closed at three
places: the API layer refuses client keys starting with :data:`RESERVED_PREFIX`
(HTTP 400), the orchestrator drops any such key before a request reaches an
engine (:func:`without_reserved`), and the worker validates what it reads
(:func:`payload_keys`), failing that one request on a bad value.

What the client asked for beyond vLLM's fields (modalities, voice) never goes
through ``extra_args``: see :mod:`vllm_omni_plugin.engine.omni_request`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_omni_plugin.payload_store import is_payload_key

#: Every key of the plugin in ``extra_args`` (and so in a client's ``vllm_xargs``).
RESERVED_PREFIX = "omni_plugin_"
#: ``{"in": key, "out": key, "err": key, "prefilled": true, "input_grows": true}``
#: payload-store keys of one stage request (orchestrator -> worker), each optional;
#: ``prefilled``: the prompt's KV cache comes from a prefill stage, which published the
#: prompt's rows; ``input_grows``: the orchestrator appends rows to the input payload
#: while the request runs (a resumable request fed in chunks).
PAYLOAD = "omni_plugin_payload"

_SLOTS = ("in", "out", "err")
_PREFILLED = "prefilled"
_INPUT_GROWS = "input_grows"
_FLAGS = (_PREFILLED, _INPUT_GROWS)


def _is_reserved(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(RESERVED_PREFIX)


def reserved_keys(extra: Any) -> list[str]:
    """The keys of ``extra`` (a mapping, or anything else) in the plugin's namespace."""
    if not isinstance(extra, dict):
        return []
    return sorted(k for k in extra if _is_reserved(k))


def without_reserved(extra: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``extra`` without the plugin's keys (``{}`` for None)."""
    return {k: v for k, v in (extra or {}).items() if not _is_reserved(k)}


def attach_payload(params, extra: dict[str, Any], keys: dict[str, Any]) -> None:
    """Give ``params`` (a vLLM ``SamplingParams``) the extra args ``extra`` and the payload
    keys ``keys`` (``extra_args[PAYLOAD]``, as :func:`payload_keys` reads them).

    A request with an ``in`` or ``out`` key reads no prefix cache: its rows map one to one
    to the positions it feeds, so it must compute every position. vLLM's own
    ``SamplingParams.skip_reading_prefix_cache`` (what a request with ``prompt_logprobs``
    sets) does that, and the request's blocks still enter the cache for the requests
    after it; the stage's other requests (text only) read the cache as plain vLLM's do.
    """
    params.extra_args = {**extra, PAYLOAD: keys}
    if "in" in keys or "out" in keys:
        params.skip_reading_prefix_cache = True


@dataclass(frozen=True)
class PayloadKeys:
    """Payload-store keys of one request at one stage.

    Attributes:
        input: key of the input tensors the worker reads, or None.
        output: key the worker publishes output tensors under, or None.
        error: key the worker records a failure under when there is no output
            key (a text-only request), or None.
        prefilled: the prompt's KV cache was computed by a prefill stage (the request
            starts past the prompt, whose rows the prefill stage published).
        input_grows: more chunks are appended to the input payload while the request
            runs, each before the request's next input chunk reaches the engine.
    """

    input: str | None = None
    output: str | None = None
    error: str | None = None
    prefilled: bool = False
    input_grows: bool = False

    @property
    def failure_key(self) -> str | None:
        """Where a failure of this request is recorded (output key first)."""
        return self.output or self.error


def payload_keys(extra: dict[str, Any] | None) -> PayloadKeys:
    """Read and validate ``extra[PAYLOAD]``.

    Raises:
        ValueError: the value is not ``{"in"|"out"|"err": "<key>",
            "prefilled"|"input_grows": bool}`` with keys matching
            ``[A-Za-z0-9._-]{1,200}``; the message names the field.
    """
    value = (extra or {}).get(PAYLOAD)
    if value is None:
        return PayloadKeys()
    if not isinstance(value, dict):
        raise ValueError(f"extra_args[{PAYLOAD!r}] must be a mapping, got {type(value).__name__}")
    unknown = sorted(map(str, set(value) - {*_SLOTS, *_FLAGS}))
    if unknown:
        raise ValueError(f"extra_args[{PAYLOAD!r}] has unknown slot(s) {unknown}")
    for slot, key in value.items():
        if slot not in _FLAGS and not is_payload_key(key):
            raise ValueError(f"extra_args[{PAYLOAD!r}][{slot!r}] is not a payload key")
    for flag in _FLAGS:
        if not isinstance(value.get(flag, False), bool):
            raise ValueError(f"extra_args[{PAYLOAD!r}][{flag!r}] must be true or false")
    return PayloadKeys(value.get("in"), value.get("out"), value.get("err"),
                       value.get(_PREFILLED, False), value.get(_INPUT_GROWS, False))
