"""Stage input processors: hook specs and the pluggy-backed registry.

Importing this package loads no plugin; see :mod:`.registry`.
"""

from vllm_omni_plugin.processors.hookspecs import (
    PROJECT_NAME,
    StageInput,
    StageInputProcessor,
    UpstreamOutput,
    Voices,
    hookimpl,
    hookspec,
)
from vllm_omni_plugin.processors.registry import (
    BUILTIN_MODULE,
    ENTRY_POINT_GROUP,
    UnknownProcessorError,
    available_processors,
    get_plugin_manager,
    get_processor,
    list_voices,
)

__all__ = [
    "BUILTIN_MODULE",
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "StageInput",
    "StageInputProcessor",
    "UnknownProcessorError",
    "UpstreamOutput",
    "Voices",
    "available_processors",
    "get_plugin_manager",
    "get_processor",
    "hookimpl",
    "hookspec",
    "list_voices",
]
