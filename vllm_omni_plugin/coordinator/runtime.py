"""OmniCoordinatorRuntime: owns one OmniCoordinator and the two ports it binds.

Upstream picks two "open" ports and then binds them (a race with any other
process); here each socket binds port 0 on ``host`` and the kernel-assigned
ports are read back, so there is no window between choosing and binding.
"""

from __future__ import annotations

from vllm_omni_plugin.master.messages import tcp_address
from vllm_omni_plugin.wire.sockets import ClosedOnExit

from .omni_coordinator import OmniCoordinator


class OmniCoordinatorRuntime(ClosedOnExit):
    """Own one :class:`OmniCoordinator`; the constructor binds, :meth:`close` tears down.

    The coordinator instance is deliberately not exposed: consumers talk to it
    only through its wire protocol, via :class:`OmniCoordClientForStage`
    (``router_address``) and :class:`OmniCoordClientForHub` (``pub_address``).

    Args:
        host: Interface address to bind both sockets to (only this one).
        heartbeat_timeout: Seconds without an event before a replica is
            marked ``ERROR`` (default 30.0).
        router_port: ROUTER port; ``0`` (default) lets the kernel choose.
        pub_port: PUB port; ``0`` (default) lets the kernel choose.
        **coordinator_kwargs: Passed to :class:`OmniCoordinator`
            (``publish_min_interval``, ``republish_interval``,
            ``liveness_check_interval``, ``purge_after``, ``cluster_token``).

    Raises:
        ValueError: On an empty ``host`` or non-positive ``heartbeat_timeout``.
        zmq.ZMQError: If a socket cannot be bound.

    Attributes:
        router_address: ``tcp://host:port`` of the ROUTER (stage clients).
        pub_address: ``tcp://host:port`` of the PUB (hub clients).
    """

    def __init__(
        self,
        *,
        host: str,
        heartbeat_timeout: float = 30.0,
        router_port: int = 0,
        pub_port: int = 0,
        **coordinator_kwargs: object,
    ) -> None:
        if not host:
            raise ValueError("host must be a non-empty string")
        if not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be positive, got {heartbeat_timeout!r}")
        self._closed = False
        self._coordinator = OmniCoordinator(
            router_zmq_addr=tcp_address(host, router_port),
            pub_zmq_addr=tcp_address(host, pub_port),
            heartbeat_timeout=heartbeat_timeout,
            **coordinator_kwargs,  # type: ignore[arg-type]
        )
        self.router_address: str = self._coordinator.router_zmq_addr
        self.pub_address: str = self._coordinator.pub_zmq_addr

    @property
    def stats(self) -> dict[str, int]:
        """The coordinator's counters (see :attr:`OmniCoordinator.stats`)."""
        return self._coordinator.stats

    def get_all_replicas(self):
        """Every replica the coordinator knows, any status (a :class:`ReplicaList`).

        For the process that owns the runtime (e.g. ``/metrics`` on the head);
        everyone else reads the published list through a hub client.
        """
        return self._coordinator.get_all_replicas()

    def close(self) -> None:
        """Tear down the coordinator. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._coordinator.close()

