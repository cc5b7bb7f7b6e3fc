"""OmniMasterServer: replica registration, replica-id assignment and port allocation.

The head runs one :class:`OmniMasterServer` (ZMQ ROUTER bound to exactly the
address it is given). Headless processes register through
:class:`OmniMasterClient` (DEALER, request/reply with timeout, retries and
server-side de-duplication); the head's own replicas register through
:meth:`OmniMasterServer.register_local`, which runs the *same* handler on the
*same* thread.

Why two registrants can never get the same replica id or port ("slot stealing"
-- a bug of upstream vllm-omni's first master, reported in its coordinator integration PR):

* the allocation table has exactly one owner, the server's poller thread; remote
  requests arrive as frames on its ROUTER and in-process calls are queued to it
  (queue + wake pipe + future), so every registration is applied serially and
  completely (all ids and ports of a request, or none) before the next one is
  looked at;
* registrants never propose ids: the master is the only source of ids, so there
  is no "concrete id" registrant racing an auto-assigner;
* an id is only re-issued after a deregister released it, and a port only
  after its replica was deregistered (ports advance with a next-fit cursor, so
  a freed port is the last to be reused).

Liveness is not the master's concern: the OmniCoordinator (heartbeats) decides
whether a replica is up; the master only tracks who holds which id and ports
until they are released. See ``docs/design/coordinator.md`` ("Master server").
"""

from __future__ import annotations

import errno
import ipaddress
import queue
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not built-in before 3.11

import msgspec
import zmq

from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.wire import auth, envelope
from vllm_omni_plugin.wire.codec import (
    BoundedDecoder,
    FrameRejected,
    RejectLog,
    RejectReason,
    encode,
    reject_stat_keys,
)
from vllm_omni_plugin.wire.sockets import ROUTER_HARD_MAX_BYTES, ClosedOnExit, PollerThread, bind

from .messages import (
    MAX_REQUEST_FRAME_BYTES,
    DeregisterRequest,
    MasterError,
    MasterErrorCode,
    MasterReply,
    MasterRequest,
    RegisterRequest,
    ReplicaAssignment,
    check_replica_address,
    peek_request,
)

logger = init_logger(__name__)

#: Default port range (inclusive) the master allocates replica ports from. It
#: sits below Linux's default ephemeral range (32768-60999) so outgoing
#: connections do not occupy it; choose one your firewall opens between hosts.
DEFAULT_PORT_RANGE = (28000, 28999)

#: Default endpoints each replica gets a port for (upstream's
#: ``replica_{handshake,input,output}_port``).
DEFAULT_ENDPOINT_NAMES = ("handshake", "input", "output")

#: Default most replicas one stage may hold at once.
DEFAULT_MAX_REPLICAS_PER_STAGE = 1024

#: Upper bound on the bytes of encoded replies kept for de-duplicating retries.
_DEDUP_CACHE_BYTES = 16 * 1024 * 1024

#: Frames handled per poller wake-up.
_RECV_BATCH = 256


#: Cached "is this IP one of ours" answers kept at most.
_LOCALITY_CACHE_MAX = 1024


# --------------------------------------------------------------------------- allocation


class _AllocError(Exception):
    def __init__(self, code: MasterErrorCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class _Allocator:
    """The allocation table. Only ever touched by the server's poller thread."""

    def __init__(
        self,
        port_range: tuple[int, int],
        endpoint_names: tuple[str, ...],
        max_replicas_per_stage: int,
        verify_local_ports: bool,
    ) -> None:
        self.lo, self.hi = port_range
        self.endpoint_names = endpoint_names
        self.max_per_stage = max_replicas_per_stage
        self.verify_local_ports = verify_local_ports
        self.held: dict[int, dict[int, ReplicaAssignment]] = {}
        self.ports_in_use: set[int] = set()
        self._cursor = self.lo
        self._locality: dict[str, bool] = {}
        self.ports_skipped_unbindable = 0

    @property
    def num_held(self) -> int:
        return sum(len(s) for s in self.held.values())

    def register(self, req: RegisterRequest) -> list[ReplicaAssignment]:
        why = check_replica_address(req.replica_address)
        if why is not None:
            raise _AllocError(MasterErrorCode.BAD_ADDRESS, why)
        stage = self.held.get(req.stage_id, {})
        n = req.num_replicas
        if len(stage) + n > self.max_per_stage:
            raise _AllocError(
                MasterErrorCode.STAGE_FULL,
                f"stage {req.stage_id} holds {len(stage)} replicas; {n} more would exceed "
                f"max_replicas_per_stage={self.max_per_stage}",
            )
        ports = self._take_ports(n * len(self.endpoint_names), req.replica_address)
        ids: list[int] = []
        candidate = 0
        while len(ids) < n:  # lowest ids not held
            if candidate not in stage:
                ids.append(candidate)
            candidate += 1
        out: list[ReplicaAssignment] = []
        k = len(self.endpoint_names)
        for i, rid in enumerate(ids):
            a = ReplicaAssignment(
                stage_id=req.stage_id,
                replica_id=rid,
                host=req.replica_address,
                ports=dict(zip(self.endpoint_names, ports[i * k:(i + 1) * k], strict=True)),
            )
            stage[rid] = a
            out.append(msgspec.structs.replace(a, ports=dict(a.ports)))  # callers may mutate
        self.held[req.stage_id] = stage
        self.ports_in_use.update(ports)
        return out

    def deregister(self, req: DeregisterRequest) -> tuple[list[int], list[int]]:
        stage = self.held.get(req.stage_id, {})
        freed: list[int] = []
        not_held: list[int] = []
        for rid in dict.fromkeys(req.replica_ids):  # de-duplicated, order kept
            a = stage.pop(rid, None)
            if a is None:
                not_held.append(rid)
                continue
            self.ports_in_use.difference_update(a.ports.values())
            freed.append(rid)
        if not stage:
            self.held.pop(req.stage_id, None)
        return freed, not_held

    def snapshot(self, stage_id: int | None) -> list[ReplicaAssignment]:
        stages = [stage_id] if stage_id is not None else sorted(self.held)
        return [
            msgspec.structs.replace(a, ports=dict(a.ports))
            for s in stages
            for _, a in sorted(self.held.get(s, {}).items())
        ]

    def _take_ports(self, count: int, host: str) -> list[int]:
        """``count`` free ports by next-fit from the cursor; all or nothing."""
        probe_ip = self._probe_ip(host)
        size = self.hi - self.lo + 1
        if size - len(self.ports_in_use) < count:
            raise _AllocError(
                MasterErrorCode.NO_PORTS,
                f"{count} ports needed, {size - len(self.ports_in_use)} of "
                f"{self.lo}-{self.hi} unallocated",
            )
        taken: list[int] = []
        port = self._cursor
        for _ in range(size):
            if port not in self.ports_in_use and (
                probe_ip is None or _port_bindable(probe_ip, port)
            ):
                taken.append(port)
                if len(taken) == count:
                    self._cursor = self.lo + (port + 1 - self.lo) % size
                    return taken
            elif port not in self.ports_in_use:
                self.ports_skipped_unbindable += 1
            port = self.lo + (port + 1 - self.lo) % size
        raise _AllocError(
            MasterErrorCode.NO_PORTS,
            f"{count} ports needed, only {len(taken)} of {self.lo}-{self.hi} free and "
            f"bindable on {host}",
        )

    def _probe_ip(self, host: str) -> str | None:
        """The IP to test-bind ports on, or ``None`` if ports cannot be checked here.

        Only IP literals are considered (the poller thread never does DNS);
        an IP is local when it is a loopback address or this host can bind it.
        """
        if not self.verify_local_ports:
            return None
        bare = host[1:-1] if host.startswith("[") else host
        try:
            ip = ipaddress.ip_address(bare)
        except ValueError:
            return None
        key = str(ip)
        local = self._locality.get(key)
        if local is None:
            local = _is_local_ip(ip)
            if len(self._locality) >= _LOCALITY_CACHE_MAX:
                self._locality.clear()
            self._locality[key] = local
        return key if local else None


def _is_local_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            logger.debug("locality probe of %s: %r", ip, e)
        return False


def _port_bindable(ip: str, port: int) -> bool:
    """Whether a TCP listener could bind ``ip:port`` now.

    ``SO_REUSEADDR`` is set because libzmq sets it on its TCP listeners, so a
    port in TIME_WAIT counts as free (libzmq could bind it) while a port with a
    live listener (on ``ip`` or on the wildcard address) does not.
    """
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ip, port))
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------- server


class OmniMasterServer(ClosedOnExit):
    """Registration server: assigns replica ids per stage and ports per replica.

    The ROUTER is bound in the constructor (bind errors raise here), then one
    daemon thread runs the poller loop, which alone owns the allocation table,
    until :meth:`close`.

    Args:
        address: Address to bind the ROUTER to, e.g. ``tcp://10.0.0.5:9000``
            (port ``0`` picks a free one). Only this address is bound.
        port_range: Inclusive ``(first, last)`` TCP ports to allocate replica
            endpoints from (default :data:`DEFAULT_PORT_RANGE`). Ports are
            unique across all replicas the master holds, on every host.
        endpoint_names: Endpoint names each replica gets one port for
            (default :data:`DEFAULT_ENDPOINT_NAMES`).
        max_replicas_per_stage: Most replica ids one stage may hold
            (default :data:`DEFAULT_MAX_REPLICAS_PER_STAGE`).
        verify_local_ports: When the registrant's host is an IP literal of this
            machine (loopback, or bindable here), skip ports in the range that
            cannot be bound right now (default True). Ports on other hosts are
            never checked; see the design doc.
        cluster_info: Extra ``name -> address`` strings sent in every reply
            (e.g. the coordinator's ROUTER/PUB addresses).
        cluster_token: Shared secret; when set, requests must carry its HMAC
            and replies are signed (see :mod:`.auth`). ``None`` reads
            ``VLLM_OMNI_PLUGIN_CLUSTER_TOKEN``; ``""`` disables.

    Raises:
        ValueError: On an invalid port range, endpoint names or limit.
        zmq.ZMQError: If ``address`` cannot be bound.

    Attributes:
        address: The bound endpoint (actual port).
    """

    def __init__(
        self,
        address: str,
        *,
        port_range: tuple[int, int] = DEFAULT_PORT_RANGE,
        endpoint_names: Sequence[str] = DEFAULT_ENDPOINT_NAMES,
        max_replicas_per_stage: int = DEFAULT_MAX_REPLICAS_PER_STAGE,
        verify_local_ports: bool = True,
        cluster_info: Mapping[str, str] | None = None,
        cluster_token: str | None = None,
    ) -> None:
        lo, hi = (int(p) for p in port_range)
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(
                f"port_range must satisfy 1 <= first <= last <= 65535, got {port_range}")
        names = tuple(endpoint_names)
        if not names or len(set(names)) != len(names) or not all(
            isinstance(n, str) and 0 < len(n) <= 64 for n in names
        ):
            raise ValueError(f"endpoint_names must be distinct non-empty strings, got {names!r}")
        if len(names) > 8:
            raise ValueError(f"at most 8 endpoint names, got {len(names)}")
        if max_replicas_per_stage < 1:
            raise ValueError(f"max_replicas_per_stage must be >= 1, got {max_replicas_per_stage}")
        self._alloc = _Allocator((lo, hi), names, int(max_replicas_per_stage),
                                 bool(verify_local_ports))
        self._cluster_info = {str(k): str(v) for k, v in (cluster_info or {}).items()}
        self._key = auth.resolve_key(cluster_token)
        self._decoder = BoundedDecoder(MasterRequest, MAX_REQUEST_FRAME_BYTES)

        self._lock = threading.Lock()  # stats only
        self._stats: dict[str, int] = {
            "frames_received": 0,
            "frames_accepted": 0,
            "requests_ok": 0,
            "duplicates": 0,
            "local_calls": 0,
            "error_replies": 0,
            "replies_dropped": 0,
            "internal_errors": 0,
            "ids_held": 0,
            "ports_held": 0,
            "ports_skipped_unbindable": 0,
            **reject_stat_keys(),
            **{f"failed.{c.value}": 0 for c in MasterErrorCode},
        }
        self._reject_log = RejectLog(logger, "OmniMasterServer rejected a frame")
        self._dedup: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._dedup_bytes = 0

        self._calls: queue.SimpleQueue[tuple[object, Future]] = queue.SimpleQueue()
        self._call_lock = threading.Lock()  # closed flag vs. enqueue
        self._ctx = zmq.Context()
        self._router: zmq.Socket | None = None
        self._thread = PollerThread("OmniMasterServer", self._step, lambda: None,
                                    self._count_internal_error)
        self._waker = self._thread.waker
        self._closed = False
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, ROUTER_HARD_MAX_BYTES)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # report undeliverable replies
            bind(self._router, address)
        except BaseException:
            self._release_resources()
            raise
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)

        self._thread.start([self._router])
        logger.info(
            "OmniMasterServer listening on %s (ports %d-%d, endpoints %s, auth %s)",
            self.address, lo, hi, ",".join(names), "on" if self._key else "off",
        )

    # ------------------------------------------------------------------ public

    @property
    def stats(self) -> dict[str, int]:
        """Snapshot of the counters.

        ``frames_received == frames_accepted + Σ rejected.<reason>``;
        ``frames_accepted`` counts valid requests including ``duplicates``
        (retries answered from the cache). ``requests_ok`` and
        ``failed.<code>`` count executed operations, remote and
        ``local_calls`` alike. ``error_replies`` counts rejected frames that
        were answered; ``replies_dropped`` replies libzmq could not deliver.
        Gauges: ``ids_held``, ``ports_held``; ``ports_skipped_unbindable``
        counts ports passed over because a local test-bind failed.
        """
        with self._lock:
            return dict(self._stats)

    def register_local(
        self, stage_id: int, replica_address: str, num_replicas: int = 1,
        *, timeout: float = 10.0,
    ) -> list[ReplicaAssignment]:
        """Register replicas of this process (the head) through the poller thread.

        Same allocation path, same table and same ordering as remote requests.

        Returns:
            The new assignments, replica ids ascending.

        Raises:
            MasterError: Refused (``no_ports``, ``stage_full``, ``bad_address``,
                ``invalid``) or the server is closed (``closed``).
            TimeoutError: The poller did not answer within ``timeout`` seconds.
        """
        body = RegisterRequest(stage_id=stage_id, replica_address=replica_address,
                               num_replicas=num_replicas)
        return self._call(body, timeout).assignments

    def deregister_local(
        self, stage_id: int, replica_ids: Iterable[int], *, timeout: float = 10.0,
    ) -> list[int]:
        """Release replica ids of ``stage_id`` (and their ports); returns the ids freed.

        Ids not held are ignored. Raises as :meth:`register_local`.
        """
        body = DeregisterRequest(stage_id=stage_id, replica_ids=list(replica_ids))
        return self._call(body, timeout).freed

    def assignments(
        self, stage_id: int | None = None, *, timeout: float = 10.0,
    ) -> list[ReplicaAssignment]:
        """Copies of the held assignments (one stage, or all by stage), ids ascending."""
        return self._call(("snapshot", stage_id), timeout).assignments

    def close(self) -> None:
        """Stop the poller thread, close the socket and context. Idempotent.

        Pending in-process calls fail with ``MasterError("closed")``.
        """
        with self._call_lock:
            if self._closed:
                return
            self._closed = True
        self._thread.stop()
        self._fail_pending_calls()
        self._release_resources()
        logger.info("OmniMasterServer closed")

    # ------------------------------------------------------- in-process calls

    def _call(self, body: object, timeout: float) -> MasterReply:
        fut: Future = Future()
        with self._call_lock:
            if self._closed:
                raise MasterError(MasterErrorCode.CLOSED.value, "OmniMasterServer is closed")
            self._calls.put((body, fut))
        self._waker.wake()
        try:
            reply: MasterReply = fut.result(timeout=timeout)
        except FutureTimeout:
            raise TimeoutError(f"OmniMasterServer did not answer within {timeout}s") from None
        if not reply.ok:
            raise MasterError(reply.error, reply.detail)
        return reply

    def _drain_calls(self) -> None:
        while True:
            try:
                body, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if isinstance(body, tuple):  # ("snapshot", stage_id)
                    reply = MasterReply(request_id=0, ok=True,
                                        assignments=self._alloc.snapshot(body[1]))
                else:
                    with self._lock:
                        self._stats["local_calls"] += 1
                    reply = self._execute(0, body)  # type: ignore[arg-type]
                fut.set_result(reply)
            except BaseException as e:  # pragma: no cover - defensive
                fut.set_exception(e)

    def _fail_pending_calls(self) -> None:
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(MasterError(MasterErrorCode.CLOSED.value,
                                              "OmniMasterServer is closed"))

    # ------------------------------------------------------------ poller loop

    def _step(self, ready: dict) -> None:
        """One round of the serving thread: in-process calls, then received frames."""
        self._drain_calls()
        if self._router in ready:
            self._drain_router()

    def _count_internal_error(self) -> None:
        with self._lock:
            self._stats["internal_errors"] += 1

    def _drain_router(self) -> None:
        assert self._router is not None
        for _ in range(_RECV_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle_frames(frames)
            except Exception:  # never let one frame kill the loop
                with self._lock:
                    self._stats["internal_errors"] += 1
                logger.exception("OmniMasterServer: error handling a frame (dropped)")

    def _handle_frames(self, frames: list[zmq.Frame]) -> None:
        # ROUTER prepends the sender identity: [identity, payload(, hmac)].
        identity = frames[0].bytes
        try:
            if self._key is None and len(frames) == 3:  # identity, payload, signature
                raise FrameRejected(RejectReason.BAD_TOKEN, "the request is signed with a "
                                    "cluster token and this head has none")
            req = envelope.unseal(self._key, [f.buffer for f in frames[1:]], self._decoder)
        except FrameRejected as rej:
            self._count_reject(rej)
            self._answer_reject(identity, frames, rej)
            return
        with self._lock:
            self._stats["frames_received"] += 1
            self._stats["frames_accepted"] += 1
        key = (req.client_id, req.request_id)
        cached = self._dedup.get(key)
        if cached is not None:  # a retry: same answer, no second allocation
            self._dedup.move_to_end(key)
            with self._lock:
                self._stats["duplicates"] += 1
            self._send(identity, cached)
            return
        reply = encode(self._execute(req.request_id, req.body))
        self._remember(key, reply)
        self._send(identity, reply)

    def _execute(self, request_id: int, body: RegisterRequest | DeregisterRequest) -> MasterReply:
        """Apply one operation to the allocation table (poller thread only)."""
        try:
            if isinstance(body, RegisterRequest):
                out = self._alloc.register(body)
                reply = MasterReply(request_id=request_id, ok=True, assignments=out,
                                    cluster_info=self._cluster_info)
                logger.info(
                    "Stage %d: replica id(s) %s registered on %s",
                    body.stage_id, [a.replica_id for a in out], body.replica_address,
                )
            else:
                freed, not_held = self._alloc.deregister(body)
                reply = MasterReply(request_id=request_id, ok=True, freed=freed,
                                    not_held=not_held, cluster_info=self._cluster_info)
                if freed:
                    logger.info("Stage %d: replica id(s) %s deregistered", body.stage_id, freed)
            counter = "requests_ok"
        except _AllocError as e:
            reply = MasterReply(request_id=request_id, ok=False, error=e.code.value,
                                detail=e.detail, cluster_info=self._cluster_info)
            counter = f"failed.{e.code.value}"
            logger.warning("OmniMasterServer refused %s: %s", type(body).__name__, e)
        except Exception as e:  # a bug: answer, log, keep serving
            logger.exception("OmniMasterServer: internal error on %s", type(body).__name__)
            reply = MasterReply(request_id=request_id, ok=False,
                                error=MasterErrorCode.INTERNAL.value, detail=repr(e)[:200])
            counter = f"failed.{MasterErrorCode.INTERNAL.value}"
        with self._lock:
            self._stats[counter] += 1
            self._stats["ids_held"] = self._alloc.num_held
            self._stats["ports_held"] = len(self._alloc.ports_in_use)
            self._stats["ports_skipped_unbindable"] = self._alloc.ports_skipped_unbindable
        return reply

    def _answer_reject(self, identity: bytes, frames: list[zmq.Frame],
                       rej: FrameRejected) -> None:
        """Send an error reply if the frame names a request id, else drop it."""
        if rej.reason is RejectReason.OVERSIZE or len(frames) < 2:
            return  # never parse an oversize frame; nothing to parse otherwise
        payload = frames[1].buffer
        if len(payload) > MAX_REQUEST_FRAME_BYTES:
            return
        peek = peek_request(payload)
        if peek is None:  # untrusted bytes: anything unreadable means "cannot answer"
            return
        reply = MasterReply(request_id=peek.request_id, ok=False, error=rej.reason.value,
                            detail=rej.detail[:200])
        with self._lock:
            self._stats["error_replies"] += 1
        self._send(identity, encode(reply))

    def _send(self, identity: bytes, payload: bytes) -> None:
        assert self._router is not None
        parts = [identity, *envelope.seal(self._key, payload)]
        try:
            self._router.send_multipart(parts, zmq.NOBLOCK)
        except zmq.ZMQError:  # peer gone (ROUTER_MANDATORY) or its queue full
            with self._lock:
                self._stats["replies_dropped"] += 1

    def _remember(self, key: tuple[str, int], reply: bytes) -> None:
        self._dedup[key] = reply
        self._dedup_bytes += len(reply)
        while self._dedup_bytes > _DEDUP_CACHE_BYTES and len(self._dedup) > 1:
            _, old = self._dedup.popitem(last=False)
            self._dedup_bytes -= len(old)

    def _count_reject(self, rej: FrameRejected) -> None:
        with self._lock:
            self._stats["frames_received"] += 1
            self._stats[f"rejected.{rej.reason.value}"] += 1
        self._reject_log.note(rej)

    def _release_resources(self) -> None:
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        self._ctx.term()
        self._waker.close()


