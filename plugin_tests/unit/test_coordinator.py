"""OmniCoordinator, its stage/hub clients and the load balancers.

Real ZMQ sockets on 127.0.0.1 and real threads; nothing is mocked but, in the
heartbeat-timeout and purge tests, the coordinator's monotonic clock, which those tests
set themselves (:class:`CoordinatorClock`): a timeout there is decided by the time the
test chose, not by how late a loaded host ran a thread. Waits are for a condition, with
generous bounds (``LONG_WAIT``), because the CI machines are small and shared.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from plugin_tests.helpers import LONG_WAIT, WAIT, wait_until
from vllm_omni_plugin.coordinator import (
    CLUSTER_TOKEN_ENV,
    PROTOCOL_VERSION,
    EventType,
    LeastQueueLengthBalancer,
    LoadBalancer,
    LoadBalancingPolicy,
    OmniCoordClientForHub,
    OmniCoordClientForStage,
    OmniCoordinator,
    OmniCoordinatorRuntime,
    RandomBalancer,
    ReplicaEvent,
    ReplicaInfo,
    ReplicaList,
    ReplicaStatus,
    RoundRobinBalancer,
    build_load_balancer_factory,
    cluster_token_from_env,
    omni_coordinator,
)

pytestmark = pytest.mark.timeout(60)

LOCAL = "tcp://127.0.0.1:0"


def hub_wait(hub: OmniCoordClientForHub, pred: Callable[[ReplicaList], bool]) -> bool:
    return hub.wait_for_update(pred, timeout=LONG_WAIT)


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch):
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as es:
        yield es


def make_coordinator(stack: contextlib.ExitStack, **kw) -> OmniCoordinator:
    kw.setdefault("heartbeat_timeout", 5.0)
    coord = OmniCoordinator(LOCAL, LOCAL, **kw)
    stack.callback(coord.close)
    return coord


def make_hub(stack: contextlib.ExitStack, coord: OmniCoordinator, **kw) -> OmniCoordClientForHub:
    hub = OmniCoordClientForHub(coord.pub_zmq_addr, **kw)
    stack.callback(hub.close)
    return hub


def make_stage(
    stack: contextlib.ExitStack, coord: OmniCoordinator, name: str, stage_id: int, **kw
) -> OmniCoordClientForStage:
    kw.setdefault("heartbeat_interval", None)
    client = OmniCoordClientForStage(
        coord.router_zmq_addr, f"ipc:///tmp/{name}-in", f"ipc:///tmp/{name}-out", stage_id, **kw
    )
    stack.callback(client.close)
    return client


def status_of(coord: OmniCoordinator, name: str) -> ReplicaStatus | None:
    for rep in coord.get_all_replicas().replicas:
        if rep.input_addr == f"ipc:///tmp/{name}-in":
            return rep.status
    return None


def hub_queue(hub: OmniCoordClientForHub, name: str) -> int | None:
    for rep in hub.get_replica_list().replicas:
        if rep.input_addr == f"ipc:///tmp/{name}-in":
            return rep.queue_length
    return None


# --------------------------------------------------------------------- wire


def test_wire_schema_is_tagged_versioned_msgpack():
    event = ReplicaEvent("tcp://h:1", "tcp://h:2", 3, ReplicaStatus.UP, 4, EventType.HEARTBEAT)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(event))
    assert raw == {
        "type": "replica_event",
        "input_addr": "tcp://h:1",
        "output_addr": "tcp://h:2",
        "stage_id": 3,
        "status": "up",
        "queue_length": 4,
        "event_type": "heartbeat",
        "protocol_version": PROTOCOL_VERSION,
    }
    lst = ReplicaList(
        replicas=[ReplicaInfo("a", "b", 0, ReplicaStatus.UP, 1, 2.0, 1.0)], timestamp=5.0, seq=7
    )
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(lst))
    assert raw["type"] == "replica_list" and raw["protocol_version"] == PROTOCOL_VERSION
    assert raw["replicas"][0]["queue_length"] == 1 and raw["seq"] == 7


# --------------------------------------------------------- registration / load


def test_register_heartbeat_queue_length_drives_least_queue(stack):
    coord = make_coordinator(stack, republish_interval=0.5)
    hub = make_hub(stack, coord)
    loads = {"a": 0, "b": 0, "c": 0}
    for name, stage in (("a", 0), ("b", 0), ("c", 1)):
        make_stage(
            stack, coord, name, stage,
            heartbeat_interval=0.05, queue_length_provider=lambda n=name: loads[n],
        )
    assert hub_wait(hub, lambda rl: len(rl.replicas) == 3), hub.get_replica_list()
    s0 = hub.get_replicas_for_stage(0).replicas
    s1 = hub.get_replicas_for_stage(1).replicas
    assert sorted(r.input_addr for r in s0) == ["ipc:///tmp/a-in", "ipc:///tmp/b-in"]
    assert [r.input_addr for r in s1] == ["ipc:///tmp/c-in"]
    assert all(r.status is ReplicaStatus.UP for r in s0 + s1)
    assert [r.output_addr for r in s1] == ["ipc:///tmp/c-out"]
    assert hub.get_replicas_for_stage(7).replicas == []

    # Only heartbeats carry the new load (no update_info): the coordinator must use it.
    lb = LeastQueueLengthBalancer(seed=0)
    for want, (qa, qb) in (("b", (5, 1)), ("a", (0, 9))):
        loads["a"], loads["b"] = qa, qb
        assert wait_until(
            lambda qa=qa, qb=qb: (hub_queue(hub, "a"), hub_queue(hub, "b")) == (qa, qb)
        )
        replicas = hub.get_replicas_for_stage(0).replicas
        picks = {replicas[lb.select({"request_id": str(i)}, replicas)].input_addr
                 for i in range(50)}
        assert picks == {f"ipc:///tmp/{want}-in"}
    stats = coord.stats
    assert stats["events_accepted"] >= 6 and stats["internal_errors"] == 0
    assert sum(v for k, v in stats.items() if k.startswith("rejected.")) == 0


def test_update_info_is_sent_immediately_and_validated(stack):
    coord = make_coordinator(stack, republish_interval=5.0)
    hub = make_hub(stack, coord)
    client = make_stage(stack, coord, "u", 2)  # no heartbeat thread
    assert wait_until(lambda: hub_queue(hub, "u") == 0)
    client.update_info(queue_length=11)
    assert wait_until(lambda: hub_queue(hub, "u") == 11)
    client.update_info(status="down")
    assert wait_until(lambda: status_of(coord, "u") is ReplicaStatus.DOWN)
    assert wait_until(lambda: hub_queue(hub, "u") is None)
    client.update_info(status=ReplicaStatus.UP, queue_length=2)
    assert wait_until(lambda: hub_queue(hub, "u") == 2)
    with pytest.raises(ValueError):
        client.update_info()
    with pytest.raises(ValueError):
        client.update_info(queue_length=-1)
    with pytest.raises(ValueError):
        client.update_info(status="sleeping")
    with pytest.raises(ValueError):
        OmniCoordClientForStage(coord.router_zmq_addr, "x", "y", -1, heartbeat_interval=None)


# ----------------------------------------------------------------- liveness


class CoordinatorClock:
    """The coordinator's monotonic clock, set by the test (its wall clock stays real).

    Heartbeat timeouts and purges then happen at the times the test sets, however late
    the host runs the coordinator's thread: a heartbeat the test waited for is never
    late, and a check the test waited for has run. The clock only ever moves by more than
    the liveness check interval, so that :meth:`advance_to` can tell the check at the new
    time from an earlier one.
    """

    def __init__(self, monkeypatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(omni_coordinator, "time",
                            SimpleNamespace(monotonic=lambda: self.now, time=time.time))

    def advance_to(self, coord: OmniCoordinator, now: float) -> None:
        """Set the clock to ``now``; return once the coordinator has run its liveness check
        (timeouts, purges) at ``now``."""
        assert now - self.now > coord._check_interval
        self.now = now
        # The poller loop sets its next check to (the time of this check) + interval.
        assert wait_until(lambda: coord._next_check > now, LONG_WAIT), \
            f"no liveness check at t={now} within {LONG_WAIT:g} s"


def info_of(coord: OmniCoordinator, name: str) -> ReplicaInfo:
    (info,) = [r for r in coord.get_all_replicas().replicas
               if r.input_addr == f"ipc:///tmp/{name}-in"]
    return info


def seen_since(coord: OmniCoordinator, name: str, wall: float) -> None:
    """Wait until the coordinator has applied an event of ``name`` that came after the
    wall-clock time ``wall`` (its ``last_heartbeat`` is the wall time it was applied)."""
    assert wait_until(lambda: info_of(coord, name).last_heartbeat > wall, LONG_WAIT), \
        f"no event from replica {name!r} applied within {LONG_WAIT:g} s"


def published(coord: OmniCoordinator, hub: OmniCoordClientForHub,
              pred: Callable[[], bool]) -> bool:
    """Publish the list until the hub shows ``pred`` (a test clock holds the timed
    publishes back)."""
    return wait_until(lambda: coord.publish_replica_list_update() and pred(), LONG_WAIT)


def test_heartbeat_timeout_marks_error_and_heartbeat_recovers(stack, monkeypatch):
    """Heartbeats keep a replica UP past the timeout; silence of the timeout, and not
    less, marks it ERROR; a heartbeat brings it back. Coordinator time is the test's
    (:class:`CoordinatorClock`), so lag on the host cannot move a heartbeat past the
    timeout or a check before it."""
    clock = CoordinatorClock(monkeypatch)
    coord = make_coordinator(stack, heartbeat_timeout=10.0, liveness_check_interval=0.05)
    hub = make_hub(stack, coord)
    manual = make_stage(stack, coord, "m", 0)  # heartbeats only when we call heartbeat()
    threaded = make_stage(stack, coord, "t", 0, heartbeat_interval=0.05)
    threaded.queue_length_provider = lambda: 3  # settable after construction
    assert published(coord, hub, lambda: len(hub.get_replica_list().replicas) == 2)

    def advance_to(now: float) -> None:
        """The clock to ``now`` (its liveness check run); then a heartbeat of the manual
        replica and one of the threaded replica's own, both applied at ``now``."""
        clock.advance_to(coord, now)
        wall = time.time()
        manual.heartbeat()
        seen_since(coord, "m", wall)
        seen_since(coord, "t", wall)

    for now in (1004.0, 1008.0, 1012.0, 1016.0):  # 16 s of heartbeats every 4 s
        advance_to(now)
        assert status_of(coord, "m") is ReplicaStatus.UP, f"t={now}"  # past the timeout
    # Heartbeats stop (the last one applied at 1016).
    clock.advance_to(coord, 1025.0)  # silent 9 s: not yet
    assert status_of(coord, "m") is ReplicaStatus.UP
    seen_since(coord, "t", time.time())  # the threaded replica's heartbeats go on
    clock.advance_to(coord, 1027.0)  # silent 11 s
    assert status_of(coord, "m") is ReplicaStatus.ERROR
    assert published(coord, hub, lambda: hub_queue(hub, "m") is None)  # leaves the list
    assert coord.stats["replicas_timed_out"] == 1

    manual.heartbeat()  # comes back
    assert wait_until(lambda: status_of(coord, "m") is ReplicaStatus.UP, LONG_WAIT)
    assert published(coord, hub, lambda: hub_queue(hub, "m") == 0)
    assert coord.stats["replicas_recovered"] == 1
    # The background heartbeat thread kept the other replica UP the whole time.
    assert status_of(coord, "t") is ReplicaStatus.UP
    assert hub_queue(hub, "t") == 3
    assert coord.stats["replicas_timed_out"] == 1


def test_graceful_close_marks_down_and_leaves_active_list(stack):
    coord = make_coordinator(stack)
    hub = make_hub(stack, coord)
    stay = make_stage(stack, coord, "stay", 0, heartbeat_interval=0.05)
    leave = make_stage(stack, coord, "leave", 0, heartbeat_interval=0.05)
    assert hub_wait(hub, lambda rl: len(rl.replicas) == 2)
    leave.close()
    leave.close()  # idempotent
    assert wait_until(lambda: status_of(coord, "leave") is ReplicaStatus.DOWN, LONG_WAIT)
    assert hub_wait(hub, lambda rl: [r.input_addr for r in rl.replicas] == ["ipc:///tmp/stay-in"])
    assert [r.input_addr for r in coord.get_active_replicas().replicas] == ["ipc:///tmp/stay-in"]
    with pytest.raises(RuntimeError):
        leave.update_info(queue_length=1)
    with pytest.raises(RuntimeError):
        leave.heartbeat()
    # No late heartbeat from the closed client resurrects it: its heartbeat thread ended
    # with close(), and it sends (or tries to send) nothing more while the coordinator
    # goes on applying the other replica's heartbeats, sent after the close.
    assert leave._thread is not None and not leave._thread.is_alive()
    tries = leave.stats["events_sent"] + leave.stats["events_dropped"]
    for _ in range(3):
        seen_since(coord, "stay", time.time())
    assert leave.stats["events_sent"] + leave.stats["events_dropped"] == tries
    assert status_of(coord, "leave") is ReplicaStatus.DOWN
    assert stay.status is ReplicaStatus.UP


def test_down_and_error_replicas_are_purged(stack, monkeypatch):
    """A silent replica turns ERROR after the heartbeat timeout; DOWN and ERROR replicas
    are forgotten once silent for ``purge_after``, not before (coordinator time is the
    test's: :class:`CoordinatorClock`)."""
    clock = CoordinatorClock(monkeypatch)
    coord = make_coordinator(
        stack, heartbeat_timeout=10.0, liveness_check_interval=0.05, purge_after=20.0
    )
    gone = make_stage(stack, coord, "gone", 0)
    make_stage(stack, coord, "silent", 0)
    assert wait_until(lambda: status_of(coord, "gone") is ReplicaStatus.UP, LONG_WAIT)
    assert wait_until(lambda: status_of(coord, "silent") is ReplicaStatus.UP, LONG_WAIT)
    gone.close()  # DOWN at t=1000
    assert wait_until(lambda: status_of(coord, "gone") is ReplicaStatus.DOWN, LONG_WAIT)
    clock.advance_to(coord, 1011.0)
    assert status_of(coord, "silent") is ReplicaStatus.ERROR
    clock.advance_to(coord, 1019.0)  # both silent 19 s: still known
    assert (status_of(coord, "gone"), status_of(coord, "silent")) == (
        ReplicaStatus.DOWN, ReplicaStatus.ERROR)
    assert coord.stats["replicas_purged"] == 0
    clock.advance_to(coord, 1021.0)
    assert coord.get_all_replicas().replicas == []
    assert coord.stats["replicas_purged"] == 2


def test_in_process_registry_api(stack):
    coord = make_coordinator(stack)
    ev = ReplicaEvent("tcp://r:1", "tcp://r:2", 0, ReplicaStatus.UP, 3, EventType.UPDATE)
    with pytest.raises(KeyError):
        coord.update_replica_info(ev)
    coord.add_new_replica(ev)
    coord.update_replica_info(msgspec.structs.replace(ev, queue_length=4))
    assert [r.queue_length for r in coord.get_active_replicas().replicas] == [4]
    coord.remove_replica(ev)
    assert coord.get_active_replicas().replicas == []
    assert [r.status for r in coord.get_all_replicas().replicas] == [ReplicaStatus.DOWN]
    assert coord.publish_replica_list_update() is True


# ---------------------------------------------------------------- publishing


def test_broadcasts_are_coalesced_to_one_per_100ms(stack):
    coord = make_coordinator(stack, publish_min_interval=0.1, republish_interval=30.0)
    hub = make_hub(stack, coord)
    client = make_stage(stack, coord, "burst", 0)
    assert wait_until(lambda: hub_queue(hub, "burst") == 0)
    p0 = coord.stats["publishes"]
    t0 = time.monotonic()
    n = 300
    for i in range(1, n + 1):  # ~300 changes in ~1 s
        client.update_info(queue_length=i)
        time.sleep(0.003)
    assert wait_until(lambda: hub_queue(hub, "burst") == n)  # trailing edge delivered
    elapsed = time.monotonic() - t0
    publishes = coord.stats["publishes"] - p0
    assert coord.stats["events_accepted"] >= n
    assert 2 <= publishes <= elapsed / 0.1 + 2, (publishes, elapsed)
    time.sleep(0.25)
    assert coord.stats["publishes"] - p0 == publishes  # nothing pending once quiet


def test_late_subscriber_converges_via_periodic_republish(stack):
    coord = make_coordinator(stack, republish_interval=0.3)
    make_stage(stack, coord, "early", 4)
    assert wait_until(lambda: coord.stats["publishes"] >= 2)  # the UP change went out
    events = coord.stats["events_accepted"]
    seen: list[int] = []
    # subscribes after the change was published
    hub = make_hub(stack, coord, on_update=lambda rl: seen.append(len(rl.replicas)))
    assert hub_wait(hub, lambda rl: len(rl.replicas) == 1)
    assert seen and seen[-1] == 1
    assert hub.get_replicas_for_stage(4).replicas[0].input_addr == "ipc:///tmp/early-in"
    assert coord.stats["events_accepted"] == events  # converged without any new event
    assert hub.seconds_since_update < WAIT


# ------------------------------------------------------------------ security


def test_cluster_token_rejects_wrong_and_missing(stack, monkeypatch):
    coord = make_coordinator(stack, cluster_token="s3cret")
    hub = make_hub(stack, coord, cluster_token="s3cret")
    wrong_hub = make_hub(stack, coord, cluster_token="not-it")
    make_stage(stack, coord, "wrong", 0, cluster_token="nope")
    make_stage(stack, coord, "missing", 0, cluster_token="")
    make_stage(stack, coord, "right", 0, cluster_token="s3cret")
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "s3cret")
    assert cluster_token_from_env() == "s3cret"
    make_stage(stack, coord, "from-env", 0)  # cluster_token=None reads the environment

    assert hub_wait(hub, lambda rl: len(rl.replicas) == 2)
    assert wait_until(lambda: coord.stats["rejected.bad_token"] == 2)
    assert sorted(r.input_addr for r in hub.get_replica_list().replicas) == [
        "ipc:///tmp/from-env-in", "ipc:///tmp/right-in"]
    assert status_of(coord, "wrong") is None and status_of(coord, "missing") is None
    # Broadcasts are signed too: a hub with another token drops them.
    assert wait_until(lambda: wrong_hub.stats["rejected.bad_token"] >= 1)
    assert wrong_hub.get_replica_list().replicas == []
    assert wrong_hub.stats["lists_accepted"] == 0


# ------------------------------------------------------------------ lifecycle


def test_runtime_binds_given_host_and_closes_cleanly():
    threads_before = threading.active_count()
    rt = OmniCoordinatorRuntime(host="127.0.0.1", heartbeat_timeout=1.0)
    assert rt.router_address.startswith("tcp://127.0.0.1:")
    assert rt.pub_address.startswith("tcp://127.0.0.1:")
    assert not hasattr(rt, "coordinator") and not hasattr(rt, "_coordinator_public")
    hub = OmniCoordClientForHub(rt.pub_address)
    client = OmniCoordClientForStage(rt.router_address, "tcp://z:1", "tcp://z:2", 0,
                                     heartbeat_interval=0.05)
    assert hub_wait(hub, lambda rl: len(rl.replicas) == 1)
    client.close()
    hub.close()
    router, pub = rt.router_address, rt.pub_address
    rt.close()
    rt.close()  # idempotent
    assert wait_until(lambda: threading.active_count() <= threads_before, LONG_WAIT)
    # The ports are free again: sockets were really closed.
    again = OmniCoordinator(router, pub, heartbeat_timeout=1.0)
    assert (again.router_zmq_addr, again.pub_zmq_addr) == (router, pub)
    again.close()
    with pytest.raises(ValueError):
        OmniCoordinatorRuntime(host="", heartbeat_timeout=1.0)
    with pytest.raises(ValueError):
        OmniCoordinatorRuntime(host="127.0.0.1", heartbeat_timeout=0)


def test_bind_failure_raises_and_leaks_nothing(stack):
    coord = make_coordinator(stack)
    threads_before = threading.active_count()
    with pytest.raises(zmq.ZMQError):
        OmniCoordinator(coord.router_zmq_addr, LOCAL)  # port already taken
    assert threading.active_count() == threads_before


# ----------------------------------------------------------------- balancers


def _reps(*queues: int) -> list[ReplicaInfo]:
    return [ReplicaInfo(f"tcp://r:{i}", "o", 0, ReplicaStatus.UP, q, 0.0, 0.0)
            for i, q in enumerate(queues)]


def test_random_balancer_is_roughly_uniform():
    lb = RandomBalancer(seed=1)
    reps = _reps(*[0] * 6)
    counts = collections.Counter(lb.select({}, reps) for _ in range(6000))
    assert set(counts) == set(range(6))
    assert all(800 <= c <= 1200 for c in counts.values()), counts


def test_round_robin_cycles_and_is_thread_safe():
    lb = RoundRobinBalancer()
    reps = _reps(0, 0, 0, 0)
    assert [lb.select({}, reps) for _ in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert lb.select({}, reps[:3]) == 1  # modulo the current length
    assert RoundRobinBalancer(start_index=2).select({}, reps) == 2

    lb = RoundRobinBalancer()
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def work():
        local = collections.Counter(lb.select({}, reps) for _ in range(1000))
        with lock:
            counts.update(local)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == {0: 1000, 1: 1000, 2: 1000, 3: 1000}


def test_least_queue_picks_minimum_with_random_ties():
    lb = LeastQueueLengthBalancer(seed=3)
    assert lb.select({}, _reps(4, 2, 9)) == 1
    assert lb.select({}, _reps(0)) == 0
    reps = _reps(3, 1, 5, 1, 1, 2)
    counts = collections.Counter(lb.select({}, reps) for _ in range(3000))
    assert set(counts) == {1, 3, 4}
    assert all(800 <= c <= 1200 for c in counts.values()), counts


@pytest.mark.parametrize("lb", [RandomBalancer(), RoundRobinBalancer(), LeastQueueLengthBalancer()])
def test_balancers_reject_empty(lb: LoadBalancer):
    with pytest.raises(ValueError):
        lb.select({}, [])


@pytest.mark.parametrize("queues", [(-1, 2, 3), (2, -1, 3), (2, 3, -1), (-1,), (-2, -2)])
def test_least_queue_rejects_negative_queue_length(queues):
    with pytest.raises(ValueError):
        LeastQueueLengthBalancer().select({}, _reps(*queues))


def test_build_load_balancer_factory():
    cases = {
        "random": RandomBalancer,
        "round-robin": RoundRobinBalancer,
        "least-queue-length": LeastQueueLengthBalancer,
        "ROUND_ROBIN": RoundRobinBalancer,
        " least_queue_length ": LeastQueueLengthBalancer,
        LoadBalancingPolicy.RANDOM: RandomBalancer,
    }
    for policy, cls in cases.items():
        factory = build_load_balancer_factory(policy)
        a, b = factory(), factory()
        assert type(a) is cls and a is not b
    with pytest.raises(ValueError, match="least-queue-length"):
        build_load_balancer_factory("fastest")


# --------------------------------------------------------------------- IPv6


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback in this sandbox")
def test_stage_and_hub_clients_reach_an_ipv6_coordinator(stack):
    coord = OmniCoordinator("tcp://[::1]:0", "tcp://[::1]:0", heartbeat_timeout=5.0)
    stack.callback(coord.close)
    hub = make_hub(stack, coord)
    make_stage(stack, coord, "v6", 2)
    assert hub_wait(hub, lambda lst: any(r.stage_id == 2 for r in lst.replicas))


# ------------------------------------------------- balancer fast paths (added)


def test_least_queue_recomputes_for_a_new_list_object():
    lb = LeastQueueLengthBalancer(seed=5)
    first = _reps(3, 1, 5)
    assert {lb.select({}, first) for _ in range(20)} == {1}
    # A new list of the same length (a new hub snapshot) is scanned again, even
    # when the cached pick still holds the cached minimum there.
    second = _reps(0, 1, 4)
    assert {lb.select({}, second) for _ in range(20)} == {0}
    # Equal contents, new object: still correct; and the old list still works.
    third = _reps(9, 9, 2)
    assert {lb.select({}, third) for _ in range(20)} == {2}
    assert {lb.select({}, first) for _ in range(20)} == {1}
    # Ties of a new list are uniform, not carried over from the previous one.
    ties = _reps(1, 0, 0, 7, 0)
    counts = collections.Counter(lb.select({}, ties) for _ in range(3000))
    assert set(counts) == {1, 2, 4}
    assert all(800 <= c <= 1200 for c in counts.values()), counts
    idle = _reps(0, 0, 0)  # every replica ties
    counts = collections.Counter(lb.select({}, idle) for _ in range(3000))
    assert set(counts) == {0, 1, 2}
    assert all(800 <= c <= 1200 for c in counts.values()), counts


def test_least_queue_cache_is_not_fooled_by_recycled_list_ids():
    # Temporary lists are freed after the call; CPython then tends to reuse the
    # address (the id) for the next list. The cache holds its list, so it can't.
    # In the odd lists, the even lists' pick still holds the even lists' minimum
    # (so the cheap guard passes) but is not the minimum.
    lb = LeastQueueLengthBalancer(seed=7)
    picks = [lb.select({}, _reps(*([2, 0, 5, 5] if k % 2 else [2, 5, 5, 5])))
             for k in range(200)]
    assert picks == [k % 2 for k in range(200)]


def test_least_queue_cache_guards_catch_mutation():
    # Mutation is outside the contract; the cheap guards still catch these cases.
    lb = LeastQueueLengthBalancer(seed=6)
    reps = _reps(2, 0, 3)
    assert lb.select({}, reps) == 1
    reps.append(ReplicaInfo("tcp://r:new", "o", 0, ReplicaStatus.UP, 0, 0.0, 0.0))
    assert {lb.select({}, reps) for _ in range(200)} == {1, 3}  # length changed
    reps[1].queue_length = 5
    assert {lb.select({}, reps) for _ in range(20)} == {3}  # chosen one's queue changed
    reps.clear()
    with pytest.raises(ValueError):
        lb.select({}, reps)


def test_least_queue_rejects_negative_on_every_call_and_is_not_cached():
    lb = LeastQueueLengthBalancer()
    bad = _reps(1, -1, 0)
    for _ in range(3):
        with pytest.raises(ValueError):
            lb.select({}, bad)
    assert lb.select({}, _reps(1, 0)) == 1


def test_least_queue_is_thread_safe_across_list_swaps():
    lb = LeastQueueLengthBalancer(seed=8)
    lists = [_reps(*[(i + k) % 5 for i in range(10)]) for k in range(5)]
    wrong: list[tuple[int, int]] = []

    def work(k0: int) -> None:
        for j in range(2000):
            reps = lists[(k0 + j) % len(lists)]
            idx = lb.select({}, reps)
            if reps[idx].queue_length != 0:
                wrong.append((k0, idx))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def _round_robin_reference(start: int, lengths: list[int]) -> list[int]:
    """The previous lock-based RoundRobinBalancer, for comparison."""
    nxt, out = start, []
    for n in lengths:
        idx = nxt % n
        nxt = idx + 1
        out.append(idx)
    return out


@pytest.mark.parametrize("start", [0, 1, 7])
def test_round_robin_matches_previous_rotation_when_length_changes(start):
    import random

    r = random.Random(start)
    lengths: list[int] = []
    for _ in range(60):  # runs of equal lengths with changes in between
        n = r.randint(1, 9)
        lengths += [n] * r.randint(1, 12)
    lb = RoundRobinBalancer(start_index=start)
    got = [lb.select({}, _reps(*[0] * n)) for n in lengths]
    assert got == _round_robin_reference(start, lengths)


def _round_robin_from_threads(lb: RoundRobinBalancer, n: int, threads: int,
                              calls: int) -> collections.Counter:
    reps = _reps(*[0] * n)
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    barrier = threading.Barrier(threads)

    def work():
        barrier.wait()  # all threads make their first calls together
        local = collections.Counter(lb.select({}, reps) for _ in range(calls))
        with lock:
            counts.update(local)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return counts


def test_round_robin_first_calls_from_many_threads_stay_fair():
    for _ in range(20):
        counts = _round_robin_from_threads(RoundRobinBalancer(start_index=3), 5, 4, 250)
        assert counts == {i: 200 for i in range(5)}


def test_random_balancer_is_seeded_and_in_range():
    a, b = RandomBalancer(seed=42), RandomBalancer(seed=42)
    for n in (1, 2, 3, 7, 64, 513):
        reps = _reps(*[0] * n)
        picks = [a.select({}, reps) for _ in range(200)]
        assert picks == [b.select({}, reps) for _ in range(200)]
        assert all(0 <= p < n for p in picks)
    assert {RandomBalancer().select({}, _reps(0, 0)) for _ in range(200)} == {0, 1}
