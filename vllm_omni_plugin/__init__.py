"""vllm-omni-plugin: multi-stage omni models on upstream vLLM.

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in every
process. It is idempotent, cheap, and never raises into vLLM.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False
_warned = False


def register() -> None:
    """Register the stage models and the KV connector, apply the serve patches and
    install the exit hook (:mod:`~vllm_omni_plugin.compat.exit_gc`); idempotent."""
    global _registered, _warned
    if _registered:
        return
    from vllm_omni_plugin import envs
    from vllm_omni_plugin.compat import version
    from vllm_omni_plugin.logger import init_logger

    logger = init_logger(__name__)
    try:
        supported = version.is_supported()
        allowed = supported or envs.allow_unsupported_vllm()
        if not supported and not _warned:
            _warned = True
            logger.warning(
                "vllm-omni-plugin %s supports vLLM %s but vLLM %s is installed; %s",
                __version__, version.SUPPORTED_RANGE, version.vllm_version(),
                f"{envs.ALLOW_UNSUPPORTED_VLLM} is set: trying anyway." if allowed else
                "the plugin is disabled. Install a supported vLLM, or set "
                f"{envs.ALLOW_UNSUPPORTED_VLLM}=1 to try anyway.",
            )
        if not allowed:
            return
        from vllm_omni_plugin.compat import apply_all, exit_gc
        from vllm_omni_plugin.kv_transfer import register_connectors
        from vllm_omni_plugin.models import register_models

        register_models()
        register_connectors()
        apply_all()
        exit_gc.install()
        _registered = True
    except Exception:  # never crash vLLM from a plugin
        logger.exception("vllm-omni-plugin failed to register; omni mode is unavailable")
