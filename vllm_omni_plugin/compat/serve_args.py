"""Patch: the "Omni" argument group on ``vllm serve`` and its hand-off to the engine.

Why: vLLM has no extension point for new ``vllm serve`` flags. General plugins
are loaded right before ``EngineArgs.add_cli_args`` builds the parser, so
wrapping it is the narrowest seam; the parsed omni flags then reach every
vLLM process through ``additional_config`` by wrapping ``EngineArgs.from_cli_args``.
Upstream reason: ``EngineArgs`` only maps its own dataclass fields
(vllm/engine/arg_utils.py, 0.30-0.32).
Remove when: vLLM offers a plugin hook for CLI arguments and for extra engine
config (none in 0.30-0.32; ``plugin_tests/unit/test_compat_shims.py`` fails once
that changes).
"""

from __future__ import annotations

import functools

from vllm_omni_plugin.compat import MARKER

#: What :func:`apply` patches (``module:attribute path``), for the environment report.
TARGETS = (
    "vllm.engine.arg_utils:EngineArgs.add_cli_args",
    "vllm.engine.arg_utils:EngineArgs.from_cli_args",
)


def apply() -> bool:
    """Wrap ``EngineArgs.add_cli_args`` (adds the omni flags) and ``EngineArgs.from_cli_args``
    (hands them to the engine config).

    Returns:
        True when this call patched both methods, False when they were already patched.
    """
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.add_cli_args, MARKER, False):
        return False
    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__

    @functools.wraps(original_add)
    def add_cli_args(parser, *args, **kwargs):
        parser = original_add(parser, *args, **kwargs)
        from vllm_omni_plugin.config.cli import add_omni_args

        add_omni_args(parser)
        return parser

    @functools.wraps(original_from)
    def from_cli_args(cls, args):
        engine_args = original_from(cls, args)
        from vllm_omni_plugin.config.cli import apply_omni_args

        apply_omni_args(args, engine_args)
        return engine_args

    setattr(add_cli_args, MARKER, True)
    setattr(from_cli_args, MARKER, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    return True
