"""LocalReplicaSupervisor: a dead engine is seen at once and restarted with back-off; a
headless replica's stall watch.

The engines here stand in for vLLM's ``AsyncLLM``: each owns a real child
process in the place vLLM keeps its EngineCore processes, and the tests kill
it for real with SIGKILL, or stop it with SIGSTOP (a stalled engine). Their liveness
probe (``is_sleeping``, a utility call to vLLM's EngineCore) is answered while the
child runs and not while it is stopped, as the EngineCore's busy loop would. Failed
restarts are scripted (``start_engine`` raising), a fault that a real engine start
cannot be made to produce on cue. That vLLM keeps its EngineCore processes where these
engines do and leaves ``is_sleeping`` unanswered while one is stopped is checked on a real
engine in ``plugin_tests/engine/test_pipeline_engine.py``; the real engines, killed and
stopped under a real `vllm serve`, are in ``test_hardening_serve.py`` and the
``*_serve.py`` stall tests.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from plugin_tests.helpers import LONG_WAIT, until
from vllm_omni_plugin.coordinator import ReplicaStatus, RoundRobinBalancer
from vllm_omni_plugin.replicas.liveness import DEFAULT_STALL_TIMEOUT_S, stall_timeout_of
from vllm_omni_plugin.replicas.pool import NoReplicaAvailable, StagePool
from vllm_omni_plugin.replicas.replica import LocalReplica
from vllm_omni_plugin.replicas.server import ReplicaServer
from vllm_omni_plugin.replicas.supervisor import LocalReplicaSupervisor
from vllm_omni_plugin.replicas.task import ReplicaLost, StageTask

#: The stall timeout of the stall tests, seconds: a probe of an engine that runs is
#: answered in milliseconds, so only seconds of lag on a loaded host could count as a
#: stall, and a stopped engine is still seen within a test's time.
STALL_S = 10.0


def _engine_core_with_a_worker() -> None:
    """A stand-in EngineCore that starts its own worker process, as vLLM's does."""
    multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,)).start()
    time.sleep(600)


class ProcessEngine:
    """An engine whose "EngineCore" is a real sleeping child process (``with_worker``: one
    that has a worker process of its own)."""

    def __init__(self, step_s: float = 0.0, with_worker: bool = False) -> None:
        self.proc = multiprocessing.get_context("fork").Process(
            target=_engine_core_with_a_worker if with_worker else time.sleep,
            args=() if with_worker else (600,))
        self.proc.start()
        manager = SimpleNamespace(processes=[self.proc])
        self.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_manager=manager))
        self.shut_down = False
        self.step_s = step_s  # each probe waits this long (a step under way)
        self.probes_answered = 0

    async def is_sleeping(self) -> bool:
        await asyncio.sleep(self.step_s)
        while psutil.Process(self.proc.pid).status() == psutil.STATUS_STOPPED:
            await asyncio.sleep(0.01)  # stopped: no answer until it runs again
        self.probes_answered += 1
        return False

    @property
    def errored(self) -> bool:
        return not self.proc.is_alive()

    async def generate(self, prompt, params, request_id):
        """Never answers, as vLLM's client after its EngineCore died and the
        client was shut down."""
        await asyncio.Event().wait()
        yield

    async def abort(self, request_id) -> None:
        return None

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        self.shut_down = True
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


class Starter:
    """``start_engine``: fails the first ``failures`` calls, then starts engines."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls = 0
        self.engines: list[ProcessEngine] = []

    def __call__(self) -> ProcessEngine:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(f"stage 1 ('talker') failed to start: attempt {self.calls}")
        engine = ProcessEngine()
        self.engines.append(engine)
        return engine


def _supervised(tmp_path, starter, max_restarts, backoff_s=0.01, stall_timeout=0.0,
                first=None, wait_timeout=0.2):
    first = first or ProcessEngine()
    replica = LocalReplica(1, 0, first, str(tmp_path))
    pool = StagePool(1, RoundRobinBalancer(), wait_timeout=wait_timeout)
    pool.add(replica)
    up = asyncio.Event()

    def on_up():
        pool.notify()
        up.set()

    supervisor = LocalReplicaSupervisor(replica, starter, on_up, max_restarts, backoff_s,
                                        stall_timeout=stall_timeout)
    supervisor.watch(asyncio.get_running_loop())
    return first, replica, pool, supervisor, up


def test_killed_engine_is_seen_and_replaced(tmp_path):
    async def scenario():
        starter = Starter()
        first, replica, pool, supervisor, up = _supervised(tmp_path, starter, max_restarts=3)
        first.kill()
        await asyncio.wait_for(up.wait(), LONG_WAIT)
        try:
            return first, replica, supervisor, starter
        finally:
            replica.close()
            replica.release()

    first, replica, supervisor, starter = asyncio.run(scenario())
    assert first.shut_down and replica.engine is starter.engines[0]
    assert replica.generation == 1 and supervisor.restarts == 1 and starter.calls == 1
    assert supervisor.last_start_s is not None and replica.restart_eta is None


def test_replicas_sharing_a_gpu_restart_one_after_another(tmp_path):
    """Two replicas whose engines share a GPU (one start lock) both die: the second
    restart starts its engine only after the first's start returned (vLLM's memory
    profile of each would count the other's memory as taken), then both are up."""
    async def scenario():
        lock = threading.Lock()
        release = threading.Event()
        starts = []

        class Blocking(Starter):
            def __call__(self):
                starts.append(self)
                if len(starts) == 1:  # the first start takes until the test lets it go
                    assert release.wait(LONG_WAIT)
                return super().__call__()

        supervised = []
        for replica_id in (0, 1):
            first = ProcessEngine()
            replica = LocalReplica(1, replica_id, first, str(tmp_path))
            up = asyncio.Event()
            supervisor = LocalReplicaSupervisor(replica, Blocking(), up.set, 3, 0.01,
                                                start_lock=lock)
            supervisor.watch(asyncio.get_running_loop())
            supervised.append((first, replica, supervisor, up))
        for first, *_ in supervised:
            first.kill()
        try:
            await until(lambda: len(starts) == 1 and all(
                s.attempts == 1 for _, _, s, _ in supervised), LONG_WAIT,
                what="both restarts under way, one engine starting")
            with pytest.raises(AssertionError):  # the other waits for the GPU's lock
                await until(lambda: len(starts) == 2, timeout=0.5)
            release.set()
            for *_, up in supervised:
                await asyncio.wait_for(up.wait(), LONG_WAIT)
            return len(starts), [s.restarts for _, _, s, _ in supervised]
        finally:
            release.set()
            for _, replica, _, _ in supervised:
                replica.close()
                replica.release()

    assert asyncio.run(scenario()) == (2, [1, 1])


def test_failed_restarts_back_off_then_succeed(tmp_path):
    async def scenario():
        starter = Starter(failures=2)
        first, replica, pool, supervisor, up = _supervised(tmp_path, starter, max_restarts=3)
        statuses = []
        first.kill()
        deadline = time.monotonic() + LONG_WAIT
        while not up.is_set():
            assert time.monotonic() < deadline, \
                f"not up again within {LONG_WAIT:g} s; statuses so far: {statuses}"
            if not statuses or statuses[-1] != replica.status:
                statuses.append(replica.status)
            await asyncio.sleep(0.001)
        replica.close()
        replica.release()
        return replica, supervisor, starter, statuses

    replica, supervisor, starter, statuses = asyncio.run(scenario())
    assert starter.calls == 3 and supervisor.attempts == 3 and replica.generation == 1
    assert "error" in statuses[1:] and "starting" in statuses


def test_gives_up_after_max_restarts_and_the_pool_fails_at_once(tmp_path):
    async def scenario():
        starter = Starter(failures=10)
        # A pool that waited for a replica would wait 600 s: the wait_for below ends it.
        first, replica, pool, supervisor, up = _supervised(tmp_path, starter, max_restarts=2,
                                                           wait_timeout=600.0)
        first.kill()
        await until(lambda: replica.status == "down", LONG_WAIT, what="replica down")
        with pytest.raises(NoReplicaAvailable, match="none is up or starting") as info:
            await asyncio.wait_for(pool.run(StageTask("req", [1], {})), LONG_WAIT)
        replica.close()
        replica.release()
        return starter, info.value

    starter, error = asyncio.run(scenario())
    assert starter.calls == 2
    assert error.status == 503 and error.retry_after >= 1


def test_no_restart_when_disabled_or_closed(tmp_path):
    async def scenario():
        disabled = Starter()
        first, replica, _, _, _ = _supervised(tmp_path / "a", disabled, max_restarts=0)
        first.kill()
        await until(lambda: replica.status == "down", LONG_WAIT, what="replica down")
        closed = Starter()
        before = set(threading.enumerate())
        second, other, _, _, _ = _supervised(tmp_path / "b", closed, max_restarts=3)
        (watcher,) = [t for t in set(threading.enumerate()) - before
                      if t.name.startswith("omni-supervise-")]
        other.close()
        other.release()  # shuts its engine down: the exit must not trigger a restart
        await until(lambda: not second.proc.is_alive(), LONG_WAIT, what="engine exited")
        # Its watcher thread saw the exit and ended; an exit it reported would be a
        # callback on this loop, run by the next iteration, that sets "starting" at once.
        await until(lambda: not watcher.is_alive(), LONG_WAIT, what="watcher thread ended")
        await asyncio.sleep(0)
        return disabled, closed, other

    disabled, closed, other = asyncio.run(scenario())
    assert disabled.calls == 0 and closed.calls == 0 and other.status == "down"


def test_task_on_an_engine_that_dies_fails_over_instead_of_hanging(tmp_path):
    async def scenario():
        starter = Starter()
        first, replica, pool, supervisor, up = _supervised(tmp_path, starter, max_restarts=3)
        running = asyncio.create_task(replica.run(StageTask("req", [1], {})))
        await until(lambda: "req" in replica.running, LONG_WAIT, what="task running")
        first.kill()
        with pytest.raises(ReplicaLost) as info:
            await asyncio.wait_for(running, LONG_WAIT)
        await asyncio.wait_for(up.wait(), LONG_WAIT)
        replica.close()
        replica.release()
        return info.value

    error = asyncio.run(scenario())
    assert not error.produced_output and "exit code -9" in str(error)


def test_stalled_engine_is_killed_and_restarted_and_its_task_fails_over(tmp_path):
    """SIGSTOP of the EngineCore with a task in flight: within the stall timeout the
    engine's processes are killed, the task fails over naming the stall (no output yet:
    the pool resubmits it), and the restarted engine is probed in turn."""
    async def scenario():
        starter = Starter()
        first, replica, pool, supervisor, up = _supervised(
            tmp_path, starter, max_restarts=3, stall_timeout=STALL_S)
        running = asyncio.create_task(replica.run(StageTask("req", [1], {})))
        await until(lambda: "req" in replica.running and first.probes_answered, LONG_WAIT,
                    what="task running and a probe answered")
        assert replica.stalls == 0 and replica.generation == 0
        os.kill(first.proc.pid, signal.SIGSTOP)
        with pytest.raises(ReplicaLost) as info:
            await asyncio.wait_for(running, STALL_S + LONG_WAIT)
        await asyncio.wait_for(up.wait(), LONG_WAIT)
        second = starter.engines[0]
        await until(lambda: second.probes_answered >= 2, LONG_WAIT,
                    what="two probes of the new engine answered")
        replica.close()
        replica.release()
        return first, replica, supervisor, info.value

    first, replica, supervisor, error = asyncio.run(scenario())
    assert first.proc.exitcode == -signal.SIGKILL
    assert not error.produced_output
    assert "stalled: its EngineCore answered no liveness probe for 10 s" in str(error)
    assert "with 1 request(s) in flight" in str(error)
    assert replica.stalls == 1 and supervisor.restarts == 1


def test_a_long_step_is_not_a_stall(tmp_path):
    """Probes answered after most of the stall timeout (one long engine step each: 6 s of
    10, so 4 s of lag on the host cannot make one late) never count as a stall."""
    async def scenario():
        slow = ProcessEngine(step_s=0.6 * STALL_S)
        _, replica, _, supervisor, _ = _supervised(tmp_path, Starter(), max_restarts=3,
                                                   stall_timeout=STALL_S, first=slow)
        await until(lambda: slow.probes_answered >= 2 or replica.stalls,
                    2 * STALL_S + LONG_WAIT, what="two slow probes answered (or a stall)")
        alive = slow.proc.is_alive()
        replica.close()
        replica.release()
        return replica, alive

    replica, alive = asyncio.run(scenario())
    assert alive and replica.stalls == 0 and replica.generation == 0


def test_a_resubmission_with_no_replica_left_names_the_stall(tmp_path):
    async def scenario():
        first, replica, pool, supervisor, up = _supervised(
            tmp_path, Starter(), max_restarts=0, stall_timeout=STALL_S)
        await until(lambda: first.probes_answered, LONG_WAIT, what="a probe answered")
        assert replica.stalls == 0
        os.kill(first.proc.pid, signal.SIGSTOP)
        with pytest.raises(NoReplicaAvailable) as info:
            await asyncio.wait_for(pool.run(StageTask("req", [1], {})), STALL_S + LONG_WAIT)
        replica.close()
        replica.release()
        return str(info.value)

    message = asyncio.run(scenario())
    assert "no replica available for stage 1" in message
    assert "after replica 0 was lost: stalled" in message


def test_the_stall_timeout_is_the_flags_else_the_stages_else_the_default():
    from vllm_omni_plugin.config.schema import RuntimeConfig
    from vllm_omni_plugin.config.settings import ClusterSettings

    def timeout(flag, own):
        stage = SimpleNamespace(runtime=RuntimeConfig(stall_timeout=own))
        return stall_timeout_of(stage, SimpleNamespace(cluster=ClusterSettings(
            stall_timeout=flag)))

    assert timeout(None, None) == DEFAULT_STALL_TIMEOUT_S == 120
    assert timeout(None, 600) == 600
    assert timeout(8, 600) == 8 and timeout(0, 600) == 0


# -- a headless replica's own stall watch (replicas/server.py) ---------------------------
def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_headless_replica_kills_its_stalled_engine_core_and_worker_and_stops(tmp_path):
    """A headless replica (``ReplicaServer``, its task channel and coordinator client real)
    probes its engine with a real StallWatch: SIGSTOP of the EngineCore makes it kill the
    EngineCore and its worker (collected before the kill), report ERROR to the head and end
    serving with the stall as the reason (``vllm serve --headless`` then exits non-zero)."""
    async def scenario():
        engine = ProcessEngine(with_worker=True)
        core = psutil.Process(engine.proc.pid)
        await until(lambda: len(core.children()) == 1, LONG_WAIT, what="the worker started")
        (worker,) = core.children()
        server = ReplicaServer(1, 0, engine, str(tmp_path / "run"), "tcp://127.0.0.1:*",
                               "tcp://127.0.0.1:9", 0, stall_timeout=STALL_S)
        serving = asyncio.ensure_future(server.serve())
        try:
            await until(lambda: engine.probes_answered, LONG_WAIT, what="a probe answered")
            assert not serving.done()
            os.kill(engine.proc.pid, signal.SIGSTOP)
            with pytest.raises(ReplicaLost) as info:
                await asyncio.wait_for(serving, STALL_S + LONG_WAIT)
            await until(lambda: _gone(core) and _gone(worker), LONG_WAIT,
                        what="EngineCore and worker gone")
            return info.value, server.coord.status
        finally:
            serving.cancel()
            server.close()

    error, status = asyncio.run(scenario())
    assert "stalled: its EngineCore answered no liveness probe for 10 s" in str(error)
    assert not error.produced_output and status == ReplicaStatus.ERROR
