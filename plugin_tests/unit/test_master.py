"""OmniMasterServer / OmniMasterClient: ids, ports, concurrency, hostile frames.

Real ZMQ sockets on 127.0.0.1, real threads and subprocesses. Port ranges are
chosen per test; ports the test host already uses are skipped by the master's
local bind check, so assertions never depend on a port being free.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import pytest
import zmq

from plugin_tests.helpers import LONG_WAIT, dealer, wait_until
from vllm_omni_plugin.coordinator import (
    CLUSTER_TOKEN_ENV,
    MAX_REQUEST_FRAME_BYTES,
    MasterError,
    MasterReply,
    MasterRequest,
    MasterTimeout,
    OmniMasterClient,
    OmniMasterServer,
    RegisterRequest,
    RejectReason,
    ReplicaAssignment,
    route_probe_address,
)
from vllm_omni_plugin.wire.auth import sign
from vllm_omni_plugin.wire.sockets import ROUTER_HARD_MAX_BYTES

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCAL = "tcp://127.0.0.1:0"
HOST = "127.0.0.1"


def rejected(stats: dict[str, int]) -> dict[str, int]:
    return {k.removeprefix("rejected."): v for k, v in stats.items()
            if k.startswith("rejected.") and v}


def all_ports(assignments: list[ReplicaAssignment]) -> list[int]:
    return [p for a in assignments for p in a.ports.values()]


def request_bytes(request_id: int = 1, client_id: str = "raw", **body) -> bytes:
    fields = {"stage_id": 0, "replica_address": HOST, "num_replicas": 1, **body}
    return msgspec.msgpack.encode(
        MasterRequest(client_id=client_id, request_id=request_id,
                      body=RegisterRequest(**fields)))


def request_dict(**changes) -> dict:
    d = msgspec.msgpack.decode(request_bytes())
    d.update(changes)
    return d


# --------------------------------------------------------------------- concurrency

_SUBPROCESS_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm_omni_plugin.coordinator import OmniMasterClient
    addr, stage, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = []
    with OmniMasterClient(addr, timeout=10.0) as c:
        for i in range(rounds):
            for a in c.register(stage, "127.0.0.1", 1 + i % 3):
                out.append([a.replica_id, sorted(a.ports.values())])
    print(json.dumps(out))
""")


def test_concurrent_registrants_get_unique_ids_and_ports():
    """50 client threads, 3 client processes and local head calls, one stage."""
    with OmniMasterServer(LOCAL, port_range=(21000, 22999)) as server:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _SUBPROCESS_SCRIPT, server.address, "0", "6"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO,
            )
            for _ in range(3)
        ]
        rng = random.Random(7)
        sizes = [rng.randint(1, 3) for _ in range(50)]
        barrier = threading.Barrier(len(sizes) + 2)
        results: list[ReplicaAssignment] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def remote(n: int) -> None:
            try:
                with OmniMasterClient(server.address, timeout=10.0) as c:
                    barrier.wait()
                    got = c.register(0, HOST, n)
                with lock:
                    results.extend(got)
            except BaseException as e:  # reported below
                errors.append(e)

        def local() -> None:  # the head's own replicas, interleaved
            try:
                barrier.wait()
                for _ in range(10):
                    got = server.register_local(0, HOST, 2)
                    with lock:
                        results.extend(got)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=remote, args=(n,)) for n in sizes]
        threads += [threading.Thread(target=local) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        sub: list[tuple[int, list[int]]] = []
        for p in procs:
            out, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
            sub.extend(json.loads(out))
        assert not errors, errors

        total = sum(sizes) + 2 * 10 * 2 + 3 * sum(1 + i % 3 for i in range(6))
        ids = [a.replica_id for a in results] + [rid for rid, _ in sub]
        assert len(ids) == total
        assert sorted(ids) == list(range(total))  # unique, and lowest-free => dense
        ports = all_ports(results) + [p for _, ps in sub for p in ps]
        assert len(ports) == 3 * total == len(set(ports))
        assert all(21000 <= p <= 22999 for p in ports)
        held = server.assignments(0)
        assert [a.replica_id for a in held] == list(range(total))
        stats = server.stats
        assert stats["ids_held"] == total and stats["ports_held"] == 3 * total
        assert stats["local_calls"] == 20
        assert stats["frames_received"] == stats["frames_accepted"]
        assert stats["frames_accepted"] - stats["duplicates"] == len(sizes) + 3 * 6
        assert not rejected(stats)


def test_mixed_local_and_remote_never_collide():
    """Upstream bug #9: head-local and headless registrants of one stage, raced 20 times."""
    with OmniMasterServer(LOCAL, port_range=(23000, 23999)) as server, \
            OmniMasterClient(server.address) as client:
        for stage in range(20):
            barrier = threading.Barrier(2)
            got: dict[str, list[ReplicaAssignment]] = {}

            def head(stage: int = stage, barrier=barrier, got=got) -> None:
                barrier.wait()
                got["local"] = server.register_local(stage, HOST, 2)

            t = threading.Thread(target=head)
            t.start()
            barrier.wait()
            got["remote"] = client.register(stage, HOST, 4)
            t.join(timeout=10)
            ids = [a.replica_id for a in got["local"] + got["remote"]]
            assert sorted(ids) == list(range(6)), (stage, ids)
            assert all(a.stage_id == stage for a in got["local"] + got["remote"])
        ports = all_ports(server.assignments())
        assert len(ports) == len(set(ports)) == 20 * 6 * 3


# ------------------------------------------------------------- deregister, limits

def test_deregister_frees_ids_and_ports_for_reuse():
    with OmniMasterServer(LOCAL, port_range=(24000, 24099)) as server, \
            OmniMasterClient(server.address) as client:
        first = client.register(0, HOST, 4)
        assert [a.replica_id for a in first] == [0, 1, 2, 3]
        assert client.register(1, HOST, 1)[0].replica_id == 0  # ids are per stage
        assert server.stats["ports_held"] == 15
        freed_ports = set(first[1].ports.values()) | set(first[2].ports.values())

        assert client.deregister(0, [2, 1, 1, 99]) == [2, 1]  # unknown and repeats ignored
        assert server.stats["ports_held"] == 9 and server.stats["ids_held"] == 3
        again = client.register(0, HOST, 3)
        assert [a.replica_id for a in again] == [1, 2, 4]  # freed ids reused, lowest first
        assert not freed_ports & set(all_ports(again))  # next-fit: freed ports reused last
        assert client.deregister(0, [1]) == [1]
        assert client.deregister(0, [1]) == []  # idempotent
        assert server.deregister_local(0, [0, 2, 3, 4]) == [0, 2, 3, 4]
        assert [a.stage_id for a in server.assignments()] == [1]

        # Freed ports do come back once the range wraps around.
        client.deregister(1, [0])
        for _ in range(10):
            got = client.register(2, HOST, 3)
            client.deregister(2, [a.replica_id for a in got])
        assert server.stats["ports_held"] == 0


def test_exhaustion_is_all_or_nothing():
    with OmniMasterServer(LOCAL, port_range=(24100, 24111), max_replicas_per_stage=3) as server, \
            OmniMasterClient(server.address) as client:
        with pytest.raises(MasterError) as e:
            client.register(0, HOST, 4)
        assert e.value.code == "stage_full"
        client.register(0, HOST, 3)
        with pytest.raises(MasterError) as e:
            client.register(1, HOST, 2)  # 6 ports needed, 3 left
        assert e.value.code == "no_ports"
        assert server.stats["ids_held"] == 3 and server.stats["ports_held"] == 9
        assert server.stats["failed.stage_full"] == server.stats["failed.no_ports"] == 1
        with pytest.raises(MasterError) as e:
            server.register_local(0, "0.0.0.0", 1)
        assert e.value.code == "bad_address"
        with pytest.raises(ValueError):  # the client checks before sending
            client.register(0, "tcp://127.0.0.1", 1)


def test_local_ports_in_use_are_skipped_remote_ones_are_not():
    """The bind check runs only for addresses of this host."""
    busy = socket.socket()
    busy.bind((HOST, 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        with OmniMasterServer(LOCAL, port_range=(port, port + 5)) as server:
            local = server.register_local(0, HOST, 1)[0]
            assert port not in local.ports.values()
            assert server.stats["ports_skipped_unbindable"] >= 1
            # 192.0.2.1 (TEST-NET-1) is not ours: nothing can be checked, the
            # port is handed out (the replica reports a bind failure later).
            server.deregister_local(0, [0])
            remote = server.register_local(0, "192.0.2.1", 2)
            assert port in all_ports(remote)
    finally:
        busy.close()


# --------------------------------------------------------------------- retries

def test_retried_request_is_answered_once_from_cache(zctx):
    with OmniMasterServer(LOCAL, port_range=(24200, 24299)) as server:
        sock = dealer(zctx, server.address)
        payload = request_bytes(request_id=7, client_id="retrying", num_replicas=2)
        sock.send(payload)
        sock.send(payload)
        assert sock.poll(5000)
        first = msgspec.msgpack.decode(sock.recv(), type=MasterReply)
        assert sock.poll(5000)
        second = msgspec.msgpack.decode(sock.recv(), type=MasterReply)
        assert first == second and first.ok and len(first.assignments) == 2
        assert server.stats["ids_held"] == 2 and server.stats["duplicates"] == 1
        # Same request id from another client id is a different request.
        sock.send(request_bytes(request_id=7, client_id="other"))
        assert sock.poll(5000)
        assert msgspec.msgpack.decode(sock.recv(), type=MasterReply).assignments[0].replica_id == 2


def test_client_times_out_then_request_queued_before_bind_is_served():
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    addr = f"tcp://{HOST}:{port}"
    with OmniMasterClient(addr, timeout=0.2, retries=1) as client:
        t0 = time.monotonic()
        with pytest.raises(MasterTimeout, match=r"after 2 attempt\(s\) of 0\.2s"):
            client.register(0, HOST)
        # 2 attempts of 0.2 s, not of the 5 s default: 4.6 s left for a loaded host's lag
        assert time.monotonic() - t0 < 5.0
        assert client.stats["attempts"] == 2

    # Headless first, head later: ZMQ queues the request until the master binds.
    out: dict[str, object] = {}
    with OmniMasterClient(addr, timeout=0.25, retries=240) as client:
        t = threading.Thread(target=lambda: out.setdefault("r", client.register(3, HOST, 2)))
        t.start()
        # Attempt n + 1 starts after attempt n was sent and timed out: from the third on,
        # at least two copies of the request wait in ZMQ's queue for a master to bind.
        assert wait_until(lambda: client.stats["attempts"] >= 3, LONG_WAIT)
        queued = client.stats["attempts"] - 1
        with OmniMasterServer(addr, port_range=(24300, 24399),
                              cluster_info={"coordinator_router": "tcp://h:1"}) as server:
            t.join(timeout=LONG_WAIT)
            assert not t.is_alive(), f"no reply within {LONG_WAIT:g} s of the bind"
            assert [a.replica_id for a in out["r"]] == [0, 1]  # type: ignore[union-attr]
            # every copy sent before the bind reached the master
            assert wait_until(lambda: server.stats["frames_accepted"] >= queued, LONG_WAIT), (
                queued, server.stats)
            assert server.stats["ids_held"] == 2  # retries did not allocate twice
            assert client.cluster_info == {"coordinator_router": "tcp://h:1"}


# ----------------------------------------------------------------------- auth

def test_wrong_token_is_rejected_answered_and_counted(monkeypatch):
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "alpha")  # the server reads the env
    with OmniMasterServer(LOCAL, port_range=(24400, 24499)) as server:
        for token, says in (("beta", "the head's cluster token differs from this process's"),
                            ("", "the head requires a cluster token and this process has "
                                 f"none: set {CLUSTER_TOKEN_ENV}")):
            # one attempt of 3 s: an answer, not a timeout
            with OmniMasterClient(server.address, timeout=3.0, retries=0,
                                  cluster_token=token) as c:
                with pytest.raises(MasterError) as e:
                    c.register(0, HOST)
                assert e.value.code == "bad_token"
                assert says in str(e.value), e.value
                assert "alpha" not in str(e.value) and "beta" not in str(e.value)
        stats = server.stats
        assert rejected(stats) == {"bad_token": 2} and stats["error_replies"] == 2
        assert stats["ids_held"] == 0
        with OmniMasterClient(server.address) as c:  # env token: alpha
            assert c.register(0, HOST)[0].replica_id == 0


def test_a_signed_request_to_a_head_without_a_token_is_refused(monkeypatch):
    """A replica with a token, a head without one: refused at once, saying so, and nothing
    registered (the head would otherwise take it and the replica drop its unsigned
    answers until its timeout)."""
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    with OmniMasterServer(LOCAL, port_range=(24400, 24499)) as server:
        with OmniMasterClient(server.address, timeout=3.0, retries=0,
                              cluster_token="alpha") as c:
            with pytest.raises(MasterError) as e:
                c.register(0, HOST)
        assert e.value.code == "bad_token"
        assert "the head has no cluster token and this process has one" in str(e.value)
        assert rejected(server.stats) == {"bad_token": 1}
        assert server.stats["ids_held"] == 0


def test_client_ignores_forged_replies(zctx):
    """A signed client drops replies without a valid signature (except bad_token)."""
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(LOCAL)
    addr = router.getsockopt_string(zmq.LAST_ENDPOINT)
    errors: list[BaseException] = []
    with OmniMasterClient(addr, timeout=0.5, retries=0, cluster_token="alpha") as c:
        def call() -> None:
            try:
                c.register(0, HOST)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=call)
        t.start()
        ident, payload, mac = router.recv_multipart()
        req = msgspec.msgpack.decode(payload, type=MasterRequest)
        forged = msgspec.msgpack.encode(MasterReply(request_id=req.request_id, ok=True))
        router.send_multipart([ident, forged])  # unsigned
        router.send_multipart([ident, forged, sign(b"beta", forged)])  # wrong key
        t.join(timeout=5)
        assert not t.is_alive()
        assert c.stats["bad_replies"] == 2
    router.close(linger=0)
    assert len(errors) == 1 and isinstance(errors[0], MasterTimeout)


# ----------------------------------------------------------------------- fuzz

def test_hostile_frames_are_answered_or_dropped_and_counted(zctx, tmp_path):
    with OmniMasterServer(LOCAL, port_range=(24500, 24599)) as server:
        sock = dealer(zctx, server.address)
        rng = random.Random(20260601)
        expected: dict[str, int] = {}
        answered: dict[int, str] = {}  # request_id -> error code expected in the reply

        def send(parts, reason: RejectReason, answer_id: int | None = None) -> None:
            sock.send_multipart(parts)
            expected[reason.value] = expected.get(reason.value, 0) + 1
            if answer_id is not None:
                answered[answer_id] = reason.value

        for _ in range(200):  # random bytes: no request id to answer
            send([rng.randbytes(rng.randrange(0, 300))], RejectReason.MALFORMED)
        good = request_bytes(request_id=1)
        for cut in range(1, len(good)):  # truncations
            send([good[:cut]], RejectReason.MALFORMED)

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {tmp_path / 'pwned'}",))

        send([pickle.dumps(Evil())], RejectReason.MALFORMED)
        send([b"\x91" * 4000 + b"\x00"], RejectReason.MALFORMED)  # deep nesting
        send([msgspec.msgpack.encode({"request_id": 100, "client_id": "x"})],
             RejectReason.MALFORMED, answer_id=100)  # no type/version, but answerable
        send([b"\x00" * (MAX_REQUEST_FRAME_BYTES + 1)], RejectReason.OVERSIZE)
        send([request_bytes(request_id=101, replica_address="h" * 200) + b"\x00" * 20000],
             RejectReason.OVERSIZE)  # never parsed, so never answered
        for rid, version in ((102, 0), (103, 2), (104, 999)):
            send([msgspec.msgpack.encode(request_dict(request_id=rid, protocol_version=version))],
                 RejectReason.BAD_VERSION, answer_id=rid)
        send([msgspec.msgpack.encode(request_dict(request_id=105, type="replica_event"))],
             RejectReason.UNKNOWN_TYPE, answer_id=105)
        body = request_dict()["body"]
        for rid, change in (
            (106, {"num_replicas": 0}),
            (107, {"num_replicas": 10**6}),
            (108, {"stage_id": -1}),
            (109, {"replica_address": ""}),
            (110, {"op": "steal_slot"}),
            (111, {"op": "deregister", "replica_ids": list(range(1025))}),
        ):
            send([msgspec.msgpack.encode(request_dict(request_id=rid, body={**body, **change}))],
                 RejectReason.INVALID, answer_id=rid)
        send([msgspec.msgpack.encode(request_dict(request_id=112, client_id=""))],
             RejectReason.INVALID, answer_id=112)
        send([request_bytes(request_id=113), b"x", b"y"], RejectReason.BAD_ENVELOPE,
             answer_id=113)
        sent = sum(expected.values())
        assert wait_until(lambda: server.stats["frames_received"] >= sent)

        replies: dict[int, str] = {}
        while sock.poll(300):
            r = msgspec.msgpack.decode(sock.recv(), type=MasterReply)
            assert not r.ok
            replies[r.request_id] = r.error
        assert replies == answered

        stats = server.stats
        assert rejected(stats) == expected
        assert stats["frames_received"] == sent and stats["frames_accepted"] == 0
        assert stats["error_replies"] == len(answered)
        assert stats["ids_held"] == 0 and stats["internal_errors"] == 0
        assert not (tmp_path / "pwned").exists()

        # Over libzmq's hard cap: the peer is disconnected before Python sees it.
        big = dealer(zctx, server.address)
        big.send(b"\x00" * (ROUTER_HARD_MAX_BYTES + 1))
        big.close(linger=0)

        # The server is still serving.
        with OmniMasterClient(server.address) as c:
            assert [a.replica_id for a in c.register(0, HOST, 2)] == [0, 1]
        sock.send(request_bytes(request_id=200, replica_address="0.0.0.0"))
        assert sock.poll(5000)
        r = msgspec.msgpack.decode(sock.recv(), type=MasterReply)
        assert (r.request_id, r.ok, r.error) == (200, False, "bad_address")
        assert server.stats["failed.bad_address"] == 1


def test_client_reports_version_mismatch(zctx):
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(LOCAL)
    addr = router.getsockopt_string(zmq.LAST_ENDPOINT)
    errors: list[BaseException] = []
    with OmniMasterClient(addr, timeout=3.0, retries=0) as c:
        def call() -> None:
            try:
                c.register(0, HOST)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=call)
        t.start()
        ident, payload = router.recv_multipart()
        rid = msgspec.msgpack.decode(payload)["request_id"]
        router.send_multipart([ident, msgspec.msgpack.encode(
            {"type": "master_reply", "request_id": rid, "ok": True, "protocol_version": 2})])
        t.join(timeout=5)
    router.close(linger=0)
    assert len(errors) == 1 and isinstance(errors[0], MasterError)
    assert errors[0].code == "bad_version" and "protocol 2" in str(errors[0])


# ----------------------------------------------------------- binding, addresses

def _other_local_addresses() -> list[str]:
    """Local addresses other than 127.0.0.1 that this host can bind."""
    found = []
    candidates = {"127.0.0.2"}
    try:
        candidates |= {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None,
                                                              socket.AF_INET)}
    except OSError:
        pass
    for ip in sorted(candidates - {"127.0.0.1"}):
        try:
            with socket.socket() as s:
                s.bind((ip, 0))
            found.append(ip)
        except OSError:
            continue
    return found


def test_binds_only_the_given_address():
    others = _other_local_addresses()
    if not others:
        pytest.skip("no local address other than 127.0.0.1 to probe")
    with OmniMasterServer(LOCAL) as server:
        port = int(server.address.rsplit(":", 1)[1])
        with socket.create_connection((HOST, port), timeout=2):
            pass  # reachable where bound
        for ip in others:
            with pytest.raises(OSError), socket.create_connection((ip, port), timeout=2):
                pass


def test_route_probe_address_and_override():
    assert route_probe_address(HOST) == HOST
    assert route_probe_address(f"tcp://{HOST}:5555") == HOST
    assert route_probe_address("unused", override="10.1.2.3") == "10.1.2.3"
    for bad in ("0.0.0.0", "tcp://10.0.0.1", "::", "h:80", ""):
        with pytest.raises(ValueError):
            route_probe_address(HOST, override=bad)


def test_close_is_idempotent_and_fails_later_calls():
    server = OmniMasterServer(LOCAL, port_range=(24600, 24610))
    server.register_local(0, HOST)
    server.close()
    server.close()
    with pytest.raises(MasterError) as e:
        server.register_local(0, HOST)
    assert e.value.code == "closed"
    client = OmniMasterClient(server.address)
    client.close()
    client.close()
    with pytest.raises(RuntimeError):
        client.register(0, HOST)
