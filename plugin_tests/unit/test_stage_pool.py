"""StagePool decisions: affinity, CFG companions, bounded wait, failover.

The pool's replicas here are :class:`Replica` instances whose ``run`` is
scripted, to inject each failure deterministically (a replica lost before or
after producing output, at a chosen moment). The same paths with real
processes, signals and sockets are in ``test_replicas_serve.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from vllm_omni_plugin.coordinator import (
    LeastQueueLengthBalancer,
    RandomBalancer,
    RoundRobinBalancer,
)
from vllm_omni_plugin.replicas.pool import NoReplicaAvailable, ReplicaFailed, StagePool
from vllm_omni_plugin.replicas.replica import Replica
from vllm_omni_plugin.replicas.task import ReplicaLost, StageRun, StageTask


class ScriptedReplica(Replica):
    """Runs tasks by ``outcome``: "ok", "lost-before-output" or "lost-after-output"."""

    def __init__(self, replica_id: int, outcome: str = "ok", queue_length: int = 0):
        super().__init__(3, replica_id, f"tcp://127.0.0.1:{29000 + replica_id}")
        self.outcome = outcome
        self.queue_length = queue_length
        self.ran: list[str] = []

    async def run(self, task: StageTask, on_rows=None) -> StageRun:
        self.ran.append(task.request_id)
        await asyncio.sleep(0)
        if self.outcome != "ok":
            self.lost("was killed")
            raise ReplicaLost(f"replica {self.replica_id} was killed",
                              produced_output=self.outcome == "lost-after-output")
        return StageRun([1], [self.replica_id], {})


def _task(rid: str, parent: str | None = None) -> StageTask:
    return StageTask(rid, [1, 2], {}, parent_request_id=parent)


def _pool(*replicas, balancer=None, wait=0.3) -> StagePool:
    pool = StagePool(3, balancer or RandomBalancer(seed=1), wait)
    for r in replicas:
        pool.add(r)
    return pool


def test_request_keeps_its_replica_and_cfg_companion_follows_parent():
    replicas = [ScriptedReplica(i) for i in range(4)]
    pool = _pool(*replicas)
    first = pool.select(_task("req-a"))
    assert all(pool.select(_task("req-a")) is first for _ in range(20))
    assert all(pool.select(_task(f"req-a__cfg{i}", parent="req-a")) is first for i in range(5))
    # without affinity the random balancer spreads
    assert len({pool.select(_task(f"other-{i}")).replica_id for i in range(40)}) == 4


def test_affinity_yields_when_the_replica_is_detached():
    a, b = ScriptedReplica(0), ScriptedReplica(1)
    pool = _pool(a, b, balancer=RoundRobinBalancer())
    pinned = pool.select(_task("req"))
    pinned.lost("missed heartbeats")
    other = pool.select(_task("req"))
    assert other is not pinned and other.attached
    assert pool.select(_task("req__cfg", parent="req")) is other


def test_tasks_naming_one_parent_go_to_the_first_ones_replica():
    """The chunks of a streamed request name its stream as their parent: each goes to
    the first chunk's replica after the one before was forgotten (it finished), the
    next one after that replica is lost re-pins the parent, and forgetting the parent
    frees it."""
    replicas = [ScriptedReplica(i) for i in range(4)]
    pool = _pool(*replicas, balancer=RoundRobinBalancer())
    first = pool.select(_task("req-s2-c0", parent="req-s2"))
    pool.forget("req-s2-c0")
    for i in range(1, 5):
        assert pool.select(_task(f"req-s2-c{i}", parent="req-s2")) is first
        pool.forget(f"req-s2-c{i}")
    first.lost("missed heartbeats")
    moved = pool.select(_task("req-s2-c5", parent="req-s2"))
    assert moved is not first and moved.attached
    assert pool.select(_task("req-s2-c6", parent="req-s2")) is moved
    pool.forget("req-s2")
    assert pool.pinned("req-s2") is None


def test_least_queue_length_uses_reported_load():
    pool = _pool(ScriptedReplica(0, queue_length=5), ScriptedReplica(1, queue_length=0),
                 ScriptedReplica(2, queue_length=3), balancer=LeastQueueLengthBalancer(seed=0))
    assert {pool.select(_task(f"r{i}")).replica_id for i in range(10)} == {1}


def test_no_replica_fails_after_the_wait_with_503():
    pool = _pool(wait=0.2)
    with pytest.raises(NoReplicaAvailable, match="no replica available for stage 3") as info:
        asyncio.run(pool.run(_task("req")))
    assert info.value.status == 503


def test_replica_attaching_during_the_wait_takes_the_task():
    async def scenario():
        pool = _pool(wait=10.0)
        late = ScriptedReplica(7)
        asyncio.get_running_loop().call_later(0.1, pool.add, late)
        return await pool.run(_task("req")), late

    result, late = asyncio.run(scenario())
    assert result.output_token_ids == [7] and late.ran == ["req"]


def test_task_without_output_is_resubmitted_elsewhere():
    dead, alive = ScriptedReplica(0, "lost-before-output"), ScriptedReplica(1)
    pool = _pool(dead, alive, balancer=RoundRobinBalancer())
    result = asyncio.run(pool.run(_task("req")))
    assert dead.ran == ["req"] and alive.ran == ["req"]
    assert result.output_token_ids == [1] and pool.resubmissions == 1


def test_task_with_output_fails_naming_stage_and_replica():
    pool = _pool(ScriptedReplica(0, "lost-after-output"), ScriptedReplica(1),
                 balancer=RoundRobinBalancer())
    with pytest.raises(ReplicaFailed, match="replica 0 of stage 3 failed mid-request") as info:
        asyncio.run(pool.run(_task("req")))
    assert info.value.status == 500 and pool.failures == 1 and pool.resubmissions == 0


def test_replica_starting_makes_tasks_wait_none_coming_fails_at_once():
    async def scenario():
        pool = _pool(ScriptedReplica(0), wait=10.0)
        replica = pool.replicas[0]
        replica.status = "starting"  # a local engine being restarted
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lambda: (setattr(replica, "status", "up"), pool.notify()))
        served = await pool.run(_task("waits"))
        replica.status = "down"  # given up: nothing is coming back
        start = loop.time()
        with pytest.raises(NoReplicaAvailable, match="none is up or starting") as info:
            await pool.run(_task("refused"))
        return served, loop.time() - start, info.value

    served, waited, error = asyncio.run(scenario())
    assert served.output_token_ids == [0]
    assert waited < 1.0 and error.status == 503 and error.retry_after >= 1


def test_resubmission_goes_to_the_restarted_incarnation_of_the_same_replica():
    async def scenario():
        replica = ScriptedReplica(0, "lost-before-output")
        pool = _pool(replica, wait=10.0)

        def restarted():
            replica.outcome, replica.generation, replica.status = "ok", 1, "up"
            pool.notify()

        replica.status = "up"
        original_run = replica.run

        async def run_then_restart(task, on_rows=None):
            try:
                return await original_run(task)
            finally:
                replica.status = "starting"
                asyncio.get_running_loop().call_later(0.05, restarted)

        replica.run = run_then_restart
        return await pool.run(_task("req")), pool

    result, pool = asyncio.run(scenario())
    assert result.output_token_ids == [0] and pool.resubmissions == 1


class SlowToStopReplica(ScriptedReplica):
    """``release`` stands for a local engine's shutdown: it returns once every replica
    of the head is being released at the same time (a barrier), or fails after 10 s."""

    def __init__(self, replica_id: int, barrier):
        super().__init__(replica_id)
        self.barrier = barrier
        self.events: list[str] = []

    def close(self) -> None:
        super().close()
        self.events.append("closed")

    def release(self) -> None:
        self.barrier.wait(timeout=10)  # BrokenBarrierError: released one after another
        self.events.append("released")


def test_head_shutdown_releases_every_stages_replicas_at_once(tmp_path):
    """Each local engine takes seconds to stop: the head closes every pool, then
    releases all their replicas concurrently, not stage after stage."""
    import threading
    from types import SimpleNamespace

    from vllm_omni_plugin.engine.bootstrap import Head
    from vllm_omni_plugin.payload_store import PayloadStore

    barrier = threading.Barrier(3)
    replicas = [SlowToStopReplica(i, barrier) for i in range(3)]
    pools = {1: _pool(replicas[0]), 2: _pool(*replicas[1:])}
    closed = SimpleNamespace(cluster=False)
    head = Head(settings=None, pipeline=None, store=PayloadStore(str(tmp_path / "run")),
                cluster=SimpleNamespace(close=lambda: setattr(closed, "cluster", True)),
                pools=pools, admission=None, orchestrator=None, metrics=object())
    head.shutdown()
    assert all(r.events == ["closed", "released"] and r.status == "down" for r in replicas)
    assert closed.cluster and head.pools == {} and not pools[1].replicas
