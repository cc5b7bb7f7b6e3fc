"""The control plane's wire helpers: the envelope (``wire.envelope``), the one writer
and reader of ``[payload]`` / ``[payload, signature]`` for the coordinator, the omni
master and the task channel; and the serving thread (``wire.sockets.PollerThread``) of
the coordinator and the master, on real ZMQ sockets."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from plugin_tests.helpers import wait_until
from vllm_omni_plugin.coordinator.messages import EventType, ReplicaEvent, ReplicaStatus
from vllm_omni_plugin.wire import auth, envelope
from vllm_omni_plugin.wire.codec import BoundedDecoder, FrameRejected, RejectReason, encode
from vllm_omni_plugin.wire.sockets import PollerThread, ephemeral_ports, free_listen_port

KEY = b"cluster-token"
EVENT = ReplicaEvent("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", 1, ReplicaStatus.UP, 3,
                     EventType.HEARTBEAT)


def _decoder(max_bytes: int = 4096) -> BoundedDecoder:
    return BoundedDecoder(ReplicaEvent, max_bytes)


@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_a_sealed_message_unseals_to_itself(key):
    parts = envelope.seal(key, encode(EVENT))
    assert len(parts) == (1 if key is None else 2)
    got = envelope.unseal(key, [memoryview(p) for p in parts], _decoder())
    assert (got.input_addr, got.stage_id, got.queue_length) == ("tcp://127.0.0.1:1", 1, 3)


@pytest.mark.parametrize(("parts", "reason"), [
    ([], RejectReason.BAD_ENVELOPE),
    ([b"a", b"b", b"c"], RejectReason.BAD_ENVELOPE),
    ([encode(EVENT)], RejectReason.BAD_TOKEN),                          # no signature
    ([encode(EVENT), auth.sign(b"other", encode(EVENT))], RejectReason.BAD_TOKEN),
    ([encode(EVENT), auth.sign(KEY, encode(EVENT))[:-1]], RejectReason.BAD_TOKEN),
    ([b"x" * 5000, b""], RejectReason.OVERSIZE),                         # before the HMAC
    ([b"\xc1", auth.sign(KEY, b"\xc1")], RejectReason.MALFORMED),
])
def test_a_bad_envelope_is_rejected_with_its_reason(parts, reason):
    with pytest.raises(FrameRejected) as err:
        envelope.unseal(KEY, parts, _decoder())
    assert err.value.reason is reason


def test_without_a_token_a_trailing_signature_is_ignored():
    payload = encode(EVENT)
    assert envelope.verified(None, [payload])
    assert envelope.unseal(None, [payload, b"anything"], _decoder()).stage_id == 1
    assert not envelope.verified(KEY, [payload, b"anything"])


@pytest.fixture()
def pair():
    """A connected PAIR socket pair: ``(served, peer)``."""
    ctx = zmq.Context()
    served, peer = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    served.bind("inproc://served")
    peer.connect("inproc://served")
    yield served, peer
    served.close(linger=0)
    peer.close(linger=0)
    ctx.term()


def test_a_failed_round_is_counted_and_serving_goes_on(pair):
    served, peer = pair
    received, errors = [], []

    def step(ready):
        if served in ready:
            message = served.recv()
            if message == b"bad":
                raise RuntimeError("a bug in one round")
            received.append(message)

    thread = PollerThread("test", step, lambda: None, lambda: errors.append(1))
    thread.start([served])
    for message in (b"one", b"bad", b"two"):
        peer.send(message)
    assert wait_until(lambda: received == [b"one", b"two"]), received
    assert errors == [1]
    thread.stop()
    thread.waker.close()


def test_rounds_come_when_the_timeout_says_and_stop_ends_a_blocked_poll(pair):
    served, _ = pair
    rounds = threading.Semaphore(0)
    thread = PollerThread("test", lambda ready: rounds.release(), lambda: 10, lambda: None)
    thread.start([served])
    assert all(rounds.acquire(timeout=5) for _ in range(3))  # no input: every 10 ms
    thread.stop()
    blocked = PollerThread("blocked", lambda ready: None, lambda: None, lambda: None)
    blocked.start([served])
    start = time.monotonic()
    blocked.stop(timeout=5)  # the wake pipe ends its endless poll
    assert time.monotonic() - start < 2
    for t in (thread, blocked):
        t.waker.close()


def test_stopping_a_thread_never_started_returns():
    thread = PollerThread("never", lambda ready: None, lambda: None, lambda: None)
    thread.stop()
    thread.waker.close()


def test_a_listen_port_is_free_and_below_the_ephemeral_range(tmp_path):
    import socket

    low, _ = ephemeral_ports()
    ports = {free_listen_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1  # random, not sequential
    with socket.socket() as taken:
        port = free_listen_port()
        taken.bind(("", port))  # it was free
    (tmp_path / "range").write_text("1024\t5000\n")
    assert ephemeral_ports(str(tmp_path / "range")) == (1024, 5000)
    assert ephemeral_ports(str(tmp_path / "missing")) == (32768, 60999)
