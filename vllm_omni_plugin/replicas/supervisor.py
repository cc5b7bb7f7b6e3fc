"""Supervision of the head's local stage replicas: see a dead engine at once, restart it.

A :class:`LocalReplica`'s engine runs its EngineCore in a child process. The
supervisor waits on the processes' sentinels (the same ones vLLM's own
``MPClientEngineMonitor`` thread waits on), so an exit is seen when it happens,
not when the next request finds out. Then it

1. marks the replica ``error`` (``/metrics``) and logs the exit code; tasks
   running there fail over (see :class:`~.pool.StagePool`);
2. starts a new engine in a worker thread, status ``starting``; requests for
   the stage wait for it (``--omni-replica-wait-timeout``);
3. on success swaps it in (status ``up``, the replica's ``generation`` + 1);
   on failure waits 1, 2, 4, ... seconds (at most :data:`MAX_BACKOFF_S`),
   status ``error`` meanwhile, and tries again.

A replica whose EngineCore stalls (answers no liveness probe within the stall
timeout, :mod:`.liveness`) goes the same way: its engine's processes are killed, it is
counted in ``stalls``, and its tasks fail over with the stall as the reason.

After ``max_restarts`` attempts the replica is given up (status ``down``).
Attempts count from the last time the replica had been up for
:data:`STABLE_AFTER_S`, so an engine that fails to start, or crashes right
after each restart, is given up rather than restarted forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from multiprocessing import connection

from vllm_omni_plugin.compat.internals import engine_processes
from vllm_omni_plugin.logger import init_logger

from .liveness import StallWatch, kill_engine
from .replica import LocalReplica

logger = init_logger(__name__)

#: Longest wait between two restart attempts, seconds.
MAX_BACKOFF_S = 30.0
#: Seconds up after which a replica's restart attempts count from zero again.
STABLE_AFTER_S = 60.0
#: Poll interval, seconds, when vLLM exposes no engine processes to wait on.
_POLL_S = 0.5


def _exit_codes(processes) -> list[int | None]:
    """Exit codes of processes whose sentinels fired (None where unknown)."""
    codes = []
    deadline = time.monotonic() + 1.0
    for process in processes:
        try:
            # The sentinel fires before the child can be reaped: join waits for
            # that; if vLLM's own monitor thread reaped it first, its exit code
            # is recorded a moment later.
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            while process.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
            codes.append(process.exitcode)
        except (AssertionError, ValueError):  # not our child / closed by its owner
            codes.append(None)
    return codes


def _wait_for_exit(engine, stop: threading.Event) -> list[int | None]:
    """Block until ``engine``'s EngineCore processes exit (or ``stop``); their exit codes."""
    processes = engine_processes(engine)
    if processes is not None:
        try:
            connection.wait([p.sentinel for p in processes])
        except (OSError, ValueError):  # sentinel closed: the engine was shut down
            pass
        return _exit_codes(processes)
    while not stop.wait(_POLL_S):
        if engine.errored:
            break
    return [None]


class LocalReplicaSupervisor:
    """Watches one local replica and restarts its engine when it dies.

    Args:
        replica: The replica; its ``engine`` is replaced on restart.
        start_engine: Builds and starts a new engine of the replica's stage
            (blocking; runs in a worker thread). Raises on failure.
        on_up: Called on the event loop after a restart (e.g. ``pool.notify``).
        max_restarts: Restart attempts (since the replica was last up for
            :data:`STABLE_AFTER_S`) before it is ``down``; 0 disables restarts.
        backoff_s: Wait after a failed engine start, seconds; doubled for
            each further failed start in a row, at most :data:`MAX_BACKOFF_S`.
        stall_timeout: Seconds the engine may leave a liveness probe unanswered before
            it is killed as stalled (:class:`~.liveness.StallWatch`); 0: not probed.
        start_lock: Held while a new engine starts: one lock shared by the replicas whose
            engines share a GPU, so that two restarts there do not run vLLM's memory
            profile side by side (each would count the other's memory as taken, as at
            start-up, where such engines start one after another); None: not shared.
    """

    def __init__(self, replica: LocalReplica, start_engine: Callable[[], object],
                 on_up: Callable[[], None], max_restarts: int, backoff_s: float = 1.0,
                 stall_timeout: float = 0.0, start_lock: threading.Lock | None = None
                 ) -> None:
        self.replica = replica
        self.start_lock = start_lock
        self.stall_timeout = stall_timeout
        replica.supervisor = self
        self.start_engine = start_engine
        self.on_up = on_up
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.attempts = 0  # since the replica was last stable
        self.failed_in_row = 0  # failed engine starts since the last successful one
        self.restarts = 0
        self.last_start_s: float | None = None
        self._up_since = time.monotonic()
        self._stop = threading.Event()
        self._dead_engine = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._liveness: StallWatch | None = None

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start watching the replica's current engine (call on ``loop``'s thread or before)."""
        self._loop = loop
        engine = self.replica.engine

        def waiter() -> None:
            codes = _wait_for_exit(engine, self._stop)
            if not self._stop.is_set():
                loop.call_soon_threadsafe(self._on_exit, engine, codes)

        threading.Thread(target=waiter, daemon=True,
                         name=f"omni-supervise-s{self.replica.stage_id}r"
                              f"{self.replica.replica_id}").start()
        if self.stall_timeout > 0:
            self._liveness = StallWatch(engine, self.stall_timeout, self.replica.name,
                                        lambda reason: self._stalled(engine, reason),
                                        busy=lambda: len(self.replica.running))
            self._liveness.start()

    def _stalled(self, engine, reason: str) -> None:
        """``engine`` stalled: kill its processes, then handle it as dead."""
        if self._stop.is_set() or engine is not self.replica.engine:
            return
        self.replica.stalls += 1
        kill_engine(engine)
        self._on_exit(engine, [None], reason)

    def engine_died(self, engine) -> None:
        """A task found ``engine`` dead (possibly before the watcher thread did)."""
        self._on_exit(engine, _exit_codes(engine_processes(engine) or []))

    def _on_exit(self, engine, codes: list[int | None], reason: str | None = None) -> None:
        if self._stop.is_set() or engine is not self.replica.engine or \
                engine is self._dead_engine:
            return
        self._dead_engine = engine
        if self._liveness is not None:
            self._liveness.stop()
        code = next((c for c in codes if c), codes[0] if codes else None)
        if reason is None:  # (a stall's reason is logged where it is seen)
            reason = f"engine core exited (exit code {code})" if code is not None else \
                "engine core died"
            logger.error("%s: %s", self.replica.name, reason)
        self.replica.lost(reason)
        if time.monotonic() - self._up_since >= STABLE_AFTER_S:
            self.attempts = 0
        if self.attempts < self.max_restarts:
            self.replica.status = "starting"  # requests wait for it from now on
        assert self._loop is not None
        self._task = self._loop.create_task(self._restart(engine),
                                            name=f"omni-restart-{self.replica.name}")

    def _backoff(self) -> float:
        if self.failed_in_row == 0:
            return 0.0
        return min(self.backoff_s * 2.0 ** (self.failed_in_row - 1), MAX_BACKOFF_S)

    def _start(self):
        """A new engine, started while holding :attr:`start_lock` (a worker thread)."""
        with self.start_lock or contextlib.nullcontext():
            return self.start_engine()

    async def _restart(self, dead_engine) -> None:
        replica = self.replica
        await asyncio.to_thread(_shutdown, dead_engine, replica.name)
        while not self._stop.is_set():
            if self.attempts >= self.max_restarts:
                replica.status = "down"
                replica.restart_eta = None
                logger.error("%s: given up after %d restart attempt(s) within %.0f s "
                             "(runtime.max_restarts); the stage needs another replica",
                             replica.name, self.attempts, STABLE_AFTER_S)
                return
            delay = self._backoff()
            if delay:
                replica.status = "error"
                replica.restart_eta = time.monotonic() + delay + (self.last_start_s or 0.0)
                logger.warning("%s: next restart attempt in %.1f s", replica.name, delay)
                await asyncio.sleep(delay)
                if self._stop.is_set():
                    return
            self.attempts += 1
            replica.status = "starting"
            replica.restart_eta = time.monotonic() + (self.last_start_s or 0.0)
            logger.info("%s: restarting its engine (attempt %d of %d)", replica.name,
                        self.attempts, self.max_restarts)
            start = time.monotonic()
            try:
                engine = await asyncio.to_thread(self._start)
            except Exception as exc:
                self.failed_in_row += 1
                logger.error("%s: restart failed: %s", replica.name, exc)
                continue
            self.failed_in_row = 0
            self.last_start_s = time.monotonic() - start
            if self._stop.is_set():
                await asyncio.to_thread(_shutdown, engine, replica.name)
                return
            replica.replace_engine(engine)
            self.restarts += 1
            self._up_since = time.monotonic()
            logger.info("%s: restarted in %.1f s; up again", replica.name, self.last_start_s)
            assert self._loop is not None
            self.watch(self._loop)
            self.on_up()
            return

    def close(self) -> None:
        """Stop supervising (the replica is being closed); no restart after this."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
        if self._liveness is not None:
            self._liveness.stop()


def _shutdown(engine, name: str) -> None:
    try:
        engine.shutdown()
    except Exception:
        logger.exception("%s: shutting down the old engine failed", name)
