"""Everything that depends on vLLM's internals: feature detection and patches.

Each patch lives in its own module with ``apply()``, which is idempotent
(a marker attribute on the patched function) and states why it exists, the
upstream reason and when to remove it. :func:`apply_all` applies them in order
and returns the names of those applied, for the environment report. The vLLM internals
read outside the patches go through :mod:`.internals` (one accessor each, indexed in
``INTERNALS`` with the releases they were read from, and canary-tested).
"""

from __future__ import annotations

import importlib

PATCH_MODULES = (
    "vllm_omni_plugin.compat.serve_args",
    "vllm_omni_plugin.compat.engine_client",
    "vllm_omni_plugin.compat.serve_headless",
    "vllm_omni_plugin.compat.compile_cache_key",
    "vllm_omni_plugin.compat.streaming_max_tokens",
)

MARKER = "__vllm_omni_plugin_patched__"


def apply_all() -> list[str]:
    """Apply every patch in :data:`PATCH_MODULES`, in order.

    Returns:
        The short names (last dotted part) of the modules whose ``apply()`` patched
        something in this call; patches already applied or not applicable are left out.
    """
    applied = []
    for name in PATCH_MODULES:
        if importlib.import_module(name).apply():
            applied.append(name.rsplit(".", 1)[1])
    return applied
