"""Hostile frames on the coordinator's sockets: every one is dropped and counted.

Real ZMQ sockets; a raw DEALER (or PUB, for the hub client) sends the frames.
``hypothesis`` is not in the project environment, so the generated cases come
from seeded ``random.Random`` loops with fixed counts (reproducible, bounded).
After each barrage a valid event must still be processed.
"""

from __future__ import annotations

import os
import pickle
import random
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from plugin_tests.helpers import LONG_WAIT, dealer, wait_until
from vllm_omni_plugin.coordinator import (
    MAX_EVENT_FRAME_BYTES,
    MAX_LIST_FRAME_BYTES,
    EventType,
    OmniCoordClientForHub,
    OmniCoordinator,
    RejectReason,
    ReplicaEvent,
    ReplicaInfo,
    ReplicaList,
    ReplicaStatus,
)
from vllm_omni_plugin.wire.auth import MAC_BYTES, sign
from vllm_omni_plugin.wire.sockets import ROUTER_HARD_MAX_BYTES

pytestmark = pytest.mark.timeout(60)

LOCAL = "tcp://127.0.0.1:0"


def event_bytes(addr: str = "tcp://ok:1", **changes) -> bytes:
    ev = ReplicaEvent(addr, "tcp://ok:2", 0, ReplicaStatus.UP, 1, EventType.UPDATE)
    return msgspec.msgpack.encode(msgspec.structs.replace(ev, **changes))


def event_dict(**changes) -> dict:
    d = msgspec.msgpack.decode(event_bytes())
    d.update(changes)
    return d


def rejected(stats: dict[str, int]) -> dict[str, int]:
    return {k.removeprefix("rejected."): v for k, v in stats.items()
            if k.startswith("rejected.") and v}


@pytest.fixture
def coord() -> Iterator[OmniCoordinator]:
    c = OmniCoordinator(LOCAL, LOCAL, heartbeat_timeout=30.0)
    yield c
    c.close()


def registered(coord: OmniCoordinator, addr: str) -> bool:
    return any(r.input_addr == addr for r in coord.get_all_replicas().replicas)


def test_each_bad_frame_is_rejected_with_its_reason(coord, zctx, tmp_path):
    sock = dealer(zctx, coord.router_zmq_addr)
    rng = random.Random(20240601)
    expected: dict[str, int] = {}

    def send(parts, reason: RejectReason) -> None:
        sock.send_multipart(parts)
        expected[reason.value] = expected.get(reason.value, 0) + 1

    # Random bytes (including the empty frame).
    for _ in range(300):
        send([rng.randbytes(rng.randrange(0, 256))], RejectReason.MALFORMED)
    # Every truncation of a valid frame.
    good = event_bytes()
    for cut in range(1, len(good)):
        send([good[:cut]], RejectReason.MALFORMED)
    send([good + b"\x00"], RejectReason.MALFORMED)  # trailing byte
    # Pickle is never unpickled (this one would create a file if it were).
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for proto in (0, 2, 5):
        send([pickle.dumps(Evil(), protocol=proto)], RejectReason.MALFORMED)
    send([msgspec.msgpack.encode([1, 2, 3])], RejectReason.MALFORMED)  # not a map
    send([b"\x91" * 4000 + b"\x00"], RejectReason.MALFORMED)  # deep nesting
    header = msgspec.msgpack.encode({"type": "replica_event", "protocol_version": 1})
    send([b"\x83" + header[1:] + b"\xa1z" + b"\x91" * 3900 + b"\x00"],  # RecursionError
         RejectReason.MALFORMED)
    send([b"\x82\xa4type\xa3\xff\xfe\xfd\xb0protocol_version\x01"],  # bad UTF-8
         RejectReason.MALFORMED)
    send([good.replace(b"tcp://ok:1", b"tcp://\xff\xfe:1")], RejectReason.INVALID)
    send([msgspec.msgpack.encode({"type": 5, "protocol_version": 1})], RejectReason.MALFORMED)
    send([msgspec.msgpack.encode({"type": "replica_event"})], RejectReason.MALFORMED)
    # Oversize, valid or not, is rejected before decoding.
    send([b"\x00" * (MAX_EVENT_FRAME_BYTES + 1)], RejectReason.OVERSIZE)
    send([event_bytes(addr="tcp://" + "x" * MAX_EVENT_FRAME_BYTES)], RejectReason.OVERSIZE)
    send([rng.randbytes(ROUTER_HARD_MAX_BYTES // 2)], RejectReason.OVERSIZE)
    # Wrong protocol version.
    for version in (0, 2, 999, -1):
        send([event_bytes(protocol_version=version)], RejectReason.BAD_VERSION)
    # Unknown message types (a replica list is not an event).
    send([msgspec.msgpack.encode(event_dict(type="evil"))], RejectReason.UNKNOWN_TYPE)
    send([msgspec.msgpack.encode(ReplicaList(replicas=[], timestamp=1.0))],
         RejectReason.UNKNOWN_TYPE)
    send([msgspec.msgpack.encode({"type": "", "protocol_version": 1})],
         RejectReason.UNKNOWN_TYPE)
    # Known type, bad fields.
    for bad in ({"stage_id": -1}, {"queue_length": -5}, {"status": "zombie"},
                {"event_type": "reboot"}, {"input_addr": ""}, {"stage_id": "zero"},
                {"output_addr": "y" * 600}, {"queue_length": 2**63}):
        send([msgspec.msgpack.encode(event_dict(**bad))], RejectReason.INVALID)
    missing = event_dict()
    del missing["output_addr"]
    send([msgspec.msgpack.encode(missing)], RejectReason.INVALID)
    # Wrong number of parts (ROUTER adds the identity: 3 and 4 parts here are 4 and 5 there).
    send([good, b"a", b"b"], RejectReason.BAD_ENVELOPE)
    send([good, b"a", b"b", b"c"], RejectReason.BAD_ENVELOPE)

    total = sum(expected.values())
    sock.send(event_bytes(addr="tcp://after:1"))
    assert wait_until(lambda: registered(coord, "tcp://after:1")), coord.stats
    stats = coord.stats
    assert rejected(stats) == expected
    assert stats["frames_received"] == total + 1
    assert stats["events_accepted"] == 1
    assert stats["internal_errors"] == 0
    assert [r.input_addr for r in coord.get_all_replicas().replicas] == ["tcp://after:1"]
    assert not marker.exists()


def test_random_mutations_are_accounted_and_survived(coord, zctx):
    sock = dealer(zctx, coord.router_zmq_addr)
    rng = random.Random(7)
    good = bytearray(event_bytes())
    n = 400
    for _ in range(n):
        frame = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        if rng.random() < 0.2:
            frame = frame[: rng.randrange(len(frame))] + rng.randbytes(rng.randrange(8))
        sock.send(bytes(frame))
    sock.send(event_bytes(addr="tcp://sentinel:1"))
    assert wait_until(lambda: registered(coord, "tcp://sentinel:1")), coord.stats
    stats = coord.stats
    assert stats["frames_received"] == n + 1
    assert stats["events_accepted"] + sum(rejected(stats).values()) == n + 1
    assert sum(rejected(stats).values()) > n // 2  # most mutations must be caught
    assert stats["internal_errors"] == 0


def test_frame_over_hard_cap_is_dropped_by_zmq_and_coordinator_survives(coord, zctx):
    big = dealer(zctx, coord.router_zmq_addr)
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        big.send(b"\x81" + b"\x00" * (ROUTER_HARD_MAX_BYTES + 1024))
        # libzmq drops the connection of a peer sending over MAXMSGSIZE, frame unread.
        assert monitor.poll(LONG_WAIT * 1000), "the oversized frame's connection was not dropped"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        big.disable_monitor()
        monitor.close(linger=0)
    sock = dealer(zctx, coord.router_zmq_addr)
    sock.send(event_bytes(addr="tcp://fine:1"))
    assert wait_until(lambda: registered(coord, "tcp://fine:1"), LONG_WAIT)
    assert coord.stats["frames_received"] == 1  # the big frame never reached the coordinator
    assert coord.stats["events_accepted"] == 1
    assert coord.stats["internal_errors"] == 0


def test_bad_signatures_are_rejected(zctx):
    coord = OmniCoordinator(LOCAL, LOCAL, cluster_token="k3y")
    try:
        sock = dealer(zctx, coord.router_zmq_addr)
        rng = random.Random(3)
        good = event_bytes()
        cases = [
            [good],  # missing
            [good, rng.randbytes(MAC_BYTES)],  # random
            [good, sign(b"k3y", good)[:-1]],  # truncated
            [good, sign(b"k3y", good) + b"\x00"],  # too long
            [good, sign(b"other", good)],  # other key
            [good, sign(b"k3y", event_bytes(addr="tcp://else:1"))],  # other payload
            [good, b""],
        ]
        for parts in cases:
            sock.send_multipart(parts)
        payload = event_bytes(addr="tcp://signed:1")
        sock.send_multipart([payload, sign(b"k3y", payload)])
        assert wait_until(lambda: registered(coord, "tcp://signed:1"))
        stats = coord.stats
        assert rejected(stats) == {"bad_token": len(cases)}
        assert stats["events_accepted"] == 1
        assert [r.input_addr for r in coord.get_all_replicas().replicas] == ["tcp://signed:1"]
    finally:
        coord.close()


def test_hub_client_rejects_bad_broadcasts(zctx):
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(LOCAL)
    hub = OmniCoordClientForHub(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        def valid(addr: str, seq: int) -> bytes:
            info = ReplicaInfo(addr, "tcp://o:1", 2, ReplicaStatus.UP, 0, 1.0, 1.0)
            return msgspec.msgpack.encode(ReplicaList(replicas=[info], timestamp=2.0, seq=seq))

        # PUB drops until the subscription arrives: repeat the first list until seen.
        assert wait_until(lambda: pub.send(valid("tcp://first:1", 1)) or
                          bool(hub.get_replica_list().replicas), LONG_WAIT)
        # Repeats may still be in flight: a marker list sent after them arrives after them
        # (one PUB-SUB connection keeps its order), so once it is in, the baseline is exact.
        pub.send(valid("tcp://marker:1", 2))
        assert wait_until(lambda: [r.input_addr for r in hub.get_replica_list().replicas]
                          == ["tcp://marker:1"], LONG_WAIT), hub.stats
        base = hub.stats["frames_received"]
        rng = random.Random(11)
        expected: dict[str, int] = {}

        def send(parts, reason: RejectReason) -> None:
            pub.send_multipart(parts)
            expected[reason.value] = expected.get(reason.value, 0) + 1

        for _ in range(200):
            send([rng.randbytes(rng.randrange(0, 200))], RejectReason.MALFORMED)
        good = valid("tcp://x:1", 2)
        for cut in range(1, len(good), 3):
            send([good[:cut]], RejectReason.MALFORMED)
        send([b"\x00" * (MAX_LIST_FRAME_BYTES + 1)], RejectReason.OVERSIZE)
        wrong_version = msgspec.msgpack.decode(good)
        wrong_version["protocol_version"] = 42
        send([msgspec.msgpack.encode(wrong_version)], RejectReason.BAD_VERSION)
        send([event_bytes()], RejectReason.UNKNOWN_TYPE)  # an event is not a list
        bad_field = msgspec.msgpack.decode(good)
        bad_field["replicas"][0]["stage_id"] = -3
        send([msgspec.msgpack.encode(bad_field)], RejectReason.INVALID)
        send([good, b"x", b"y"], RejectReason.BAD_ENVELOPE)
        pub.send(valid("tcp://last:1", 3))
        assert wait_until(lambda: [r.input_addr for r in hub.get_replica_list().replicas]
                          == ["tcp://last:1"], LONG_WAIT), hub.stats
        stats = hub.stats
        assert rejected(stats) == expected
        assert stats["frames_received"] - base == sum(expected.values()) + 1
        assert [r.input_addr for r in hub.get_replicas_for_stage(2).replicas] == ["tcp://last:1"]
    finally:
        hub.close()
        pub.close(linger=0)


# ------------------------------------------- fast decode path (added)


def _corpus(rng: random.Random) -> list[bytes]:
    """Valid, near-valid and hostile event frames."""
    good = event_bytes()
    frames = [good, event_bytes(addr="tcp://other:9", queue_length=7, stage_id=4)]
    frames += [good[:cut] for cut in range(len(good))]
    for _ in range(1500):
        f = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            f[rng.randrange(len(f))] = rng.randrange(256)
        frames.append(bytes(f))
    frames += [rng.randbytes(rng.randrange(0, 200)) for _ in range(300)]
    no_version = event_dict()
    del no_version["protocol_version"]
    frames.append(msgspec.msgpack.encode(no_version))
    for changes in ({"protocol_version": 2}, {"protocol_version": 1.0},
                    {"protocol_version": True}, {"type": "replica_list"}, {"extra": [1, 2]},
                    {"status": "down"}, {"queue_length": -1}, {"input_addr": "x" * 513}):
        frames.append(msgspec.msgpack.encode(event_dict(**changes)))
    frames.append(b"\x00" * (MAX_EVENT_FRAME_BYTES + 1))
    frames.append(event_bytes(addr="tcp://" + "x" * MAX_EVENT_FRAME_BYTES))
    # Duplicate keys (msgpack allows them; a map is decoded key by key).
    enc = msgspec.msgpack.encode
    pairs = list(event_dict().items())
    for key, value in (("type", "evil"), ("type", "replica_event"), ("protocol_version", 2),
                       ("protocol_version", 1), ("queue_length", 3), ("status", "zombie")):
        for dup in ([*pairs, (key, value)], [(key, value), *pairs]):
            assert len(dup) < 16
            frames.append(bytes([0x80 | len(dup)]) + b"".join(enc(k) + enc(v) for k, v in dup))
    return frames


def test_fast_decode_agrees_with_careful_decode():
    from vllm_omni_plugin.wire.codec import BoundedDecoder, FrameRejected

    dec = BoundedDecoder(ReplicaEvent, MAX_EVENT_FRAME_BYTES)
    fields = ReplicaEvent.__struct_fields__
    accepted = 0
    for frame in _corpus(random.Random(99)):
        fast = dec.try_decode(frame)
        try:
            careful = dec.decode(frame)
        except FrameRejected:
            careful = None
        # Same verdict both ways, and the same field values when accepted.
        assert (fast is None) == (careful is None), frame
        if fast is not None:
            accepted += 1
            assert isinstance(fast, ReplicaEvent)
            assert [getattr(fast, f) for f in fields] == [getattr(careful, f) for f in fields]
    assert accepted >= 3


def test_event_without_protocol_version_is_malformed(coord, zctx):
    sock = dealer(zctx, coord.router_zmq_addr)
    no_version = event_dict(input_addr="tcp://nover:1")
    del no_version["protocol_version"]
    sock.send(msgspec.msgpack.encode(no_version))
    sock.send(event_bytes(addr="tcp://after:1"))
    assert wait_until(lambda: registered(coord, "tcp://after:1")), coord.stats
    assert rejected(coord.stats) == {"malformed": 1}
    assert not registered(coord, "tcp://nover:1")


def test_batched_events_keep_arrival_order_across_fast_and_careful_paths(coord, zctx):
    # Without a token a 3-part frame is accepted by the careful path (the extra
    # part is ignored); it must be applied in order with the fast-path frames
    # around it, and rejects in between must not disturb the order.
    sock = dealer(zctx, coord.router_zmq_addr)
    n = 600
    for q in range(n):
        payload = event_bytes(addr="tcp://ord:1", queue_length=q)
        if q % 7 == 3:
            sock.send_multipart([payload, b"ignored-signature"])
        else:
            sock.send(payload)
        if q % 11 == 5:
            sock.send(b"\xc1garbage")
    last = n - 1

    def final_q():
        for r in coord.get_all_replicas().replicas:
            if r.input_addr == "tcp://ord:1":
                return r.queue_length
        return None

    assert wait_until(lambda: final_q() == last), coord.stats
    stats = coord.stats
    bad = len([q for q in range(n) if q % 11 == 5])
    assert stats["events_accepted"] == n
    assert rejected(stats) == {"malformed": bad}
    assert stats["frames_received"] == n + bad
    assert stats["internal_errors"] == 0


def test_error_applying_one_event_does_not_drop_the_rest(coord, zctx, monkeypatch):
    real = coord._apply_locked

    def flaky(event, wall, mono):
        if event.input_addr == "tcp://boom:1":
            raise RuntimeError("boom")
        real(event, wall, mono)

    monkeypatch.setattr(coord, "_apply_locked", flaky)
    sock = dealer(zctx, coord.router_zmq_addr)
    sock.send(event_bytes(addr="tcp://a:1"))
    sock.send(event_bytes(addr="tcp://boom:1"))
    sock.send(event_bytes(addr="tcp://b:1"))
    assert wait_until(lambda: registered(coord, "tcp://b:1")), coord.stats
    stats = coord.stats
    assert registered(coord, "tcp://a:1") and not registered(coord, "tcp://boom:1")
    assert stats["internal_errors"] == 1
    assert stats["frames_received"] == stats["events_accepted"] == 3
