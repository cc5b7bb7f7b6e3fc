"""OmniMasterClient: how a headless registrant talks to the OmniMasterServer.

Request/reply over a DEALER socket with timeouts and idempotent retries, plus
:func:`route_probe_address`, the local address a host uses to reach the
master. Server side and allocation rules: :mod:`.master`; wire schema:
:mod:`.master_messages` and ``docs/design/coordinator.md``.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterable

import zmq

from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.wire import PROTOCOL_VERSION, auth, envelope
from vllm_omni_plugin.wire.codec import BoundedDecoder, FrameRejected, RejectReason, encode
from vllm_omni_plugin.wire.sockets import ClosedOnExit, connect

from .messages import (
    MAX_CLIENT_ID_CHARS,
    MAX_IDS_PER_REQUEST,
    MAX_REPLICAS_PER_REQUEST,
    MAX_REPLY_FRAME_BYTES,
    MAX_REQUEST_FRAME_BYTES,
    DeregisterRequest,
    MasterError,
    MasterReply,
    MasterRequest,
    MasterTimeout,
    RegisterRequest,
    ReplicaAssignment,
    check_replica_address,
    peek_request,
)

logger = init_logger(__name__)


class OmniMasterClient(ClosedOnExit):
    """A registrant's link to the master (DEALER): request/reply with retries.

    Thread-safe (one request at a time per client). Each attempt waits up to
    ``timeout`` seconds; on timeout the *same* request (same ``request_id``) is
    sent again, and the master answers a repeat from its cache instead of
    allocating twice. Replies to earlier requests that arrive late are
    discarded. Requests sent before the master binds are queued by ZMQ and
    delivered when it comes up.

    Args:
        master_address: The master's ROUTER address (``tcp://host:port``).
        timeout: Seconds to wait for a reply per attempt (default 5.0).
        retries: Extra attempts after the first (default 3); total wait is at
            most ``timeout * (retries + 1)``.
        cluster_token: Shared secret used to sign requests and verify replies.
            ``None`` reads ``VLLM_OMNI_PLUGIN_CLUSTER_TOKEN``; ``""`` disables.
        client_id: De-duplication identity (default: a random UUID). Reuse
            one only for the same logical registrant.

    Raises:
        ValueError: On a non-positive ``timeout``, negative ``retries`` or a bad
            ``client_id``.
        RuntimeError: If ``master_address`` cannot be connected to.

    Attributes:
        cluster_info: ``cluster_info`` of the last successful reply.
        stats: ``requests``, ``attempts``, ``stale_replies`` (late or foreign
            replies discarded), ``bad_replies`` (undecodable or unsigned).
    """

    def __init__(
        self,
        master_address: str,
        *,
        timeout: float = 5.0,
        retries: int = 3,
        cluster_token: str | None = None,
        client_id: str | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.client_id = client_id if client_id is not None else uuid.uuid4().hex
        if not 0 < len(self.client_id) <= MAX_CLIENT_ID_CHARS:
            raise ValueError(f"client_id must be 1-{MAX_CLIENT_ID_CHARS} characters")
        self.master_address = master_address
        self._timeout_ms = max(1, int(timeout * 1000))
        self._retries = int(retries)
        self._key = auth.resolve_key(cluster_token)
        self._decoder = BoundedDecoder(MasterReply, MAX_REPLY_FRAME_BYTES)
        self._lock = threading.Lock()
        self._next_id = 1
        self._closed = False
        self.cluster_info: dict[str, str] = {}
        self.stats: dict[str, int] = {
            "requests": 0, "attempts": 0, "stale_replies": 0, "bad_replies": 0,
        }
        self._ctx = zmq.Context()
        self._socket = connect(
            self._ctx, zmq.DEALER, master_address,
            {zmq.LINGER: 0, zmq.MAXMSGSIZE: 4 * MAX_REPLY_FRAME_BYTES},
        )

    def register(
        self, stage_id: int, replica_address: str, num_replicas: int = 1,
    ) -> list[ReplicaAssignment]:
        """Ask the master for ``num_replicas`` replica ids of ``stage_id`` and their ports.

        Args:
            stage_id: Pipeline stage (>= 0).
            replica_address: Host the replicas bind on and peers connect to
                (see :func:`route_probe_address`).
            num_replicas: 1 .. :data:`~.master_messages.MAX_REPLICAS_PER_REQUEST`.

        Returns:
            The assignments, replica ids ascending; all or nothing.

        Raises:
            ValueError: Invalid arguments (checked before sending).
            MasterError: The master refused (``code``: ``no_ports``,
                ``stage_full``, ``bad_token``, ``bad_version``, ...).
            MasterTimeout: No reply after all attempts.
        """
        if stage_id < 0:
            raise ValueError(f"stage_id must be >= 0, got {stage_id}")
        if not 1 <= num_replicas <= MAX_REPLICAS_PER_REQUEST:
            raise ValueError(
                f"num_replicas must be in 1..{MAX_REPLICAS_PER_REQUEST}, got {num_replicas}")
        why = check_replica_address(replica_address)
        if why is not None:
            raise ValueError(f"replica_address {replica_address!r}: {why}")
        body = RegisterRequest(stage_id=stage_id, replica_address=replica_address,
                               num_replicas=num_replicas)
        return self._request(body).assignments

    def deregister(self, stage_id: int, replica_ids: Iterable[int]) -> list[int]:
        """Release replica ids (and their ports); returns the ids actually freed.

        Idempotent: ids not held are ignored.

        Raises:
            ValueError: More than :data:`~.master_messages.MAX_IDS_PER_REQUEST` ids.
            MasterError, MasterTimeout: As :meth:`register`.
        """
        ids = list(replica_ids)
        if len(ids) > MAX_IDS_PER_REQUEST:
            raise ValueError(f"at most {MAX_IDS_PER_REQUEST} ids per request, got {len(ids)}")
        return self._request(DeregisterRequest(stage_id=stage_id, replica_ids=ids)).freed

    def close(self) -> None:
        """Close the socket and context. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._socket.close(linger=0)
            self._ctx.term()

    # --------------------------------------------------------------- internals

    def _request(self, body: RegisterRequest | DeregisterRequest) -> MasterReply:
        with self._lock:
            if self._closed:
                raise RuntimeError("OmniMasterClient is closed")
            request_id = self._next_id
            self._next_id += 1
            payload = encode(MasterRequest(client_id=self.client_id, request_id=request_id,
                                           body=body))
            if len(payload) > MAX_REQUEST_FRAME_BYTES:
                raise ValueError(f"request is {len(payload)} bytes, over the "
                                 f"{MAX_REQUEST_FRAME_BYTES}-byte limit")
            parts = envelope.seal(self._key, payload)
            self.stats["requests"] += 1
            for _ in range(self._retries + 1):
                self.stats["attempts"] += 1
                try:
                    self._socket.send_multipart(parts, zmq.NOBLOCK)
                except zmq.Again:  # send queue full: the master is unreachable
                    pass
                reply = self._await_reply(request_id)
                if reply is not None:
                    if reply.cluster_info:
                        self.cluster_info = dict(reply.cluster_info)
                    return reply
            raise MasterTimeout(
                f"no reply from the master at {self.master_address} after "
                f"{self._retries + 1} attempt(s) of {self._timeout_ms / 1000:.1f}s"
            )

    def _await_reply(self, request_id: int) -> MasterReply | None:
        deadline = time.monotonic() + self._timeout_ms / 1000.0
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self._socket.poll(remaining_ms, zmq.POLLIN):
                return None
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # pragma: no cover - poll said readable
                continue
            reply = self._parse_reply(frames, request_id)
            if reply is not None:
                return reply

    def _parse_reply(self, frames: list[bytes], request_id: int) -> MasterReply | None:
        """The reply to ``request_id``, ``None`` to keep waiting; raises on refusal."""
        if len(frames) not in (1, 2) or len(frames[0]) > MAX_REPLY_FRAME_BYTES:
            self.stats["bad_replies"] += 1
            return None
        payload = frames[0]
        if not envelope.verified(self._key, frames):
            # An unverifiable reply is trusted for one thing only: a master with a
            # different token, or none, telling us it rejected our signature (the worst an
            # injected one can do is fail this request, as dropping it would).
            peek = peek_request(payload)
            if peek is not None and peek.request_id == request_id and \
                    peek.error == RejectReason.BAD_TOKEN.value:
                raise MasterError(RejectReason.BAD_TOKEN.value, (
                    "the head has no cluster token and this process has one"
                    if len(frames) == 1 else "the head's cluster token differs from this "
                    "process's") + f": give both the same {auth.CLUSTER_TOKEN_ENV}")
            self.stats["bad_replies"] += 1
            return None
        try:
            reply = self._decoder.decode(payload)
        except FrameRejected as rej:
            peek = peek_request(payload)
            if rej.reason is RejectReason.BAD_VERSION and peek is not None and \
                    peek.request_id == request_id:
                raise MasterError(
                    RejectReason.BAD_VERSION.value,
                    f"the master speaks protocol {peek.protocol_version}, "
                    f"this client {PROTOCOL_VERSION}",
                ) from None
            self.stats["bad_replies"] += 1
            return None
        if reply.request_id != request_id:
            self.stats["stale_replies"] += 1
            return None
        if not reply.ok:
            if reply.error == RejectReason.BAD_TOKEN.value and self._key is None:
                raise MasterError(reply.error, "the head requires a cluster token and this "
                                  f"process has none: set {auth.CLUSTER_TOKEN_ENV} (or "
                                  "--omni-cluster-token) to the head's token")
            raise MasterError(reply.error, reply.detail)
        return reply


def route_probe_address(
    master_host: str, master_port: int = 9, *, override: str | None = None,
) -> str:
    """The local IP this host would use to reach ``master_host`` (or ``override``).

    Opens a UDP socket and ``connect()``s it to the master, which only makes
    the kernel choose a route and source address: no packet is sent. That
    source address is what a headless replica should bind on and advertise,
    since the master's host reached us through it. Behind NAT, with several
    NICs where the master's route is not the one peers should use, or in
    containers with published ports, pass ``override``
    (``--omni-replica-address``).

    Args:
        master_host: Host name or IP of the master; ``tcp://host:port`` and
            bracketed IPv6 are accepted (the port is then taken from it).
        master_port: Port used for the route lookup (routing rarely depends on
            it; default 9, "discard").
        override: If given, validated and returned as is.

    Returns:
        An IP literal (IPv6 without brackets).

    Raises:
        ValueError: ``override`` is not a usable replica address.
        OSError: The master's host cannot be resolved or no route exists.
    """
    if override is not None:
        why = check_replica_address(override)
        if why is not None:
            raise ValueError(f"replica address override {override!r}: {why}")
        return override
    host = master_host
    if host.startswith("tcp://"):
        host = host[len("tcp://"):]
        head, sep, port = host.rpartition(":")
        if sep and port.isdigit() and (not head.count(":") or head.endswith("]")):
            host, master_port = head, int(port)
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family, _, _, _, sockaddr = socket.getaddrinfo(host, master_port, 0, socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])
