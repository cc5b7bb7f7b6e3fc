"""Admission control: a bound on pipeline requests in flight at each downstream stage.

A request that asks for more than text reserves one slot of every downstream
stage before the entry stage runs, and gives each back when it leaves that
stage (finished, failed or aborted). When some stage is full the request
waits, first come first served, up to the gate's timeout, then is refused
with HTTP 429 and a ``Retry-After`` estimated from recent requests. So a burst
queues in the API server for a bounded time instead of piling work (and
results) into the stages; text-only requests never pass the gate.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

#: Weight of the newest request's duration in the running estimate behind ``Retry-After``.
_EMA_WEIGHT = 0.2


class AdmissionRefused(RuntimeError):
    """No room for the request within the gate's timeout (HTTP 429).

    ``retry_after``: whole seconds the client should wait (at least 1).
    """

    status = 429

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Admission:
    """One admitted request's slots; :meth:`release` each as the request leaves
    a stage, :meth:`release_all` when it ends (both idempotent)."""

    def __init__(self, gate: AdmissionGate, stages: list[int]) -> None:
        self._gate = gate
        self._held = set(stages)
        self._start: float | None = time.monotonic()

    def release(self, stage_id: int) -> None:
        """Give back the slot of ``stage_id`` and wake waiting requests; a no-op when this
        admission holds no slot there (any more)."""
        if stage_id in self._held:
            self._held.discard(stage_id)
            self._gate._release(stage_id)

    def release_all(self, record: bool = True) -> None:
        """Give every slot back; ``record``: count the request's duration in
        the gate's ``Retry-After`` estimate."""
        for stage_id in sorted(self._held):
            self.release(stage_id)
        if self._start is not None:
            if record:
                self._gate._finished(time.monotonic() - self._start)
            self._start = None


class AdmissionGate:
    """Bounds of the downstream stages.

    Args:
        bounds: stage id -> requests in flight allowed there (>= 1).
        timeout_s: seconds a request waits for room before it is refused.
    """

    def __init__(self, bounds: dict[int, int], timeout_s: float) -> None:
        bad = {s: b for s, b in bounds.items() if b < 1}
        if bad:
            raise ValueError(f"admission bounds must be >= 1, got {bad}")
        self.bounds = dict(bounds)
        self.timeout_s = timeout_s
        self.in_flight = dict.fromkeys(bounds, 0)
        self.admitted_total = 0
        self.refused_total = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._duration_s: float | None = None

    @property
    def waiting(self) -> int:
        """The number of requests waiting for room (not yet granted, refused or cancelled)."""
        return sum(1 for w in self._waiters if not w.done())

    def _has_room(self) -> bool:
        return all(self.in_flight[s] < b for s, b in self.bounds.items())

    def _take(self) -> Admission:
        for stage_id in self.bounds:
            self.in_flight[stage_id] += 1
        self.admitted_total += 1
        return Admission(self, list(self.bounds))

    def retry_after(self) -> int:
        """Whole seconds until a slot is likely free: the recent duration of an
        admitted request, else the timeout; at least 1."""
        estimate = self._duration_s if self._duration_s is not None else self.timeout_s
        return max(1, math.ceil(estimate))

    async def admit(self) -> Admission:
        """Reserve a slot of every stage, waiting up to ``timeout_s``.

        Raises:
            AdmissionRefused: still no room after ``timeout_s``; names the full stages.
        """
        if not self._waiters and self._has_room():
            return self._take()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:  # (3.10: not built-in)
            if waiter.done() and not waiter.cancelled():
                waiter.result().release_all(record=False)  # granted as the wait ended
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.refused_total += 1
            full = sorted(s for s, b in self.bounds.items() if self.in_flight[s] >= b)
            raise AdmissionRefused(
                f"server busy: stage(s) {full} at their bound of requests in flight "
                f"(waited {self.timeout_s:g} s)", self.retry_after()) from None
        finally:
            self._wake()

    def _release(self, stage_id: int) -> None:
        self.in_flight[stage_id] -= 1
        self._wake()

    def _finished(self, duration_s: float) -> None:
        self._duration_s = duration_s if self._duration_s is None else (
            _EMA_WEIGHT * duration_s + (1 - _EMA_WEIGHT) * self._duration_s)

    def _wake(self) -> None:
        while self._waiters and (self._waiters[0].done() or self._has_room()):
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(self._take())
