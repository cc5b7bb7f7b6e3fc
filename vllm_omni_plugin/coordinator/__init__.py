"""OmniCoordinator: replica liveness, replica-list broadcasts and load balancing.

Public names follow upstream vllm-omni's ``vllm_omni.distributed.omni_coordinator``;
the wire protocol is ours (typed msgspec structs, msgpack, versioned, bounded).
Design: ``docs/design/coordinator.md``.
"""

from vllm_omni_plugin.master import (
    DEFAULT_ENDPOINT_NAMES,
    DEFAULT_PORT_RANGE,
    MAX_REPLY_FRAME_BYTES,
    MAX_REQUEST_FRAME_BYTES,
    DeregisterRequest,
    MasterError,
    MasterErrorCode,
    MasterReply,
    MasterRequest,
    MasterTimeout,
    OmniMasterClient,
    OmniMasterServer,
    RegisterRequest,
    ReplicaAssignment,
    route_probe_address,
)
from vllm_omni_plugin.wire.auth import CLUSTER_TOKEN_ENV, cluster_token_from_env
from vllm_omni_plugin.wire.codec import RejectReason

from .client_for_hub import OmniCoordClientForHub
from .client_for_stage import OmniCoordClientForStage
from .load_balancer import (
    LeastQueueLengthBalancer,
    LoadBalancer,
    LoadBalancingPolicy,
    RandomBalancer,
    RoundRobinBalancer,
    Task,
    build_load_balancer_factory,
)
from .messages import (
    MAX_EVENT_FRAME_BYTES,
    MAX_LIST_FRAME_BYTES,
    PROTOCOL_VERSION,
    EventType,
    ReplicaEvent,
    ReplicaInfo,
    ReplicaList,
    ReplicaStatus,
)
from .omni_coordinator import OmniCoordinator
from .runtime import OmniCoordinatorRuntime

# The omni master's names are here too, as upstream vllm-omni has them beside the
# coordinator's (their home is vllm_omni_plugin.master).
__all__ = [
    "CLUSTER_TOKEN_ENV",
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
    "MAX_EVENT_FRAME_BYTES",
    "MAX_LIST_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "EventType",
    "LeastQueueLengthBalancer",
    "LoadBalancer",
    "LoadBalancingPolicy",
    "OmniCoordClientForHub",
    "OmniCoordClientForStage",
    "OmniCoordinator",
    "OmniCoordinatorRuntime",
    "RandomBalancer",
    "RejectReason",
    "ReplicaEvent",
    "ReplicaInfo",
    "ReplicaList",
    "ReplicaStatus",
    "RoundRobinBalancer",
    "Task",
    "build_load_balancer_factory",
    "cluster_token_from_env",
]

