"""Seam: one gloo device for every process group of a single-rank stage worker.

Why: torch builds a new gloo TCP device for every gloo process group
(``torch.distributed.distributed_c10d`` constructs ``ProcessGroupGloo(store, rank, size,
timeout=...)``, which creates a default device: in ``_new_process_group_helper`` on
torch 2.13, vLLM 0.30-0.32; in ``_create_gloo_process_group`` on torch 2.14, vLLM 0.33), and
every device runs a loop thread that wakes 100 times a second (the 10 ms ``epoll_wait``
timeout of gloo's ``transport/tcp/loop.cc``), busy or idle. vLLM's worker creates a
device and a CPU group for each of its parallel groups (``GroupCoordinator.__init__``),
so a CPU worker of world size 1 holds 15 such threads: about 1,500 wake-ups and
15 ms of CPU per second (measured on vLLM 0.32, torch 2.13). A pipeline runs a worker
per stage, so the idle talker and code2wav workers took 3 % of a core from the thinker
serving text on a 2-core host (issue #47).

What it does: inside :func:`shared_gloo_device` (the stage worker's ``init_device``,
world size 1 only) every gloo group is built on one device, so the worker keeps one loop
thread. A world of one rank exchanges nothing over it: collectives and barriers on such
groups are local. Outside the block, and outside omni stage workers, torch builds groups
as before.

Upstream reason: ``_new_process_group_helper`` ignores ``pg_options`` for gloo, and vLLM
has no option to share a device or to skip groups of one rank.
Remove when: torch passes gloo options through ``new_group`` (vLLM could then share a
device), or vLLM creates no gloo groups for a world of one.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

#: torch's functions that build a gloo group (2.13, 2.14)
_BUILDERS = ("_new_process_group_helper", "_create_gloo_process_group")


def needed() -> bool:
    """Whether torch builds gloo groups as the seam expects: a function of
    ``distributed_c10d`` that builds groups calls the module's ``ProcessGroupGloo`` (the
    name the seam replaces), and ``ProcessGroupGloo`` takes options with a device list
    (``_Options._devices``)."""
    try:
        import torch.distributed.distributed_c10d as c10d
        options = c10d.ProcessGroupGloo._Options()
        sources = [inspect.getsource(getattr(c10d, name)) for name in _BUILDERS
                   if hasattr(c10d, name)]
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return hasattr(options, "_devices") and any("ProcessGroupGloo(" in source
                                                for source in sources)


@contextmanager
def shared_gloo_device(enabled: bool):
    """Build every gloo process group created inside the block on one gloo device.

    Args:
        enabled: False leaves torch as it is (a worker of more than one rank).

    Yields nothing. Where torch builds gloo groups differently (:func:`needed` is False)
    the block changes nothing.
    """
    if not enabled or not needed():
        yield
        return
    import torch.distributed.distributed_c10d as c10d

    original = c10d.ProcessGroupGloo
    device = original.create_default_device()

    class ProcessGroupGloo(original):
        """torch's ``ProcessGroupGloo``; built from (store, rank, size, timeout) it gets
        the shared device instead of a new one (``enable_reconfigure`` too, where torch
        has it and it is false). Any other call is torch's own."""

        def __init__(self, store, rank, size, *args, **kwargs):
            named = dict(zip(("timeout", "enable_reconfigure"), args, strict=False), **kwargs)
            if (len(args) > 2 or set(named) - {"timeout", "enable_reconfigure"}
                    or isinstance(named.get("timeout"), original._Options)
                    or named.get("enable_reconfigure")):
                super().__init__(store, rank, size, *args, **kwargs)
                return
            options = original._Options()
            options._devices = [device]
            options._threads = 2  # torch's default: two per device
            if named.get("timeout") is not None:
                options._timeout = named["timeout"]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = ProcessGroupGloo
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = original
