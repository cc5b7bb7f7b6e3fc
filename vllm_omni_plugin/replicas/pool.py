"""StagePool: routes a stage's tasks over its replicas, with affinity and failover.

* Candidates are the replicas that are ``UP`` and attached (local ones whose
  engine lives, remote ones the coordinator lists ``UP``); the stage's
  ``--omni-lb-policy`` balancer picks among them.
* Affinity: a request id keeps its replica for every later task of the same
  request at this stage, and tasks naming one ``parent_request_id`` (a CFG
  companion and its parent; the chunks of one streamed request) go to one replica,
  as long as that replica is a candidate.
* No candidate: when the stage has replicas and none of them is coming back
  (a local one restarting, a remote one missing heartbeats), fail at once with
  :class:`NoReplicaAvailable` (HTTP 503 with ``Retry-After``); otherwise wait
  up to ``wait_timeout`` seconds for one to attach, then fail the same way.
* A replica lost mid-task: a task that has produced no output yet is
  resubmitted to another replica; one that has fails with an error naming the
  stage and the replica.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from vllm_omni_plugin.coordinator.load_balancer import LoadBalancer
from vllm_omni_plugin.logger import init_logger

from .replica import Replica
from .task import ReplicaLost, RowsSink, StageRun, StageTask

logger = init_logger(__name__)

#: Request ids whose replica is remembered at most, per stage (oldest dropped).
AFFINITY_CAPACITY = 65536


class NoReplicaAvailable(RuntimeError):
    """No replica of the stage is available (HTTP 503).

    ``retry_after``: seconds until one is expected (HTTP ``Retry-After``).
    """

    status = 503

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ReplicaFailed(RuntimeError):
    """The replica running a task was lost after the task produced output (HTTP 500)."""

    status = 500


class StagePool:
    """The replicas of one stage.

    Args:
        stage_id: The stage.
        balancer: A new :class:`LoadBalancer` (one per pool).
        wait_timeout: Seconds a task waits for a replica when none is attached.
    """

    def __init__(self, stage_id: int, balancer: LoadBalancer, wait_timeout: float) -> None:
        self.stage_id = stage_id
        self.balancer = balancer
        self.wait_timeout = wait_timeout
        self.replicas: dict[int, Replica] = {}  # replica_id -> replica (attached or not)
        self.resubmissions = 0
        self.failures = 0
        self._affinity: OrderedDict[str, int] = OrderedDict()
        self._changed = asyncio.Event()

    # -- membership -----------------------------------------------------------
    def add(self, replica: Replica) -> None:
        """Add ``replica`` to the pool (replacing one with its id) and wake tasks waiting for
        one."""
        self.replicas[replica.replica_id] = replica
        logger.info("%s attached", replica.name)
        self._changed.set()

    def notify(self) -> None:
        """A replica became available: wake tasks waiting for one."""
        self._changed.set()

    def remove(self, replica_id: int, reason: str) -> None:
        """Take replica ``replica_id`` out of the pool: its running tasks end as lost
        (``reason``), then it is closed and released; a no-op for an unknown id."""
        replica = self.replicas.pop(replica_id, None)
        if replica is not None:
            logger.warning("%s detached: %s", replica.name, reason)
            replica.lost(reason)
            replica.close()
            replica.release()

    def candidates(self, exclude: frozenset[tuple[int, int]] = frozenset()) -> list[Replica]:
        """Attached replicas, less the incarnations in ``exclude``."""
        return [r for r in self.replicas.values()
                if r.attached and r.incarnation not in exclude]

    def retry_after(self) -> float:
        """Seconds until a replica is expected back (at least 1; ``wait_timeout``
        when nothing says)."""
        etas = [r.restart_eta - time.monotonic() for r in self.replicas.values()
                if r.restart_eta is not None]
        return max(1.0, min(etas) if etas else self.wait_timeout)

    # -- routing --------------------------------------------------------------
    def select(self, task: StageTask,
               exclude: frozenset[tuple[int, int]] = frozenset()) -> Replica | None:
        """The replica for ``task`` now (affinity first, then the balancer); None if none."""
        candidates = self.candidates(exclude)
        if not candidates:
            return None
        for key in (task.request_id, task.parent_request_id):
            pinned = self._affinity.get(key) if key else None
            if pinned is not None:
                for replica in candidates:
                    if replica.replica_id == pinned:
                        self._remember(task.request_id, pinned)
                        return replica
        replica = candidates[self.balancer.select({"request_id": task.request_id}, candidates)]
        self._remember(task.request_id, replica.replica_id)
        if task.parent_request_id:  # the parent's other tasks follow this one
            self._remember(task.parent_request_id, replica.replica_id)
        return replica

    def _remember(self, request_id: str, replica_id: int) -> None:
        self._affinity[request_id] = replica_id
        self._affinity.move_to_end(request_id)
        while len(self._affinity) > AFFINITY_CAPACITY:
            self._affinity.popitem(last=False)

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s affinity (the request, or a parent's tasks, finished)."""
        self._affinity.pop(request_id, None)

    def pinned(self, request_id: str) -> Replica | None:
        """The replica ``request_id`` has affinity to, None when it has none or that replica is
        no longer in the pool."""
        replica_id = self._affinity.get(request_id)
        return self.replicas.get(replica_id) if replica_id is not None else None

    async def _wait_for_replica(self, task: StageTask,
                                exclude: frozenset[tuple[int, int]]) -> Replica:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout
        while True:
            replica = self.select(task, exclude)
            if replica is not None:
                return replica
            if self.replicas and not any(r.recovering for r in self.replicas.values()):
                raise NoReplicaAvailable(
                    f"no replica available for stage {self.stage_id} (none is up or "
                    "starting)", self.retry_after())
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise NoReplicaAvailable(
                    f"no replica available for stage {self.stage_id} "
                    f"(waited {self.wait_timeout:g} s)", self.retry_after())
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:  # (not the built-in one before Python 3.11)
                pass

    # -- running --------------------------------------------------------------
    async def run(self, task: StageTask, on_rows: RowsSink | None = None) -> StageRun:
        """Run ``task`` on a replica of this stage (``on_rows``: see :meth:`Replica.run`).

        Raises:
            NoReplicaAvailable: none became available within ``wait_timeout``.
            ReplicaFailed: the replica was lost after the task produced output.
            TaskError, TaskAborted: from the replica (see :meth:`Replica.run`).
        """
        tried: set[tuple[int, int]] = set()
        lost = None  # why the last replica tried was lost
        while True:
            try:
                replica = await self._wait_for_replica(task, frozenset(tried))
            except NoReplicaAvailable as exc:
                if lost is None:
                    raise
                raise NoReplicaAvailable(f"{exc}, after {lost}", exc.retry_after) from None
            try:
                return await replica.run(task, on_rows)
            except ReplicaLost as exc:
                # a growing input was (partly) handed to the lost replica
                if exc.produced_output or task.growth is not None:
                    self.failures += 1
                    raise ReplicaFailed(
                        f"replica {replica.replica_id} of stage {self.stage_id} failed "
                        f"mid-request: {exc}") from exc
                tried.add(replica.incarnation)
                lost = f"replica {replica.replica_id} was lost: {exc}"
                self.resubmissions += 1
                self.forget(task.request_id)
                logger.warning("stage %d: resubmitting %s (no output yet) after %s",
                               self.stage_id, task.request_id, exc)

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` on the replica it has affinity to, if any (see :meth:`pinned`)."""
        replica = self.pinned(request_id)
        if replica is not None:
            await replica.abort(request_id)

    def close(self) -> list[Replica]:
        """Close every replica and forget it.

        Returns:
            The closed replicas, whose :meth:`~Replica.release` is the caller's to call
            (the head releases all stages' replicas at once).
        """
        closed = [self.replicas.pop(replica_id) for replica_id in list(self.replicas)]
        for replica in closed:
            replica.close()
        return closed
