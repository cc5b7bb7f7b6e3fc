"""Patch: each chunk of a resumable (streaming-input) request keeps its own ``max_tokens``.

Why: the talker runs as one resumable vLLM request fed the thinker's output in chunks
(:func:`vllm_omni_plugin.replicas.task._fed`); each chunk lets it generate only as many
tokens as its input is ready for, through the chunk's ``SamplingParams.max_tokens``.
vLLM 0.30's scheduler applies a new chunk (``Scheduler._update_request_as_session``) by
taking its prompt and sampling parameters but not its ``max_tokens``, and stops a
request at ``Request.max_tokens``, which stays the first chunk's. So every later chunk
generated the first chunk's count: a talker fed while the thinker ran could run past
the frames its input was ready for, or past the request's limit (CI saw a streamed
answer with 25 frames where the limit allows 24). The wrapper sets the session's
``max_tokens`` from the chunk after vLLM's own update, in omni mode only (the scheduler's
``vllm_config`` carries the plugin's settings): plain vLLM's requests keep vLLM's
behaviour. Where vLLM already sets it, the patch is not applied.
Upstream reason: fixed in vLLM 0.31 (``_update_request_as_session`` sets
``session.max_tokens = update.max_tokens``); 0.30 lacks that line.
Applied where the method does not set ``max_tokens`` itself (feature detection on its
source), i.e. on 0.30 only.
Remove when: vLLM 0.30 leaves the supported range.
"""

from __future__ import annotations

import functools
import inspect

from vllm_omni_plugin.compat import MARKER

#: What :func:`apply` patches (``module:attribute path``), for the environment report.
TARGETS = ("vllm.v1.core.sched.scheduler:Scheduler._update_request_as_session",)


def needed(method) -> bool:
    """Whether vLLM's ``_update_request_as_session`` (``method``) leaves the session's
    ``max_tokens`` at the first chunk's (its source never assigns it)."""
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return ".max_tokens =" not in source


def apply() -> bool:
    """Wrap ``Scheduler._update_request_as_session`` so that it also copies the chunk's
    ``max_tokens`` to the session, where vLLM's method does not (see :func:`needed`).

    Returns:
        True when this call patched the method; False when the method is missing, already
        patched or not in need of the patch.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    original = getattr(Scheduler, "_update_request_as_session", None)
    if original is None or getattr(original, MARKER, False) or not needed(original):
        return False

    @functools.wraps(original)
    def _update_request_as_session(self, session, update, *args, **kwargs):
        from vllm_omni_plugin.config.settings import in_omni_mode

        result = original(self, session, update, *args, **kwargs)
        if in_omni_mode(getattr(self, "vllm_config", None)):
            session.max_tokens = update.max_tokens
        return result

    setattr(_update_request_as_session, MARKER, True)
    Scheduler._update_request_as_session = _update_request_as_session
    return True
