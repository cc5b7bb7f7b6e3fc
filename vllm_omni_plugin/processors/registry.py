"""Registry of stage input processors, backed by pluggy.

Sources, in registration order:

1. the built-in module :data:`BUILTIN_MODULE` (imported by dotted name; it
   must *not* also be listed as an entry point);
2. every entry point in the group :data:`ENTRY_POINT_GROUP` of installed
   distributions.

Nothing is imported or loaded until :func:`get_plugin_manager` is first
called. Resolve processors once per stage at startup, not per request.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping

import pluggy

from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.processors import hookspecs

logger = init_logger(__name__)

#: the plugin's own hook implementations, one module per model family
BUILTIN_MODULES = ("vllm_omni_plugin.models.qwen3_omni.processors",
                   "vllm_omni_plugin.models.bagel.processors")
ENTRY_POINT_GROUP = "vllm_omni_plugin.stage_input_processors"


class UnknownProcessorError(KeyError):
    """No stage input processor has the requested name.

    Attributes:
        name: the requested name.
        available: registered names, in registration order.
    """

    def __init__(self, name: str, available: list[str]):
        super().__init__(name)
        self.name = name
        self.available = available

    def __str__(self) -> str:
        names = ", ".join(self.available) or "(none)"
        return f"unknown processor {self.name!r}; available: {names}"


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, creating it on first call.

    Clear with ``get_plugin_manager.cache_clear()`` (tests).

    Raises:
        pluggy.PluginValidationError: a plugin implements an unknown hook or
            a hook with a wrong signature.
        ImportError: the built-in module or an entry point fails to import
            (a missing built-in module itself is skipped).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in BUILTIN_MODULES:
        try:
            builtin = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            logger.debug("built-in processor module %s not found; skipped", name)
        else:
            pm.register(builtin, name=name)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    pm.check_pending()
    return pm


def available_processors() -> dict[str, Callable]:
    """Return all registered processors as ``{name: callable}``.

    Raises:
        ValueError: two plugins register the same name (both are named).
        TypeError: a plugin returns something other than a mapping of
            ``str`` to callables.
    """
    pm = get_plugin_manager()
    found: dict[str, Callable] = {}
    owner: dict[str, str] = {}
    for impl in pm.hook.omni_register_stage_input_processors.get_hookimpls():
        mapping = impl.function()
        if mapping is None:
            continue
        if not isinstance(mapping, Mapping):
            raise TypeError(
                f"plugin {impl.plugin_name!r}: omni_register_stage_input_processors "
                f"must return a mapping, got {type(mapping).__name__}"
            )
        for name, proc in mapping.items():
            if not isinstance(name, str) or not callable(proc):
                raise TypeError(
                    f"plugin {impl.plugin_name!r}: processor {name!r} must be a "
                    f"str name mapped to a callable, got {type(proc).__name__}"
                )
            if name in owner:
                raise ValueError(
                    f"stage input processor {name!r} is registered by both plugin "
                    f"{owner[name]!r} and plugin {impl.plugin_name!r}"
                )
            found[name], owner[name] = proc, impl.plugin_name
    return found


def get_processor(name: str) -> Callable:
    """Return the processor registered as ``name``.

    Raises:
        UnknownProcessorError: no such name (message lists available names).
        ValueError, TypeError: see :func:`available_processors`.
    """
    procs = available_processors()
    try:
        return procs[name]
    except KeyError:
        raise UnknownProcessorError(name, list(procs)) from None


def list_voices(hf_config) -> hookspecs.Voices | None:
    """The served checkpoint's voices from the first plugin that knows its model
    (``omni_list_voices``); None when none does."""
    return get_plugin_manager().hook.omni_list_voices(hf_config=hf_config)


def plan_image(hf_config, request: hookspecs.ImageRequest) -> hookspecs.ImagePlan | None:
    """How the served checkpoint draws ``request``, from the first plugin that knows its
    model (``omni_plan_image``); None when none does.

    Raises:
        hookspecs.RequestError: the model cannot serve the request (names the field).
    """
    return get_plugin_manager().hook.omni_plan_image(hf_config=hf_config, request=request)
