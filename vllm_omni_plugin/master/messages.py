"""Wire types of the master server (registration of replicas, ids, ports).

Two tagged message types travel on the master's socket, both carrying
``protocol_version`` (the control plane's shared :data:`~.messages.PROTOCOL_VERSION`,
so :class:`~.codec.BoundedDecoder` checks them like the coordinator's):

* :class:`MasterRequest` (tag ``"master_request"``): client (DEALER) → master
  (ROUTER). An envelope with a ``client_id`` and ``request_id`` (the reply
  correlation and de-duplication key) around one operation, ``body``:
  :class:`RegisterRequest` (``op = "register"``) or :class:`DeregisterRequest`
  (``op = "deregister"``).
* :class:`MasterReply` (tag ``"master_reply"``): master → client. ``ok`` with
  the result, or an ``error`` code (a :class:`MasterErrorCode` value) and detail.

Encoding: msgpack maps (never pickle, never JSON). Field constraints (``Meta``)
are enforced when a frame is decoded. See ``docs/design/coordinator.md``
("Master server").
"""

from __future__ import annotations

import ipaddress
from enum import Enum
from typing import Annotated

import msgspec

from vllm_omni_plugin.wire import PROTOCOL_VERSION

#: Largest accepted :class:`MasterRequest` frame, in bytes, checked before any
#: parsing. A deregister of :data:`MAX_IDS_PER_REQUEST` ids of 9 bytes each is
#: ~9.2 KiB; a maximal register is ~460 bytes.
MAX_REQUEST_FRAME_BYTES = 16 * 1024

#: Largest accepted :class:`MasterReply` frame, in bytes (a register of
#: :data:`MAX_REPLICAS_PER_REQUEST` replicas with 8 endpoints of 64-character
#: names and 253-character hosts is ~211 KiB).
MAX_REPLY_FRAME_BYTES = 256 * 1024

#: Most replicas one register request may ask for.
MAX_REPLICAS_PER_REQUEST = 256

#: Most replica ids one deregister request may name.
MAX_IDS_PER_REQUEST = 1024

#: Longest accepted replica host (a DNS name is at most 253 characters).
MAX_HOST_CHARS = 253

#: Longest accepted ``client_id``, in characters.
MAX_CLIENT_ID_CHARS = 64

_Host = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_CHARS)]
_NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_ClientId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CLIENT_ID_CHARS)]
_NumReplicas = Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS_PER_REQUEST)]
_IdList = Annotated[list[_NonNegInt], msgspec.Meta(max_length=MAX_IDS_PER_REQUEST)]


class MasterErrorCode(str, Enum):
    """Error codes of :class:`MasterReply` (``error`` field).

    Frame-level rejects reuse :class:`~.codec.RejectReason` values
    (``malformed``, ``bad_version``, ``bad_token``, ``unknown_type``,
    ``invalid``); the codes below are the master's own. Clients must accept
    codes they do not know (newer masters may add some).
    """

    #: The port range has fewer free (and, for local hosts, bindable) ports
    #: than the request needs. Nothing was allocated.
    NO_PORTS = "no_ports"
    #: The stage already holds ``max_replicas_per_stage`` replicas. Nothing was
    #: allocated.
    STAGE_FULL = "stage_full"
    #: ``replica_address`` is not a connectable host (empty, wildcard, URL...).
    BAD_ADDRESS = "bad_address"
    #: The master is shutting down.
    CLOSED = "closed"
    #: An unexpected exception in the master (logged there).
    INTERNAL = "internal"


class RegisterRequest(msgspec.Struct, tag="register", tag_field="op"):
    """Ask the master for ``num_replicas`` replica ids of ``stage_id`` and their ports.

    Attributes:
        stage_id: Pipeline stage (>= 0).
        replica_address: Host (IP literal or DNS name, no scheme, no port) the
            replicas bind their endpoints on and that peers connect to. Must
            not be a wildcard (``0.0.0.0``, ``::``, ``*``). See
            :func:`~.master.route_probe_address`.
        num_replicas: 1 .. :data:`MAX_REPLICAS_PER_REQUEST`; all-or-nothing.
    """

    stage_id: _NonNegInt
    replica_address: _Host
    num_replicas: _NumReplicas = 1


class DeregisterRequest(msgspec.Struct, tag="deregister", tag_field="op"):
    """Release replica ids of ``stage_id`` (and their ports). Idempotent.

    Attributes:
        stage_id: Pipeline stage (>= 0).
        replica_ids: Ids to release (at most :data:`MAX_IDS_PER_REQUEST`);
            ids not currently held are reported back in ``not_held``.
    """

    stage_id: _NonNegInt
    replica_ids: _IdList


class MasterRequest(msgspec.Struct, tag="master_request", tag_field="type"):
    """Client → master envelope.

    Attributes:
        client_id: Random per-client identifier (1-64 chars); with
            ``request_id`` it de-duplicates retries.
        request_id: Per-client request counter (>= 0); echoed in the reply.
            A resend with the same ``(client_id, request_id)`` gets the
            original reply instead of a second allocation.
        body: The operation.
        protocol_version: Wire schema version, :data:`PROTOCOL_VERSION`.
    """

    client_id: _ClientId
    request_id: _NonNegInt
    body: RegisterRequest | DeregisterRequest
    protocol_version: int = PROTOCOL_VERSION


class ReplicaAssignment(msgspec.Struct):
    """One replica the master assigned.

    Attributes:
        stage_id: Pipeline stage.
        replica_id: Id unique within the stage while held.
        host: The registrant's ``replica_address``.
        ports: Endpoint name → TCP port, one per name in the master's
            ``endpoint_names`` (default ``handshake``, ``input``, ``output``).
            Ports are unique across every replica the master holds.
    """

    stage_id: _NonNegInt
    replica_id: _NonNegInt
    host: _Host
    ports: dict[str, _Port]

    def endpoint(self, name: str) -> str:
        """``tcp://host:port`` of endpoint ``name`` (IPv6 hosts bracketed).

        Raises:
            KeyError: If the master assigned no endpoint called ``name``.
        """
        return tcp_address(self.host, self.ports[name])


class MasterReply(msgspec.Struct, tag="master_reply", tag_field="type"):
    """Master → client reply.

    Attributes:
        request_id: The request's ``request_id`` (``0`` never matches a pending
            request when the master could not read one; such replies are not
            sent).
        ok: True on success; then ``error`` is ``""``.
        error: A :class:`MasterErrorCode` or :class:`~.codec.RejectReason`
            value when ``ok`` is False.
        detail: Human-readable detail for logs (may be empty).
        assignments: Register: the new replicas, ids ascending.
        freed: Deregister: ids released by this request.
        not_held: Deregister: requested ids that were not held.
        cluster_info: Free-form addresses the master advertises to registrants
            (e.g. the coordinator's ``coordinator_router`` / ``coordinator_pub``).
        protocol_version: The master's wire schema version.
    """

    request_id: _NonNegInt
    ok: bool
    error: str = ""
    detail: str = ""
    assignments: list[ReplicaAssignment] = msgspec.field(default_factory=list)
    freed: list[_NonNegInt] = msgspec.field(default_factory=list)
    not_held: list[_NonNegInt] = msgspec.field(default_factory=list)
    cluster_info: dict[str, str] = msgspec.field(default_factory=dict)
    protocol_version: int = PROTOCOL_VERSION


class ReplyPeek(msgspec.Struct):
    """Lenient view of any frame: just enough to route an error reply.

    Used on frames that failed a check (the master, to answer them) and on
    replies that failed verification or version checks (the client, to turn
    them into a precise error). Unknown keys are ignored.
    """

    request_id: _NonNegInt
    client_id: str = ""
    error: str = ""
    protocol_version: int = -1


def tcp_address(host: str, port: int) -> str:
    """``tcp://host:port``; an IPv6 literal host is bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def check_replica_address(host: str) -> str | None:
    """Why ``host`` cannot be a replica address, or ``None`` if it can.

    Accepts an IP literal (IPv6 optionally bracketed) or a DNS-like name. No
    name resolution is done. Rejects wildcards, schemes, ports, whitespace.
    """
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare or bare == "*":
        return "empty or wildcard host"
    if "://" in bare or "/" in bare or any(c.isspace() for c in bare):
        return "host must be a bare IP or name (no scheme, path or whitespace)"
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        if ":" in bare:
            return "host must not contain a port"
        return None
    if ip.is_unspecified:
        return f"{bare} is a wildcard address; give the address peers connect to"
    return None


# ------------------------------------------------------------------------------ errors


class MasterError(RuntimeError):
    """The master refused or failed a request.

    Attributes:
        code: A :class:`~.master_messages.MasterErrorCode` or
            :class:`~.codec.RejectReason` value (or a newer master's code).
        detail: Human-readable detail.
    """

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(f"{code}: {detail}" if detail else code)
        self.code = code
        self.detail = detail


class MasterTimeout(MasterError, TimeoutError):
    """No valid reply after all attempts (master down, unreachable, or dropping us)."""

    def __init__(self, detail: str) -> None:
        super().__init__("timeout", detail)


_PEEK_DECODER = msgspec.msgpack.Decoder(ReplyPeek)


def peek_request(payload: bytes) -> ReplyPeek | None:
    """Leniently read ``request_id`` from an untrusted frame; None when unreadable."""
    try:
        return _PEEK_DECODER.decode(payload)
    except Exception:  # untrusted bytes: any failure means "cannot read"
        return None
