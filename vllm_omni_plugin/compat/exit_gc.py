"""Exit hook: a process the plugin is loaded in skips the cyclic garbage collection of
interpreter exit.

Why: an EngineCore and its worker process hold about a million objects reachable
from vLLM's and torch's modules. At interpreter exit CPython collects the whole
heap again before the process ends, about 2 s per process on a 2-core CPU host,
for garbage the operating system frees anyway. The EngineCore waits for its worker
to exit and then exits itself, and vLLM's client force-kills an EngineCore still
alive 5 s after its SIGTERM: every stage engine was killed at shutdown rather than
exiting, and a pipeline's stop or a supervised restart waited the full 5 s per
engine (measured on vLLM 0.32's CPU build: 5.0 s with a force kill, 1.5 s with this
hook and a clean exit). :func:`install` registers ``gc.freeze`` with ``atexit``: it
runs before CPython's final collections, which then skip the frozen heap. Objects
are still freed by reference counting, and vLLM's own explicit teardown (workers,
distributed state, its ``gc.collect()``) runs before it.
Upstream reason: vLLM freezes the surviving heap at EngineCore exit on ROCm only
(``EngineCoreProc.run_engine_core``, vllm/v1/engine/core.py, 0.30-0.32; vLLM PR
#52281) and never in worker processes; the full-heap collections at EngineCore
teardown are vLLM issue #48620 (fix proposed in PR #49082).
Remove when: vLLM skips the exit-time collection on every platform, in its worker
processes too.
"""

from __future__ import annotations

import atexit
import gc


def install() -> None:
    """Register ``gc.freeze`` to run at interpreter exit, once however often called."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
