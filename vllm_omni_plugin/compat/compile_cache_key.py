"""Patch: the plugin's settings stay out of vLLM's compile-cache key.

Why: vLLM keys its ``torch.compile`` cache
(``$VLLM_CACHE_ROOT/torch_compile_cache/...``) on ``VllmConfig.compute_hash()``,
which hashes the whole of ``additional_config``. The plugin's settings travel
there (:mod:`vllm_omni_plugin.config.settings`) and carry values that differ at
every start: the payload store's run directory (named after the head's pid) and
the pipeline YAML's path. So every start of a compiled stage missed the cache and
compiled again (about 20 s for the tiny thinker on a 2-core CPU, minutes for
Qwen3-Omni's thinker on a GPU). None of the settings changes a model's graph: the
model classes never read them, only the worker's payload channel and the head do.
The wrapper hashes a shallow copy of the config whose ``additional_config`` lacks
the plugin's key (:data:`~vllm_omni_plugin.config.settings.ADDITIONAL_CONFIG_KEY`);
the config itself is not changed. Outside omni mode (a config without the key) it calls
vLLM's method with the same arguments and changes nothing. It takes every argument vLLM's
method takes and passes them through (vLLM's FlashInfer autotune warm-up calls
``compute_hash(include_version=False)``, 0.30-0.33).
Upstream reason: ``VllmConfig.compute_hash`` hashes every ``additional_config``
entry and has no way for a plugin to mark one as not affecting the computation
(vllm/config/vllm.py, 0.30-0.32).
Remove when: vLLM lets a plugin keep an ``additional_config`` entry out of the hash,
or the settings travel to the engine processes some other way.
"""

from __future__ import annotations

import copy
import functools

from vllm_omni_plugin.compat import MARKER

#: What :func:`apply` patches (``module:attribute path``), for the environment report.
TARGETS = ("vllm.config.vllm:VllmConfig.compute_hash",)


def apply() -> bool:
    """Wrap ``VllmConfig.compute_hash`` so that it ignores the plugin's ``additional_config`` key.

    Returns:
        True when this call patched the method, False when it was already patched.
    """
    from vllm.config.vllm import VllmConfig

    if getattr(VllmConfig.compute_hash, MARKER, False):
        return False
    original = VllmConfig.compute_hash

    @functools.wraps(original)
    def compute_hash(self, *args, **kwargs) -> str:
        from vllm_omni_plugin.config.settings import ADDITIONAL_CONFIG_KEY, in_omni_mode

        if not in_omni_mode(self):
            return original(self, *args, **kwargs)
        hashed = copy.copy(self)  # no validation, no __post_init__: only the hash reads it
        object.__setattr__(hashed, "additional_config", {
            k: v for k, v in self.additional_config.items() if k != ADDITIONAL_CONFIG_KEY})
        return original(hashed, *args, **kwargs)

    setattr(compute_hash, MARKER, True)
    VllmConfig.compute_hash = compute_hash
    return True
