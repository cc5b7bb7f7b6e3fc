"""Wire types of the coordinator control plane (``msgspec`` structs, msgpack).

Two message types travel on the wire, both tagged (``"type"`` key) and both
carrying ``protocol_version``:

* :class:`ReplicaEvent` (tag ``"replica_event"``): stage client (DEALER) →
  coordinator (ROUTER). Every event carries the replica's *full* reported state
  (status and queue length), so any event -- ``update`` or ``heartbeat`` --
  is enough to (re)build the coordinator's view of that replica.
* :class:`ReplicaList` (tag ``"replica_list"``): coordinator (PUB) → hub
  clients (SUB). The active (``UP``) replicas, as :class:`ReplicaInfo`.

Names, field names and field order follow upstream vllm-omni's
``vllm_omni.distributed.omni_coordinator.messages`` so callers can switch; the
encoding (msgpack map, never JSON or pickle), the tag, ``protocol_version`` and
decode-time bounds are ours. See ``docs/design/coordinator.md``.

Field constraints (``Meta``) are enforced when a frame is *decoded*, not when a
struct is constructed in Python.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import msgspec

# The control plane's one schema version: a frame whose ``protocol_version``
# differs is rejected (counted as ``bad_version``); bump it on any incompatible
# change of the messages below.
from vllm_omni_plugin.wire import PROTOCOL_VERSION

#: Largest accepted :class:`ReplicaEvent` frame, in bytes. Checked before any
#: decoding. A maximal legal event (two 512-character addresses) is ~1.2 KiB.
MAX_EVENT_FRAME_BYTES = 4 * 1024

#: Largest accepted :class:`ReplicaList` frame, in bytes (about 20 000
#: replicas at ~200 bytes each). The coordinator refuses to publish a larger
#: list, hub clients refuse to decode one.
MAX_LIST_FRAME_BYTES = 4 * 1024 * 1024

#: Longest accepted replica address (``input_addr`` / ``output_addr``), in
#: characters.
MAX_ADDR_CHARS = 512

_Addr = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADDR_CHARS)]
_NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
_Timestamp = Annotated[float, msgspec.Meta(ge=0.0)]


class ReplicaStatus(str, Enum):
    """Status of a stage replica.

    ``UP`` and ``DOWN`` are reported by the replica itself (``DOWN`` = graceful
    close or drain); ``ERROR`` is set by the coordinator when no event arrived
    within its heartbeat timeout (a replica may also report it). Any later event
    from the replica replaces ``ERROR`` with the status it reports.
    """

    UP = "up"
    DOWN = "down"
    ERROR = "error"


class EventType(str, Enum):
    """Why a :class:`ReplicaEvent` was sent (informational: both carry full state)."""

    #: First registration, ``update_info()`` and the final ``DOWN`` on close.
    UPDATE = "update"
    #: Periodic liveness signal with the live queue length.
    HEARTBEAT = "heartbeat"


class ReplicaEvent(msgspec.Struct, tag="replica_event", tag_field="type"):
    """Stage replica → coordinator event (upstream field order kept).

    Attributes:
        input_addr: ZMQ address the replica's EngineCore receives requests on;
            the replica's identity in the coordinator.
        output_addr: ZMQ address the replica's outputs come from.
        stage_id: Pipeline stage the replica serves (>= 0).
        status: Status the replica reports.
        queue_length: Live number of unfinished requests (>= 0).
        event_type: :class:`EventType` value.
        protocol_version: Wire schema version, :data:`PROTOCOL_VERSION`.
    """

    input_addr: _Addr
    output_addr: _Addr
    stage_id: _NonNegInt
    status: ReplicaStatus
    queue_length: _NonNegInt
    event_type: EventType
    protocol_version: int = PROTOCOL_VERSION


class ReplicaInfo(msgspec.Struct):
    """One replica as the coordinator knows it (and publishes it to hubs).

    Attributes:
        input_addr, output_addr, stage_id, status, queue_length: last reported
            values (``status`` may be ``ERROR`` set by the coordinator).
        last_heartbeat: Wall-clock time (``time.time()``, seconds) of the last
            event received from the replica.
        registered_at: Wall-clock time (seconds) the replica was first seen.

    Instances inside a :class:`ReplicaList` obtained from a hub client are
    shared snapshots: treat them as read-only.
    """

    input_addr: _Addr
    output_addr: _Addr
    stage_id: _NonNegInt
    status: ReplicaStatus
    queue_length: _NonNegInt
    last_heartbeat: _Timestamp
    registered_at: _Timestamp


class ReplicaList(msgspec.Struct, tag="replica_list", tag_field="type"):
    """Coordinator → hub broadcast: the active (``UP``) replicas.

    Attributes:
        replicas: Active replicas, in registration order.
        timestamp: Wall-clock publish time (seconds); ``0.0`` means "nothing
            received yet" in a hub client's cache.
        seq: Per-coordinator publish counter (starts at 1; restarts with the
            coordinator). Informational.
        protocol_version: Wire schema version, :data:`PROTOCOL_VERSION`.
    """

    replicas: list[ReplicaInfo]
    timestamp: _Timestamp
    seq: _NonNegInt = 0
    protocol_version: int = PROTOCOL_VERSION


def empty_replica_list() -> ReplicaList:
    """A fresh empty :class:`ReplicaList` with ``timestamp=0.0``."""
    return ReplicaList(replicas=[], timestamp=0.0)

