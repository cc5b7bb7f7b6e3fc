"""``OmniMooncakeConnector``: vLLM's ``MooncakeConnector`` with what omni stages and vLLM's
CPU build need, nothing else.

vLLM's connector does the work: the prefill engine (``kv_role="kv_producer"``) registers its
KV cache blocks with Mooncake's ``TransferEngine`` and, when a request it serves finishes
``FINISHED_LENGTH_CAPPED``, writes the request's blocks into the blocks the decode engine
(``kv_role="kv_consumer"``) allocated for the request with the same ``transfer_id``. Pairing
goes through each request's ``kv_transfer_params`` as in vLLM (``do_remote_decode`` on the
prefill side; ``do_remote_prefill``, ``remote_engine_id``, ``remote_bootstrap_addr`` and
``transfer_id`` on the decode side).

This subclass adds:

* **vLLM's CPU platform**: the connector worker starts where
  ``torch.accelerator.current_device_index()`` raises (``compat/mooncake.py``).
* **Coalesced descriptors**: descriptors whose source and destination ranges both adjoin
  are written as one (:func:`coalesce_descriptors`). vLLM merges only ascending runs of
  block ids, and its block pool frees a request's blocks in reverse order, so after the
  first requests a request's blocks come in descending runs and vLLM writes one
  descriptor per block and layer; over TCP a write costs mostly per descriptor.
* **Descriptor batches**: one write to a peer carries at most
  ``kv_connector_extra_config["omni_plugin_max_descs_per_peer"]`` descriptors (default
  :data:`~vllm_omni_plugin.kv_transfer.DEFAULT_MAX_DESCS_PER_PEER`), and writes to one peer
  from vLLM's sender threads run one at a time. Mooncake fails above about 2048 outstanding
  descriptors per peer and then leaves that peer's session broken.
* **The bootstrap port** from ``kv_connector_extra_config["omni_plugin_bootstrap_port"]``
  (the plugin allocates one per prefill replica) instead of the process-wide
  ``VLLM_MOONCAKE_BOOTSTRAP_PORT``, checked free before vLLM's server binds it.
* **A transfer timeout** (``kv_connector_extra_config["omni_plugin_transfer_timeout_s"]``,
  seconds; the plugin sets the coordinator's heartbeat timeout): a decode engine fails a
  request whose bootstrap query and KV pull have not finished that long after the pull
  started (vLLM's own limits are ``VLLM_MOONCAKE_CONNECTOR_TIMEOUT`` per bootstrap attempt
  and ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` + 60 s per pull, 540 s by default), so vLLM
  ends it with finish reason ``error`` and frees its blocks. A prefill engine stops
  holding a finished request's KV cache half that long after it was ready, and refuses
  to start a write for it later, so that it never writes into blocks a decode engine has
  already given up on (Mooncake cannot cancel a write once posted).
* **Clear start-up errors**: a missing Mooncake (the ``pd`` extra, or ``libibverbs1``) and a
  transfer engine that fails to initialise name the fix.

Both classes keep vLLM's constructor signatures; the connector's ``__init__`` repeats vLLM's
role dispatch so that the worker role builds :class:`OmniMooncakeConnectorWorker` (a shim test
fails when vLLM changes that dispatch). The vLLM methods the worker overrides, and the state
of vLLM's worker it reads (through accessors), are listed in
:data:`vllm_omni_plugin.compat.internals.INTERNALS` (canaries:
``plugin_tests/unit/test_compat_internals.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1 import base as connector_base
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as vllm_mooncake,
)

from vllm_omni_plugin.compat import internals
from vllm_omni_plugin.compat import mooncake as compat_mooncake
from vllm_omni_plugin.kv_transfer import (
    CONNECTOR_NAME,
    DEFAULT_MAX_DESCS_PER_PEER,
    EXTRA_BOOTSTRAP_PORT,
    EXTRA_MAX_DESCS_PER_PEER,
    EXTRA_TRANSFER_TIMEOUT,
)
from vllm_omni_plugin.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

KVConnectorRole = connector_base.KVConnectorRole


def _mooncake_import_error() -> str:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return "vLLM could not import it"


def _positive_int(extra: dict, key: str, default: int | None) -> int | None:
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be a positive integer, "
                         f"got {value!r}")
    return value


def _positive_seconds(extra: dict, key: str) -> float | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be a positive number of "
                         f"seconds, got {value!r}")
    return float(value)


def _preflight(vllm_config: VllmConfig) -> None:
    """What must hold before the connector worker starts (so that a failure leaves no
    half-built worker behind).

    Raises:
        RuntimeError: Mooncake's transfer engine is not importable, or the bootstrap port is
            in use.
        ValueError: a bad ``omni_plugin_*`` value in ``kv_connector_extra_config``.
    """
    kv_config = vllm_config.kv_transfer_config
    extra = kv_config.kv_connector_extra_config or {}
    _positive_int(extra, EXTRA_MAX_DESCS_PER_PEER, DEFAULT_MAX_DESCS_PER_PEER)
    _positive_seconds(extra, EXTRA_TRANSFER_TIMEOUT)
    if not internals.mooncake_transfer_engine_available():
        raise RuntimeError(
            f"{CONNECTOR_NAME} needs Mooncake's transfer engine ({_mooncake_import_error()}). "
            "Install the plugin's `pd` extra (pip install 'vllm-omni-plugin[pd]'; it installs "
            "mooncake-transfer-engine-non-cuda, use mooncake-transfer-engine on CUDA hosts); "
            "its library links libibverbs.so.1 even for TCP (Debian/Ubuntu: apt-get install "
            "libibverbs1)")
    if kv_config.kv_role != "kv_consumer" and internals.mooncake_launches_bootstrap_server(
            vllm_config):
        port = _positive_int(extra, EXTRA_BOOTSTRAP_PORT, None)
        if port is not None:
            compat_mooncake.use_bootstrap_port(port)
        else:
            compat_mooncake.ensure_port_free(internals.mooncake_bootstrap_port(vllm_config))


def coalesce_descriptors(src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int],
                         ) -> tuple[list[int], list[int], list[int]]:
    """Merge transfer descriptors that copy adjoining source ranges into adjoining
    destination ranges, in any order they come (descending runs of block ids too).

    Args:
        src_ptrs: start addresses (bytes) of each descriptor's source range, as vLLM
            passes them to Mooncake's ``batch_transfer_sync_write``.
        dst_ptrs: start addresses (bytes) of each descriptor's destination range, in the
            same order.
        lengths: each descriptor's length in bytes.

    Returns:
        ``(src_ptrs, dst_ptrs, lengths)`` sorted by source address, where descriptor
        ``i + 1`` never starts where descriptor ``i`` ends on both sides. The same bytes
        land in the same places: descriptors are independent copies between disjoint
        ranges.
    """
    if len(src_ptrs) < 2:
        return src_ptrs, dst_ptrs, lengths
    src = np.asarray(src_ptrs, dtype=np.int64)
    order = np.argsort(src, kind="stable")
    src = src[order]
    dst = np.asarray(dst_ptrs, dtype=np.int64)[order]
    size = np.asarray(lengths, dtype=np.int64)[order]
    joins = (src[:-1] + size[:-1] == src[1:]) & (dst[:-1] + size[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return (src[starts].tolist(), dst[starts].tolist(),
            np.add.reduceat(size, starts).tolist())


class OmniMooncakeConnectorWorker(vllm_mooncake.MooncakeConnectorWorker):
    """vLLM's Mooncake connector worker, startable on vLLM's CPU platform, with bounded
    descriptor batches per peer and, where ``omni_plugin_transfer_timeout_s`` is set, the
    transfer timeout described in the module docstring. Same constructor as vLLM's; build
    it after :func:`_preflight` (as :class:`OmniMooncakeConnector` does).

    Raises:
        RuntimeError: Mooncake's transfer engine fails to initialise.
    """

    def __init__(self, vllm_config: VllmConfig, engine_id: str,
                 kv_cache_config: KVCacheConfig):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._omni_max_descs = _positive_int(extra, EXTRA_MAX_DESCS_PER_PEER,
                                             DEFAULT_MAX_DESCS_PER_PEER)
        self._omni_peer_locks: dict[str, threading.Lock] = {}
        self._omni_peer_locks_guard = threading.Lock()
        self._omni_timeout = _positive_seconds(extra, EXTRA_TRANSFER_TIMEOUT)
        #: decode side: request id -> ``time.monotonic()`` by which its pull must be done
        #: (touched only on vLLM's receiver event loop)
        self._omni_deadlines: dict[str, float] = {}
        try:
            with compat_mooncake.cpu_device_index():
                super().__init__(vllm_config, engine_id, kv_cache_config)
        except RuntimeError as exc:
            if "initialization failed" not in str(exc):
                raise
            protocol = extra.get("mooncake_protocol", "rdma")
            raise RuntimeError(
                f"{exc} (kv_connector_extra_config.mooncake_protocol={protocol!r}; on hosts "
                "without RDMA devices set it to \"tcp\"; Mooncake's own log lines above say "
                "why)") from exc

    def _omni_peer_lock(self, remote_session: str) -> threading.Lock:
        with self._omni_peer_locks_guard:
            lock = self._omni_peer_locks.get(remote_session)
            if lock is None:
                lock = self._omni_peer_locks[remote_session] = threading.Lock()
            return lock

    def _send_blocks(self, remote_session: str, src_ptrs: list[int], dst_ptrs: list[int],
                     lengths: list[int]) -> int:
        """vLLM's write of the :func:`coalesce_descriptors` of its descriptors, in batches
        of at most ``omni_plugin_max_descs_per_peer`` descriptors, one writer per peer at
        a time. Returns 0, or the first batch's non-zero Mooncake status (the later
        batches are not sent)."""
        src_ptrs, dst_ptrs, lengths = coalesce_descriptors(src_ptrs, dst_ptrs, lengths)
        step = self._omni_max_descs
        with self._omni_peer_lock(remote_session):
            for start in range(0, len(src_ptrs), step):
                end = start + step
                status = super()._send_blocks(remote_session, src_ptrs[start:end],
                                              dst_ptrs[start:end], lengths[start:end])
                if status != 0:
                    return status
        return 0

    # -- transfer timeout, decode side (vLLM's receiver event loop) -------------------
    async def _start_load_kv(self, reqs_to_recv) -> None:
        if self._omni_timeout is not None:
            deadline = time.monotonic() + self._omni_timeout
            for pull_metas in reqs_to_recv.values():
                self._omni_deadlines.update(dict.fromkeys(pull_metas, deadline))
        await super()._start_load_kv(reqs_to_recv)

    def _omni_remaining(self, pull_metas: dict) -> float:
        now = time.monotonic()
        deadline = min(self._omni_deadlines.get(req_id, now + self._omni_timeout)
                       for req_id in pull_metas)
        return max(0.0, deadline - now)

    def _omni_forget(self, pull_metas: dict) -> None:
        for req_id in pull_metas:
            self._omni_deadlines.pop(req_id, None)

    async def _omni_until_deadline(self, receive, pull_metas: dict, what: str) -> bool:
        """Await ``receive`` (one of vLLM's receive coroutines) until the requests'
        deadline; past it, cancel it and report the requests as failed loads ("``what``
        within N s"). Returns whether it finished in time."""
        try:
            await asyncio.wait_for(receive, self._omni_remaining(pull_metas))
        except asyncio.TimeoutError:
            internals.mooncake_fail_receives(
                self, pull_metas, list(pull_metas),
                f"{what} within {self._omni_timeout:g} s "
                f"(kv_connector_extra_config.{EXTRA_TRANSFER_TIMEOUT})")
            return False
        return True

    async def handle_new_engine_id(self, remote_engine_id: str, pull_metas: dict) -> None:
        """vLLM's bootstrap query for an unknown prefill engine, then the pull; the query
        ends at the requests' deadline."""
        if self._omni_timeout is None or not pull_metas:
            return await super().handle_new_engine_id(remote_engine_id, pull_metas)
        addr = next(iter(pull_metas.values())).remote_bootstrap_addr
        try:
            if not await self._omni_until_deadline(
                    super().handle_new_engine_id(remote_engine_id, pull_metas), pull_metas,
                    f"bootstrap server {addr} did not answer"):
                # vLLM sets and drops the query's event only when its query returns;
                # waiters for the same address must not wait on a cancelled query.
                internals.mooncake_release_bootstrap_waiters(self, addr)
        finally:
            if not internals.mooncake_knows_engine(self, remote_engine_id):
                self._omni_forget(pull_metas)

    async def receive_kv_from_single_worker(self, worker_addr: str, pull_metas: dict) -> None:
        """vLLM's pull from one prefill worker, ended at the requests' deadline (the
        blocks of a request that timed out are reported as failed loads)."""
        if self._omni_timeout is None:
            return await super().receive_kv_from_single_worker(worker_addr, pull_metas)
        try:
            await self._omni_until_deadline(
                super().receive_kv_from_single_worker(worker_addr, pull_metas), pull_metas,
                f"no KV cache from {worker_addr}")
        finally:
            self._omni_forget(pull_metas)

    # -- transfer timeout, prefill side (vLLM's sender event loop) ----------------------
    async def record_send_reqs(self, metadata) -> None:
        """vLLM's bookkeeping of finished requests to send, with their hold time cut to
        half the transfer timeout (vLLM frees their blocks when it expires)."""
        await super().record_send_reqs(metadata)
        if self._omni_timeout is None:
            return
        limit = time.perf_counter() + self._omni_timeout / 2
        for transfer_id, block_ids in metadata.reqs_to_send.values():
            send_meta = internals.mooncake_send_meta(self, transfer_id)
            if block_ids and send_meta is not None:
                send_meta.expire_time = min(send_meta.expire_time, limit)

    async def _build_transfer_params(self, ready_reqs, agent_meta, local_regions,
                                     remote_regions):
        """vLLM's descriptors for ``ready_reqs``, less those whose hold time expired
        (reported to the decode engine as failed instead of written late)."""
        now = time.perf_counter()
        stale = [d_req_id for d_req_id, meta in ready_reqs if meta.expire_time < now]
        if not stale:
            return await super()._build_transfer_params(ready_reqs, agent_meta,
                                                        local_regions, remote_regions)
        fresh = [(d_req_id, meta) for d_req_id, meta in ready_reqs
                 if meta.expire_time >= now]
        src, dst, lengths, err_reqs, err_msg = await super()._build_transfer_params(
            fresh, agent_meta, local_regions, remote_regions)
        logger.warning("not sending the KV cache of %s: held longer than %g s", stale,
                       self._omni_timeout / 2)
        msg = (f"the prefill engine held the KV cache longer than {self._omni_timeout / 2:g} s"
               f" (kv_connector_extra_config.{EXTRA_TRANSFER_TIMEOUT} / 2)")
        return (src, dst, lengths, [*err_reqs, *stale],
                msg if err_msg is None else f"{err_msg}; {msg}")


class OmniMooncakeConnector(vllm_mooncake.MooncakeConnector):
    """vLLM's ``MooncakeConnector`` whose worker role is :class:`OmniMooncakeConnectorWorker`.

    Select it with ``KVTransferConfig(kv_connector="OmniMooncakeConnector", ...)``; the
    plugin registers the name with vLLM's ``KVConnectorFactory``. The scheduler role is
    vLLM's own ``MooncakeConnectorScheduler``.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        # vLLM's MooncakeConnector.__init__, with the plugin's worker class (its
        # constructor looks the worker class up by module-global name).
        connector_base.KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        assert vllm_config.kv_transfer_config.engine_id is not None
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        if role == KVConnectorRole.SCHEDULER:
            assert kv_cache_config is not None, "kv_cache_config is required for SCHEDULER role"
            self.connector_scheduler = vllm_mooncake.MooncakeConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            _preflight(vllm_config)
            self.connector_worker = OmniMooncakeConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config)
