"""The head's side of a replicated pipeline: master, coordinator, hub and stage pools.

In omni mode the head (the ``vllm serve`` process with the API server) runs:

* an :class:`~vllm_omni_plugin.coordinator.OmniMasterServer` on
  ``--omni-master-address``/``--omni-master-port``, which gives every replica
  (the head's own and those of headless processes) its id and task port;
* an :class:`~vllm_omni_plugin.coordinator.OmniCoordinatorRuntime` on the same
  address (kernel-chosen ports, sent to registrants in the master's
  ``cluster_info``), which tracks liveness from heartbeats;
* an :class:`~vllm_omni_plugin.coordinator.OmniCoordClientForHub` whose
  published replica lists drive :meth:`HeadCluster.sync`: remote replicas the
  coordinator lists ``UP`` are attached to their stage's pool, and those it
  stops listing are detached (their running tasks fail over or fail).

Attaching and detaching run on the API server's event loop in a background
task; the master is asked for assignments in a worker thread, so the request
loop never blocks on the control plane.
"""

from __future__ import annotations

import asyncio

from vllm_omni_plugin.coordinator import (
    OmniCoordClientForHub,
    OmniCoordinatorRuntime,
    OmniMasterServer,
    ReplicaStatus,
)
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.master.messages import tcp_address

from .pool import StagePool
from .protocol import KV_BOOTSTRAP_ENDPOINT, TASK_ENDPOINT
from .replica import RemoteReplica

logger = init_logger(__name__)

#: ``cluster_info`` keys the master sends every registrant.
INFO_COORDINATOR = "coordinator_router"
INFO_HEARTBEAT_TIMEOUT = "heartbeat_timeout"


class HeadCluster:
    """Control plane of the head.

    Args:
        host: Address to bind the master and the coordinator to (only this one).
        port: The master's port (``0``: kernel-chosen, logged).
        heartbeat_timeout: Seconds without a heartbeat before a replica is ``ERROR``.
        cluster_token: ``None`` reads ``VLLM_OMNI_PLUGIN_CLUSTER_TOKEN``.

    Raises:
        zmq.ZMQError: an address cannot be bound.
    """

    def __init__(self, host: str, port: int, heartbeat_timeout: float,
                 cluster_token: str | None = None) -> None:
        self.host = host
        self.cluster_token = cluster_token
        self.runtime = OmniCoordinatorRuntime(
            host=host, heartbeat_timeout=heartbeat_timeout,
            liveness_check_interval=min(heartbeat_timeout / 4.0, 0.25),
            cluster_token=cluster_token)
        try:
            self.master = OmniMasterServer(
                tcp_address(host, port), endpoint_names=(TASK_ENDPOINT, KV_BOOTSTRAP_ENDPOINT),
                cluster_token=cluster_token,
                cluster_info={INFO_COORDINATOR: self.runtime.router_address,
                              INFO_HEARTBEAT_TIMEOUT: repr(float(heartbeat_timeout))})
        except BaseException:
            self.runtime.close()
            raise
        self.hub: OmniCoordClientForHub | None = None
        self.pools: dict[int, StagePool] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._local_ids: set[tuple[int, int]] = set()
        logger.info("omni master on %s; replicas register there (--omni-master-address/"
                    "--omni-master-port)", self.master.address)

    def register_local(self, stage_id: int, count: int) -> list[int]:
        """Replica ids for ``count`` replicas of ``stage_id`` in this process."""
        if count <= 0:
            return []
        assignments = self.master.register_local(stage_id, self.host, count)
        ids = [a.replica_id for a in assignments]
        self._local_ids.update((stage_id, i) for i in ids)
        return ids

    def local_ids(self, stage_id: int) -> list[int]:
        """The replica ids :meth:`register_local` gave ``stage_id``, ascending."""
        return sorted(i for stage, i in self._local_ids if stage == stage_id)

    def start(self, pools: dict[int, StagePool]) -> None:
        """Begin attaching remote replicas to ``pools`` (needs a running event loop)."""
        self.pools = pools
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        wake = self._wake

        def on_update(_replica_list) -> None:  # hub thread -> event loop
            loop.call_soon_threadsafe(wake.set)

        self.hub = OmniCoordClientForHub(self.runtime.pub_address,
                                         cluster_token=self.cluster_token, on_update=on_update)
        self._task = loop.create_task(self._watch(), name="omni-replica-watch")

    async def _watch(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.sync()
            except Exception:
                logger.exception("replica sync failed; retrying on the next update")

    async def sync(self) -> None:
        """Attach, re-attach and detach remote replicas after a coordinator update."""
        # One snapshot of the coordinator (this process runs it): the hub's broadcast list
        # can lag it, and a replica missing from that list while the coordinator already
        # had it up again was detached as "went up", failing its running requests.
        replicas = self.runtime.get_all_replicas().replicas
        known = {info.input_addr: info.status.value for info in replicas}
        up = {info.input_addr: info for info in replicas if info.status == ReplicaStatus.UP}
        assignments = await asyncio.to_thread(self.master.assignments)
        held = {(a.stage_id, a.replica_id): a for a in assignments
                if (a.stage_id, a.replica_id) not in self._local_ids}
        for pool in self.pools.values():
            for replica in [r for r in pool.replicas.values() if isinstance(r, RemoteReplica)]:
                key = (pool.stage_id, replica.replica_id)
                if key not in held:
                    pool.remove(replica.replica_id, "deregistered")
                    continue
                if replica.address not in known:  # the coordinator purged it (long dead)
                    await asyncio.to_thread(self.master.deregister_local, pool.stage_id,
                                            [replica.replica_id])
                    pool.remove(replica.replica_id, "purged by the coordinator")
                    continue
                info = up.get(replica.address)
                if info is not None:
                    replica.reported_queue_length = info.queue_length
                    if not replica.attached:
                        replica.reattach()
                        logger.info("%s is up again", replica.name)
                        pool.notify()
                elif replica.attached:
                    status = known.get(replica.address, "error")
                    logger.warning("%s is %s: detached", replica.name, status)
                    replica.lost(f"went {status}")
                    replica.status = status
        for (stage_id, replica_id), assignment in held.items():
            pool = self.pools.get(stage_id)
            address = assignment.endpoint(TASK_ENDPOINT)
            if pool is None or replica_id in pool.replicas or address not in up:
                continue
            replica = RemoteReplica(stage_id, replica_id, address, self.cluster_token)
            replica.reported_queue_length = up[address].queue_length
            pool.add(replica)

    def close(self) -> None:
        """Stop watching for coordinator updates and close the hub client, the master and the
        coordinator; the pools and their replicas are left to their owner."""
        if self._task is not None:
            self._task.cancel()
        if self.hub is not None:
            self.hub.close()
        self.master.close()
        self.runtime.close()
