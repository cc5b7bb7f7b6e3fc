"""Stage input processors: hook specs and the pluggy-backed registry.

Importing this package loads no plugin; see :mod:`.registry`.
"""

from vllm_omni_plugin.processors.hookspecs import (
    PROJECT_NAME,
    ImagePlan,
    ImageRequest,
    PlanningStep,
    RequestError,
    StageInput,
    StageInputProcessor,
    StageRequest,
    StreamChunk,
    UpstreamOutput,
    Voices,
    hookimpl,
    hookspec,
)
from vllm_omni_plugin.processors.registry import (
    BUILTIN_MODULES,
    ENTRY_POINT_GROUP,
    UnknownProcessorError,
    available_processors,
    get_plugin_manager,
    get_processor,
    list_voices,
    plan_image,
)

__all__ = [
    "BUILTIN_MODULES",
    "ENTRY_POINT_GROUP",
    "ImagePlan",
    "ImageRequest",
    "PROJECT_NAME",
    "PlanningStep",
    "RequestError",
    "StageInput",
    "StageInputProcessor",
    "StageRequest",
    "StreamChunk",
    "UnknownProcessorError",
    "UpstreamOutput",
    "Voices",
    "available_processors",
    "get_plugin_manager",
    "get_processor",
    "hookimpl",
    "hookspec",
    "list_voices",
    "plan_image",
]
