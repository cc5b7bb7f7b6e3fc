"""Liveness of a local stage engine: notice an EngineCore that stopped making progress.

A dead EngineCore is seen by its process sentinel (:mod:`.supervisor`); a *stalled* one
(a hung kernel, a collective that never returns, a deadlock, a stopped process) stays
alive and would hold every request routed to it. :class:`StallWatch` probes it with
vLLM's cheapest utility call, ``AsyncLLM.is_sleeping()``
(:func:`~vllm_omni_plugin.compat.internals.liveness_probe`): the EngineCore's busy loop
answers utility calls between two steps, so an answer proves the loop turns, and no
answer within the stall timeout means it does not. The EngineCore processes a stalled
engine's kill signals come from
:func:`~vllm_omni_plugin.compat.internals.engine_processes`.

**Sizing the timeout.** A healthy engine answers within one engine step, so the
timeout must exceed the longest step a stage takes. For the shipped pipelines on one
H100 (bf16, about 400 TFLOP/s sustained, i.e. 40 % of its dense peak; FLOPs counted as
2 x active parameters per token plus attention):

* a 32k-token Qwen3-Omni-30B-A3B thinker prefill, the longest thinker step (3.3 B active
  parameters, 48 layers of 32 x 128 query dims): 2 x 3.3e9 x 32768 + 2 x 48 x 32768^2
  x 4096 = 6.4e14 FLOPs, about 1.6 s (vLLM's chunked prefill splits it further);
* talker and code2wav steps are smaller still (a 3 B talker decode step; one codec chunk);
* a BAGEL DiT step advances each of at most ``max_num_seqs`` images by one Euler step
  (and decodes those it finishes): the shipped pipelines' ``MAX_IMAGES_PER_STEP`` (4)
  Euler steps of 1024x1024 images take about 2 s (the arithmetic is with the constants,
  in :mod:`vllm_omni_plugin.models.bagel.dit`).

The default, :data:`DEFAULT_STALL_TIMEOUT_S`, is 120 s: more than 50 times that
prefill, and beyond the kernel compilations (Triton autotuning) vLLM may do on a GPU at
a first request. A stage's ``runtime.stall_timeout`` sets its own,
``--omni-stall-timeout`` every stage's.

A probe is sent whether or not the engine has work: an idle engine answers at once,
and a stalled one is noticed before a request waits on it (a prefill engine holding a
finished prompt's KV cache for a transfer has no task, yet must be alive).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import psutil

from vllm_omni_plugin.compat.internals import engine_processes, liveness_probe
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: The stall timeout of a stage without ``runtime.stall_timeout``, seconds (see above).
DEFAULT_STALL_TIMEOUT_S = 120.0
#: Longest wait between two probes, seconds (a tenth of the timeout when that is less).
MAX_PROBE_INTERVAL_S = 5.0
#: A probe answered after more than this share of the stall timeout is logged (a step
#: that long is close to counting as a stall).
SLOW_PROBE_SHARE = 0.5


def stall_timeout_of(stage, settings) -> float:
    """``stage``'s stall timeout in seconds (0: not probed): ``--omni-stall-timeout``
    when given (``settings``, an ``OmniSettings``), else the stage's
    ``runtime.stall_timeout``, else :data:`DEFAULT_STALL_TIMEOUT_S`."""
    for value in (settings.cluster.stall_timeout, stage.runtime.stall_timeout):
        if value is not None:
            return float(value)
    return DEFAULT_STALL_TIMEOUT_S


class StallWatch:
    """Probes ``engine`` until it stalls, then calls ``on_stall(reason)`` once.

    Args:
        engine: an ``AsyncLLM`` (anything with ``async is_sleeping()``).
        timeout: seconds a probe may go unanswered; must be > 0.
        name: what the log calls the engine (``"stage 1 replica 0 (local ...)"``).
        on_stall: called on the event loop with a reason naming the timeout.
        busy: the engine's requests in flight, for the reason (optional).
    """

    def __init__(self, engine, timeout: float, name: str, on_stall: Callable[[str], None],
                 busy: Callable[[], int] = lambda: 0) -> None:
        if not timeout > 0:
            raise ValueError(f"stall timeout must be positive, got {timeout!r}")
        self.engine = engine
        self.timeout = timeout
        self.interval = min(MAX_PROBE_INTERVAL_S, timeout / 10)
        self.name = name
        self.on_stall = on_stall
        self.busy = busy
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Begin probing (on the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"omni-liveness-{self.name}")

    def stop(self) -> None:
        """Stop probing (the engine is being replaced or shut down)."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sent = loop.time()
            try:
                await asyncio.wait_for(liveness_probe(self.engine), self.timeout)
            except asyncio.TimeoutError:  # (not the built-in one before Python 3.11)
                break
            except Exception:  # dead or shut down: its exit is the supervisor's to see
                return
            waited = loop.time() - sent
            if waited > self.timeout * SLOW_PROBE_SHARE:
                logger.warning("%s: a liveness probe waited %.1f s for an engine step (stall "
                               "timeout %g s): raise the stage's runtime.stall_timeout if "
                               "its steps take this long", self.name, waited, self.timeout)
            await asyncio.sleep(self.interval)
        running = self.busy()
        reason = (f"stalled: its EngineCore answered no liveness probe for "
                  f"{self.timeout:g} s (stall timeout) with {running} request(s) in flight")
        logger.error("%s: %s", self.name, reason)
        self.on_stall(reason)


def kill_engine(engine) -> int:
    """SIGKILL ``engine``'s EngineCore processes
    (:func:`~vllm_omni_plugin.compat.internals.engine_processes`) and every
    process they started (its workers), all collected before the first signal so that
    none is orphaned meanwhile; a stopped (SIGSTOP) process dies of SIGKILL too. Returns
    how many were signalled (none where this vLLM does not expose the processes)."""
    targets = []
    for process in engine_processes(engine) or ():
        try:
            root = psutil.Process(process.pid)
            targets += [*root.children(recursive=True), root]
        except psutil.NoSuchProcess:
            continue
    for target in targets:
        try:
            os.kill(target.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(targets)
