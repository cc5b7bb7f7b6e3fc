"""The omni master: registration of replicas with the head, replica-id
assignment and port allocation (:mod:`.server`), its client for headless
processes (:mod:`.client`) and their wire messages (:mod:`.messages`).
Also importable from :mod:`vllm_omni_plugin.coordinator` (upstream's names)."""

from .client import OmniMasterClient, route_probe_address
from .messages import (
    MAX_REPLY_FRAME_BYTES,
    MAX_REQUEST_FRAME_BYTES,
    DeregisterRequest,
    MasterError,
    MasterErrorCode,
    MasterReply,
    MasterRequest,
    MasterTimeout,
    RegisterRequest,
    ReplicaAssignment,
)
from .server import DEFAULT_ENDPOINT_NAMES, DEFAULT_PORT_RANGE, OmniMasterServer

__all__ = [
    "DEFAULT_ENDPOINT_NAMES",
    "DEFAULT_PORT_RANGE",
    "MAX_REPLY_FRAME_BYTES",
    "MAX_REQUEST_FRAME_BYTES",
    "DeregisterRequest",
    "MasterError",
    "MasterErrorCode",
    "MasterReply",
    "MasterRequest",
    "MasterTimeout",
    "OmniMasterClient",
    "OmniMasterServer",
    "RegisterRequest",
    "ReplicaAssignment",
    "route_probe_address",
]
