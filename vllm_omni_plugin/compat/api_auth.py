"""vLLM's own API-key check, for the routes the omni middleware answers itself.

Why: the omni API middleware (:mod:`vllm_omni_plugin.entrypoints.middleware`) is installed
through vLLM's ``--middleware``, and vLLM adds those entries to the app after its own
``AuthenticationMiddleware`` (the ``--api-key`` / ``VLLM_API_KEY`` check): Starlette runs
the middleware added last first, so ours sees every request before vLLM's key check does.
The routes it answers itself (``/v1/realtime``, ``/v1/audio/voices``) and the bodies it
reads and checks (chat media, speech, images) must be refused without the key first.
:func:`authenticated` wraps such a handler in the very ``AuthenticationMiddleware`` vLLM
added to the app, with the arguments vLLM gave it (its tokens, and on newer releases its
route provider), so the check, the headers read and the 401 body are vLLM's own. Without
``--api-key`` or ``VLLM_API_KEY`` vLLM adds none, and neither does this.
Read from vLLM: the ``AuthenticationMiddleware`` class (by name, defined under ``vllm.``)
among the app's ``user_middleware`` (Starlette's list of ``Middleware(cls, *args,
**kwargs)``), which vLLM fills with ``app.add_middleware(AuthenticationMiddleware,
tokens=...)`` in ``init_entrypoints_middleware`` before the ``--middleware`` entries
(``vllm/entrypoints/serve/middleware/``, 0.30-0.33). Nothing in vLLM is patched.
Canary: ``plugin_tests/unit/test_api_auth.py`` (every release row).
Upstream reason: vLLM gives a ``--middleware`` entry no place inside its own checks.
Remove when: vLLM adds ``--middleware`` entries inside its authentication, or the plugin's
routes move into vLLM's app as routes (``vllm.endpoint_plugins``).
"""

from __future__ import annotations

#: The name of vLLM's API-key middleware class (0.30-0.33).
CLASS_NAME = "AuthenticationMiddleware"


def vllm_auth_middleware(app):
    """The ``Middleware`` entry (``cls``, ``args``, ``kwargs``) of vLLM's API-key check
    among ``app.user_middleware``, or None when vLLM added none (no key configured) or
    ``app`` is not a Starlette app."""
    for entry in getattr(app, "user_middleware", None) or ():
        cls = getattr(entry, "cls", None)
        if getattr(cls, "__name__", None) == CLASS_NAME and \
                getattr(cls, "__module__", "").startswith("vllm."):
            return entry
    return None


def authenticated(app, handler):
    """``handler`` (an ASGI app) behind vLLM's API-key check as configured on ``app`` (the
    Starlette app of ``scope["app"]``): a request to a guarded path without a valid
    ``Authorization: Bearer`` key gets vLLM's HTTP 401 (a WebSocket the same answer, as a
    denial response before it is accepted) and never reaches ``handler``. Returns
    ``handler`` itself when vLLM checks no key."""
    entry = vllm_auth_middleware(app)
    if entry is None:
        return handler
    return entry.cls(handler, *entry.args, **entry.kwargs)
