"""Patch: vLLM's API server gets the omni engine client in omni mode.

Why: ``vllm serve`` builds its ``EngineClient`` with ``AsyncLLM.from_vllm_config``
and offers no hook to choose another class. For the entry stage in omni
mode (the engine's ``additional_config`` carries the plugin's settings and
does not mark it a downstream stage) the wrapper constructs
:class:`~vllm_omni_plugin.engine.omni_client.OmniEngineClient`, an ``AsyncLLM``
subclass, with the same arguments; otherwise it calls vLLM's method unchanged.
Upstream reason: ``from_vllm_config`` is the only constructor the API server
uses (same signature 0.30-0.32).
Remove when: vLLM lets a plugin supply the engine client class (none in
0.30-0.32; ``plugin_tests/unit/test_compat_shims.py`` fails once that changes).
"""

from __future__ import annotations

import functools

from vllm_omni_plugin.compat import MARKER

#: What :func:`apply` patches (``module:attribute path``), for the environment report.
TARGETS = ("vllm.v1.engine.async_llm:AsyncLLM.from_vllm_config",)


def apply() -> bool:
    """Wrap ``AsyncLLM.from_vllm_config`` so that it builds an ``OmniEngineClient`` for the
    entry stage in omni mode.

    Returns:
        True when this call patched the method, False when it was already patched.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    if getattr(AsyncLLM.from_vllm_config, MARKER, False):
        return False
    original = AsyncLLM.from_vllm_config.__func__

    @functools.wraps(original)
    def from_vllm_config(cls, vllm_config, *args, **kwargs):
        from vllm_omni_plugin.config.settings import is_entry_stage

        if cls is AsyncLLM and is_entry_stage(vllm_config):
            from vllm_omni_plugin.engine.omni_client import OmniEngineClient

            cls = OmniEngineClient
        return original(cls, vllm_config, *args, **kwargs)

    setattr(from_vllm_config, MARKER, True)
    AsyncLLM.from_vllm_config = classmethod(from_vllm_config)
    return True
