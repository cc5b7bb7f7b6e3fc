"""Which compat patches are active in this process (read-only).

Each patch module names what it patches in ``TARGETS`` (``"module:Attr.path"``);
a patch is active when every target carries :data:`~vllm_omni_plugin.compat.MARKER`.
A target whose module was never imported in this process is unpatched (a patch
may apply only where vLLM loaded that module, e.g. only in the ``vllm`` CLI).
Used by the environment report; nothing here imports vLLM, applies or undoes a patch.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from vllm_omni_plugin.compat import MARKER, PATCH_MODULES


@dataclass(frozen=True)
class PatchStatus:
    """Whether one compat patch is active in this process.

    Args:
        name: The patch module's short name (e.g. ``"serve_args"``).
        module: The patch module's full dotted name.
        targets: The module's ``TARGETS`` (``"module:Attr.path"``), empty when it declares none.
        active: Whether every target carries the marker; None when there are no targets.
        loaded: Whether every target's module is imported in this process.
    """
    name: str
    module: str
    targets: tuple[str, ...]
    #: True/False from the markers; None when the module declares no TARGETS.
    active: bool | None
    #: Every target's module is imported in this process (else it cannot be patched here).
    loaded: bool = True


def _marked(target: str) -> bool:
    module_name, _, path = target.partition(":")
    obj = sys.modules.get(module_name)
    for attr in path.split("."):
        obj = getattr(obj, attr, None)
    return bool(getattr(obj, MARKER, False))


def patch_status() -> list[PatchStatus]:
    """One entry per module in :data:`~vllm_omni_plugin.compat.PATCH_MODULES`, in order."""
    result = []
    for module_name in PATCH_MODULES:
        targets = tuple(getattr(importlib.import_module(module_name), "TARGETS", ()))
        active = all(_marked(t) for t in targets) if targets else None
        loaded = all(t.partition(":")[0] in sys.modules for t in targets)
        result.append(PatchStatus(module_name.rsplit(".", 1)[1], module_name, targets, active,
                                  loaded))
    return result
