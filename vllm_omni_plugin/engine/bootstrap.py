"""The head, built in one place.

:func:`bind_control_plane` binds the head's omni master and coordinator before
its entry engine starts; :func:`build_head` then turns the entry engine and the
plugin's :class:`~vllm_omni_plugin.config.settings.OmniSettings` into a
:class:`Head`: the pipeline config, the payload store, the control plane's hub,
a :class:`~vllm_omni_plugin.replicas.pool.StagePool` per downstream
stage with its local replicas (engines started concurrently, each
under a supervisor), one for the entry stage (without PD) whose local replica is the
head's own engine, the admission gate, the stage input processors (resolved
once) and the ``/metrics`` collector, and finally the
:class:`~vllm_omni_plugin.engine.orchestrator.Orchestrator` that moves requests
between them. Nothing here is on the request path.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.engine.admission import AdmissionGate
from vllm_omni_plugin.engine.orchestrator import Orchestrator
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


@dataclass
class Head:
    """Everything the head runs besides vLLM's own entry engine."""

    settings: OmniSettings
    pipeline: object  # PipelineConfig
    store: object  # PayloadStore
    cluster: object  # HeadCluster
    pools: dict  # stage_id -> StagePool
    admission: AdmissionGate
    orchestrator: Orchestrator
    metrics: object  # the /metrics collector
    supervisors: list = field(default_factory=list)  # LocalReplicaSupervisor each
    entry_watch: object = None  # the entry engine's StallWatch, if probed
    row_cache: object = None  # the RowCacheWatch of the engines computing prompts
    _started: bool = False

    def start(self) -> None:
        """Begin supervising local replicas and attaching remote ones (idempotent;
        needs the API server's running event loop)."""
        if self._started:
            return
        self._started = True
        loop = asyncio.get_running_loop()
        for supervisor in self.supervisors:
            supervisor.watch(loop)
        if self.entry_watch is not None:
            self.entry_watch.start()
        if self.row_cache is not None:
            self.row_cache.start()
        self.cluster.start(self.pools)

    def shutdown(self) -> None:
        """Stop everything the head started; idempotent. The replicas are released
        concurrently: each local engine takes seconds to stop (its workers exit, then
        its EngineCore), and one after another those add up."""
        from vllm_omni_plugin.replicas.metrics import unregister_collector

        unregister_collector(self.metrics)
        if self.entry_watch is not None:
            self.entry_watch.stop()
        if self.row_cache is not None:
            self.row_cache.stop()
        for supervisor in self.supervisors:
            supervisor.close()
        self.cluster.close()
        closed = [replica for pool in self.pools.values() for replica in pool.close()]
        if closed:
            with ThreadPoolExecutor(max_workers=len(closed),
                                    thread_name_prefix="omni-stage-stop") as executor:
                for future in [executor.submit(r.release) for r in closed]:
                    future.result()
        self.pools = {}
        if os.path.isdir(self.store.root):
            self.store.close()


def bind_control_plane(settings: OmniSettings):
    """The head's omni master and coordinator (a ``HeadCluster``), bound before its entry
    engine starts: headless replicas register while the head's engine loads, and an
    address that cannot be bound fails the server in seconds. The head's own replicas
    are registered at once, so that they take each stage's first replica ids whatever
    starts beside the head. The caller closes it when the head is not built.

    Raises:
        StageConfigError: the pipeline YAML became invalid since the CLI read it.
        zmq.ZMQError: the master or coordinator address cannot be bound.
    """
    from vllm_omni_plugin.config.loader import load_pipeline_config
    from vllm_omni_plugin.replicas.cluster import HeadCluster

    pipeline = load_pipeline_config(settings.stage_configs_path)
    conf = settings.cluster
    cluster = HeadCluster(conf.host, conf.port, conf.heartbeat_timeout)
    try:
        if pipeline.entry_stage.pd is None:  # the head's own engine, a replica of its stage
            cluster.register_local(pipeline.entry_stage.stage_id, 1)
        for stage in replicated_stages(pipeline):
            cluster.register_local(stage.stage_id, stage.runtime.num_replicas)
    except BaseException:
        cluster.close()
        raise
    return cluster


def downstream_stages(pipeline) -> list:
    """Every stage but the entry one, in topological order."""
    entry_id = pipeline.entry_stage.stage_id
    return [s for s in pipeline.topological_order() if s.stage_id != entry_id]


def replicated_stages(pipeline) -> list:
    """The stages the head keeps a pool of replicas for besides the entry stage: the
    downstream ones, then the entry stage's prefill stage (PD)."""
    prefill = pipeline.prefill_stage_for(pipeline.entry_stage.stage_id)
    return downstream_stages(pipeline) + ([prefill] if prefill is not None else [])


def build_head(entry_client, vllm_config, settings: OmniSettings, cluster) -> Head:
    """Start the head's replicas of every downstream stage and the orchestrator.

    Args:
        entry_client: the entry stage's engine client; its ``entry_generate``
            runs a request on the entry stage.
        vllm_config: the entry engine's ``VllmConfig``.
        settings: the plugin's settings of the entry engine.
        cluster: the head's control plane from :func:`bind_control_plane`, its local
            replicas registered; the caller closes it when this raises.

    Raises:
        StageConfigError: the pipeline YAML became invalid since the CLI read it.
        RuntimeError: a stage engine failed to start (names the stage).
    """
    from vllm_omni_plugin.config.cli import base_args_from, prefill_base_args
    from vllm_omni_plugin.config.loader import load_pipeline_config
    from vllm_omni_plugin.config.placement import Host, start_lanes
    from vllm_omni_plugin.coordinator import build_load_balancer_factory
    from vllm_omni_plugin.payload_store import PayloadStore, remove_stale_run_dirs
    from vllm_omni_plugin.processors.registry import get_processor
    from vllm_omni_plugin.replicas.engines import start_stage_engine
    from vllm_omni_plugin.replicas.liveness import StallWatch, stall_timeout_of
    from vllm_omni_plugin.replicas.metrics import RowCacheWatch, register_collector
    from vllm_omni_plugin.replicas.pool import StagePool
    from vllm_omni_plugin.replicas.replica import LocalReplica
    from vllm_omni_plugin.replicas.supervisor import LocalReplicaSupervisor

    conf = settings.cluster
    pipeline = load_pipeline_config(settings.stage_configs_path)
    downstream = downstream_stages(pipeline)
    processors = {s.stage_id: get_processor(s.input_processor) for s in downstream}
    remove_stale_run_dirs(os.path.dirname(settings.payload_dir))
    store = PayloadStore(settings.payload_dir)
    try:
        check_payload_room(store.root, vllm_config.model_config, pipeline.entry_stage)
    except OSError:
        store.close()
        raise
    balancer = build_load_balancer_factory(conf.lb_policy)
    prefill = pipeline.prefill_stage_for(pipeline.entry_stage.stage_id)
    replicated = replicated_stages(pipeline)
    pools = {s.stage_id: StagePool(s.stage_id, balancer(), conf.replica_wait_timeout)
             for s in replicated}
    base = base_args_from(vllm_config.model_config)
    entry = pipeline.entry_stage
    if entry.pd is None:  # headless replicas of the entry stage attach here too
        pools[entry.stage_id] = StagePool(entry.stage_id, balancer(), conf.replica_wait_timeout)
        (head_id,) = cluster.local_ids(entry.stage_id)
        pools[entry.stage_id].add(LocalReplica(entry.stage_id, head_id,
                                               HeadEngine(entry_client), store.root))
    bases = {s.stage_id: base for s in downstream}
    if prefill is not None:  # the entry engine's model and KV cache layout
        bases[prefill.stage_id] = prefill_base_args(base, pipeline.entry_stage, vllm_config)
    plan = [(s, replica_id) for s in replicated for replica_id in cluster.local_ids(s.stage_id)]
    # Engines start concurrently (each start is mostly an EngineCore process spawning,
    # importing and handshaking), except those sharing a GPU: one after another.
    lanes = start_lanes(plan, settings.devices, Host.current())
    for lane in lanes:
        if len(lane) > 1:
            logger.info("%s share a device: they start one after another", ", ".join(
                f"stage {s.stage_id} ({s.name}) replica {rid}" for s, rid in lane))

    def start_one(stage, replica_id) -> LocalReplica:
        engine = start_stage_engine(stage, bases[stage.stage_id], settings).engine
        return LocalReplica(stage.stage_id, replica_id, engine, store.root)

    try:
        replicas = start_in_lanes(lanes, start_one)
    except BaseException:
        store.close()
        raise
    # a restart waits for the other engines of its lane (those sharing a GPU) to start
    start_locks = {}
    for lane in lanes:
        lock = threading.Lock()
        start_locks.update({(s.stage_id, replica_id): lock for s, replica_id in lane})
    supervisors = []
    for replica in replicas:
        stage = pipeline.stage(replica.stage_id)
        pools[replica.stage_id].add(replica)
        supervisors.append(LocalReplicaSupervisor(
            replica, lambda s=stage: start_stage_engine(s, bases[s.stage_id], settings).engine,
            pools[replica.stage_id].notify, stage.runtime.max_restarts,
            stall_timeout=stall_timeout_of(stage, settings),
            start_lock=start_locks[replica.stage_id, replica.replica_id]))
    admission = AdmissionGate(
        {s.stage_id: admission_bound(s, replicas, vllm_config) for s in downstream},
        conf.admission_timeout)
    logger.info("admission bounds (requests in flight per stage): %s; wait up to %g s",
                admission.bounds, admission.timeout_s)
    orchestrator = Orchestrator(
        entry_client.entry_generate, entry_client.model_config.hf_config, pipeline, store,
        pools, admission, processors, tokenize=lambda text: entry_client.tokenizer.encode(text),
        entry_abort=entry_client.entry_abort, request_timeout=conf.request_timeout)
    entry_timeout = stall_timeout_of(entry, settings)
    entry_watch = StallWatch(
        entry_client, entry_timeout, f"stage {entry.stage_id} ({entry.name}), the head's "
        "engine", lambda reason: entry_stalled(entry_client, pools.get(entry.stage_id),
                                               reason),
        busy=entry_client.get_num_unfinished_requests) \
        if entry_timeout > 0 else None
    # the engines that compute prompts: the entry engine, and the prefill stage's (PD)
    computing = [(entry.stage_id, lambda: entry_client)] \
        if vllm_config.cache_config.enable_prefix_caching else []
    if prefill is not None:
        computing += [(r.stage_id, lambda r=r: r.engine) for r in replicas
                      if r.stage_id == prefill.stage_id]
    row_cache = RowCacheWatch(computing) if settings.row_cache_bytes and computing else None
    head = Head(settings=settings, pipeline=pipeline, store=store, cluster=cluster,
                pools=pools, admission=admission, orchestrator=orchestrator,
                metrics=register_collector(pools, admission, insecure=conf.insecure,
                                           row_cache=row_cache),
                supervisors=supervisors,
                entry_watch=entry_watch, row_cache=row_cache)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # built outside an event loop: started on the first request
    else:
        head.start()
    return head


def start_in_lanes(lanes: list[list], start_one) -> list:
    """Start each ``(stage, replica_id)`` of ``lanes`` with ``start_one(stage,
    replica_id)`` (a replica whose ``engine`` has ``shutdown``): the lanes side by side,
    each lane's in order.

    When an engine fails to start, or the wait is interrupted (``KeyboardInterrupt``:
    Ctrl-C, or vLLM's SIGTERM handler during start-up), no lane starts another engine;
    the engines already started, and those still starting, are shut down once up.

    Returns:
        The replicas, lane by lane.

    Raises:
        BaseException: the first engine's error, or the interrupt.
    """
    go, stopping = threading.Event(), threading.Event()

    def run_lane(lane) -> tuple[list, BaseException | None]:
        go.wait()  # every lane's future is in hand before an engine starts
        started = []
        for stage, replica_id in lane:
            if stopping.is_set():
                break
            try:
                started.append(start_one(stage, replica_id))
            except BaseException as exc:
                stopping.set()
                return started, exc
        return started, None

    executor = ThreadPoolExecutor(max_workers=max(1, len(lanes)),
                                  thread_name_prefix="omni-stage-start")
    futures = []
    try:
        for lane in lanes:
            futures.append(executor.submit(run_lane, lane))
        go.set()
        results = [future.result() for future in futures]
    except BaseException:
        stopping.set()
        go.set()
        # each lane ends once its engine in flight is up: shut its engines down as it does
        for future in as_completed(futures):
            _shut_down(future.result()[0])
        raise
    finally:
        executor.shutdown(wait=False)
    errors = [error for _, error in results if error is not None]
    replicas = [replica for started, _ in results for replica in started]
    if errors:
        _shut_down(replicas)
        raise errors[0]
    return replicas


def _shut_down(replicas) -> None:
    for replica in replicas:
        replica.engine.shutdown()


def entry_stalled(entry_client, pool, reason: str) -> None:
    """The head's own engine stalled: kill its EngineCore. vLLM then sees its engine
    dead, fails its requests and shuts the API server down (unless
    ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``), so that whatever restarts the server (a
    container runtime, systemd) restarts it; its ``/health`` no longer answers 200."""
    from vllm_omni_plugin.replicas.liveness import kill_engine

    if pool is not None:  # the head's replica of the entry stage: counted in /metrics
        for replica in pool.replicas.values():
            if isinstance(getattr(replica, "engine", None), HeadEngine):
                replica.stalls += 1
                replica.lost(reason)
    kill_engine(entry_client)


def check_payload_room(directory: str, model_config, entry) -> None:
    """One request of the entry engine's ``max_model_len`` must fit the payload store:
    its stage model's ``payload_bytes_per_position`` times that many positions (the
    thinker's rows for the talker, BAGEL's keys and values for the DiT), checked before
    the other stages start rather than when a long prompt fills the directory.

    Raises:
        OSError: too little room (the message names the directory and the fixes).
    """
    from vllm_omni_plugin.models import stage_model_class
    from vllm_omni_plugin.payload_store import check_room

    archs = model_config.architectures or []
    per_position = getattr(stage_model_class(archs[0]) if archs else None,
                            "payload_bytes_per_position", None)
    if per_position is None:
        return
    per_position = per_position(model_config)
    length = model_config.max_model_len
    free = check_room(directory, per_position * length,
                      f"one request of --max-model-len {length} at stage {entry.stage_id} "
                      f"({entry.name}), {per_position} bytes per position,")
    logger.info("payload store %s: %.0f MiB free; one request of %d positions takes "
                "%.0f MiB", directory, free / (1 << 20), length,
                per_position * length / (1 << 20))


class HeadEngine:
    """The head's own entry engine (the ``OmniEngineClient``) as the engine of a local
    replica of the entry stage: its plain ``AsyncLLM`` generate and abort, which skip the
    orchestrator. vLLM owns its lifetime: :meth:`shutdown` does nothing."""

    def __init__(self, client) -> None:
        self._client = client

    @property
    def vllm_config(self):
        """The entry engine's ``VllmConfig``."""
        return self._client.vllm_config

    def generate(self, *args, **kwargs):
        """The entry engine's plain ``AsyncLLM.generate`` (``entry_generate``), past the
        orchestrator."""
        return self._client.entry_generate(*args, **kwargs)

    async def abort(self, request_id) -> None:
        """Abort ``request_id`` on the entry engine alone (``entry_abort``)."""
        await self._client.entry_abort(request_id)

    def shutdown(self) -> None:
        """vLLM shuts the served engine down itself."""


def admission_bound(stage, replicas: list, vllm_config) -> int:
    """Requests in flight allowed at ``stage``: its ``runtime.max_inflight``, else
    its engine's ``max_num_seqs`` (a local replica's resolved value, else the
    stage's ``engine_args``, else the entry engine's) times its local replicas
    (at least one)."""
    if stage.runtime.max_inflight:
        return stage.runtime.max_inflight
    local = [r for r in replicas if r.stage_id == stage.stage_id]
    if local:
        max_num_seqs = local[0].engine.vllm_config.scheduler_config.max_num_seqs
    else:
        max_num_seqs = (stage.engine_args.get("max_num_seqs")
                        or vllm_config.scheduler_config.max_num_seqs)
    return int(max_num_seqs) * max(1, len(local))
