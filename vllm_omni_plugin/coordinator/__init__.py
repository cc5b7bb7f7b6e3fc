"""OmniCoordinator: replica liveness, replica-list broadcasts and load balancing.

Public names follow upstream vllm-omni's ``vllm_omni.distributed.omni_coordinator``
(seed ``omni-coordinator-api.txt``); the wire protocol is ours (typed msgspec
structs, msgpack, versioned, bounded). Design: ``docs/design/coordinator.md``.
"""

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

__all__ = [
    "CLUSTER_TOKEN_ENV",
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

# The omni master's names, also here as upstream has them (vllm_omni_plugin.master).
from vllm_omni_plugin.master import *  # noqa: E402, F403
from vllm_omni_plugin.master import __all__ as _master_names  # noqa: E402

__all__ += _master_names
