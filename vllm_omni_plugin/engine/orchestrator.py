"""Request flow between stages.

What a request asks beyond vLLM's fields comes from the API layer's
:class:`~vllm_omni_plugin.engine.omni_request.OmniRequest` (never from the
client's ``extra_args``: keys in the plugin's namespace are dropped here).
For a request that asks only for text the entry stage's output is streamed
unchanged (plain vLLM behaviour). When it asks for more (audio), the request
passes the admission gate (HTTP 429 when the downstream stages stay full), the
orchestrator holds back the entry stage's final output, runs each downstream
stage in topological order — stage input processor, input payload, one
request on the stage's engine — puts the final stage's result into the
``OmniRequest`` and then releases the final output. Abort propagates to every
stage; a failure fails the request with an error naming the stage, and
nothing else.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.engine.admission import AdmissionGate, AdmissionRefused
from vllm_omni_plugin.engine.omni_request import (
    OmniRequest,
    StageResult,
    current_omni_request,
)
from vllm_omni_plugin.kv_transfer.payload import PayloadError, PayloadStore, safe_key
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


class StageError(RuntimeError):
    """A stage failed for one request. ``stage_id``/``stage_name`` name it;
    ``status`` is the HTTP status the API layer answers with (400 when the
    request itself was at fault, e.g. an unknown voice, 503 when the stage has
    no replica, else 500); ``retry_after`` seconds go with a 503."""

    def __init__(self, stage_id: int, stage_name: str, message: str, status: int = 500,
                 retry_after: float | None = None):
        super().__init__(f"stage {stage_id} ({stage_name}): {message}")
        self.stage_id = stage_id
        self.stage_name = stage_name
        self.status = status
        self.retry_after = retry_after


class Orchestrator:
    def __init__(self, client, pipeline, store: PayloadStore, pools: dict, cluster,
                 admission: AdmissionGate, supervisors: list | None = None):
        self.client = client
        self.pipeline = pipeline
        self.store = store
        self.pools = pools  # stage_id -> StagePool (downstream stages)
        self.cluster = cluster  # HeadCluster: master, coordinator, remote replicas
        self.admission = admission
        self.supervisors = supervisors or []  # LocalReplicaSupervisor per local replica
        self.entry = pipeline.entry_stage
        self._inflight: dict[str, set[tuple[int, str]]] = {}
        self._stage_of: dict[str, int] = {}  # pipeline request -> the stage it is at
        self._aborted: set[str] = set()
        self._started = False

    @classmethod
    def start(cls, client, vllm_config, settings: dict) -> Orchestrator:
        """Start the head's control plane and its replicas of every downstream stage.

        Raises:
            RuntimeError: a stage engine failed to start (names the stage).
            zmq.ZMQError: the master or coordinator address cannot be bound.
        """
        from vllm_omni_plugin.config.cli import base_args_from
        from vllm_omni_plugin.config.loader import load_pipeline_config
        from vllm_omni_plugin.coordinator import build_load_balancer_factory
        from vllm_omni_plugin.engine.stages import start_stage_engine
        from vllm_omni_plugin.kv_transfer.payload import remove_stale_run_dirs
        from vllm_omni_plugin.replicas.cluster import HeadCluster
        from vllm_omni_plugin.replicas.metrics import register_metrics
        from vllm_omni_plugin.replicas.pool import StagePool
        from vllm_omni_plugin.replicas.replica import LocalReplica
        from vllm_omni_plugin.replicas.supervisor import LocalReplicaSupervisor

        pipeline = load_pipeline_config(settings["stage_configs_path"])
        conf = {"host": "127.0.0.1", "port": 0, "heartbeat_timeout": 30.0,
                "lb_policy": "random", "wait_timeout": 30.0, "admission_timeout": 30.0,
                **settings.get("cluster", {})}
        stale = remove_stale_run_dirs(os.path.dirname(settings["payload_dir"]))
        if stale:
            logger.info("removed %d payload directories of processes that no longer exist",
                        len(stale))
        store = PayloadStore(settings["payload_dir"])
        downstream = [s for s in pipeline.topological_order()
                      if s.stage_id != pipeline.entry_stage.stage_id]
        cluster = HeadCluster(conf["host"], int(conf["port"]), float(conf["heartbeat_timeout"]))
        balancer = build_load_balancer_factory(conf["lb_policy"])
        pools = {s.stage_id: StagePool(s.stage_id, balancer(), float(conf["wait_timeout"]))
                 for s in downstream}
        base = base_args_from(vllm_config.model_config)
        plan = [(s, replica_id) for s in downstream
                for replica_id in cluster.register_local(s.stage_id, s.runtime.num_replicas)]
        # Engines start concurrently: each start is mostly an EngineCore
        # process spawning, importing and handshaking.
        replicas, errors = [], []
        with ThreadPoolExecutor(max_workers=max(1, len(plan)),
                                thread_name_prefix="omni-stage-start") as pool:
            futures = [(s, rid, pool.submit(start_stage_engine, s, base, settings))
                       for s, rid in plan]
            for stage, replica_id, future in futures:
                try:
                    replicas.append(LocalReplica(stage.stage_id, replica_id,
                                                 future.result().engine, store.root))
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            for replica in replicas:
                replica.engine.shutdown()
            cluster.close()
            store.close()
            raise errors[0]
        supervisors = []
        for replica in replicas:
            stage = pipeline.stage(replica.stage_id)
            pools[replica.stage_id].add(replica)
            supervisors.append(LocalReplicaSupervisor(
                replica, lambda s=stage: start_stage_engine(s, base, settings).engine,
                pools[replica.stage_id].notify, stage.runtime.max_restarts))
        admission = AdmissionGate(
            {s.stage_id: admission_bound(s, replicas, vllm_config) for s in downstream},
            float(conf["admission_timeout"]))
        logger.info("admission bounds (requests in flight per stage): %s; wait up to %g s",
                    admission.bounds, admission.timeout_s)
        register_metrics(pools, admission)
        orchestrator = cls(client, pipeline, store, pools, cluster, admission, supervisors)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # built outside an event loop: start on the first request
        else:
            orchestrator._ensure_started()
        return orchestrator

    def _ensure_started(self) -> None:
        """Start attaching remote replicas and supervising local ones (needs the
        API server's event loop)."""
        if not self._started:
            self._started = True
            loop = asyncio.get_running_loop()
            for supervisor in self.supervisors:
                supervisor.watch(loop)
            self.cluster.start(self.pools)

    # -- request flow ---------------------------------------------------------
    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        """The entry stage's outputs for the request; for a pipeline request the
        final one comes after every downstream stage ran (the result goes into
        the current :class:`OmniRequest`).

        Raises:
            StageError: a text-only request failed in the entry stage's worker.
        """
        self._ensure_started()
        request = current_omni_request() or OmniRequest()
        extra = xargs.without_reserved(sampling_params.extra_args)
        params = sampling_params.clone()
        if request.text_only:
            async for out in self._generate_text(request, prompt, params, extra, request_id,
                                                 *args, **kwargs):
                yield out
            return

        try:
            admission = await self.admission.admit()
        except AdmissionRefused as exc:
            logger.warning("request %s refused: %s", request_id, exc)
            request.result = StageResult.failure(str(exc), exc.status, exc.retry_after)
            return
        base = safe_key(f"{request_id}.{uuid.uuid4().hex[:6]}")
        entry_out_key = f"{base}.s{self.entry.stage_id}.out"
        params.extra_args = {**extra, xargs.PAYLOAD: {"out": entry_out_key}}
        keys = [entry_out_key]
        self.store.create(entry_out_key)
        self._inflight[request_id] = set()
        self._stage_of[request_id] = self.entry.stage_id
        final = None
        try:
            async for out in self.client.entry_generate(prompt, params, request_id, *args,
                                                        **kwargs):
                if out.finished:
                    final = out
                else:
                    yield out
            if final is None:
                return
            outputs = {self.entry.stage_id: _stage_output(
                self.entry.stage_id, final, await self._payload(self.entry, entry_out_key))}
            result = await self._run_downstream(request, request_id, outputs, extra,
                                                admission)
            if result is None:  # aborted between stages
                return
            request.result = result
        except asyncio.CancelledError:
            self._log_stopped(request_id, "cancelled (client disconnected)")
            raise
        except StageError as exc:
            logger.error("request %s failed: %s", request_id, exc)
            request.result = StageResult.failure(str(exc), exc.status, exc.retry_after)
        finally:
            admission.release_all()
            await asyncio.to_thread(self._delete, keys)
            self._inflight.pop(request_id, None)
            self._stage_of.pop(request_id, None)
            self._aborted.discard(request_id)
        if final is not None:
            yield final

    async def _generate_text(self, request: OmniRequest, prompt, params, extra, request_id,
                             *args, **kwargs):
        """Plain vLLM generation on the entry stage, with an error slot: a
        failure of the worker for this request fails it with a
        :class:`StageError` naming the stage instead of the engine."""
        err_key = f"{safe_key(request_id)}.{uuid.uuid4().hex[:6]}.err"
        params.extra_args = {**extra, xargs.PAYLOAD: {"err": err_key}}
        self.store.create(err_key)
        try:
            async for out in self.client.entry_generate(prompt, params, request_id, *args,
                                                        **kwargs):
                if out.finished:
                    error = self.store.error(err_key)
                    if error is not None:
                        exc = StageError(self.entry.stage_id, self.entry.name, error)
                        logger.error("request %s failed: %s", request_id, exc)
                        request.result = StageResult.failure(str(exc), exc.status)
                        raise exc
                yield out
        finally:
            self.store.delete(err_key)

    async def _run_downstream(self, request: OmniRequest, request_id, outputs, extra,
                              admission) -> StageResult | None:
        """Run every downstream stage, giving its admission slot back as the
        request leaves it; None when the request was aborted meanwhile."""
        from vllm_omni_plugin.processors.hookspecs import UpstreamOutput
        from vllm_omni_plugin.processors.registry import get_processor

        last, last_input = None, {}
        for stage in self.pipeline.topological_order():
            if stage.stage_id == self.entry.stage_id:
                continue
            try:
                processor = get_processor(stage.input_processor)
                extras = {**extra, xargs.SPEAKER: request.voice,
                          "hf_config": self.client.model_config.hf_config}
                stage_input = processor([outputs[s] for s in stage.inputs], stage, extras)
            except ValueError as exc:  # processors raise ValueError for bad requests
                raise StageError(stage.stage_id, stage.name,
                                 f"input processor {stage.input_processor!r}: {exc}",
                                 status=400) from exc
            except Exception as exc:
                raise StageError(stage.stage_id, stage.name,
                                 f"input processor {stage.input_processor!r}: {exc}") from exc
            last_input = stage_input.payload
            if request_id in self._aborted:
                return None
            try:
                run = await self._run_stage(request_id, stage, stage_input)
            finally:
                admission.release(stage.stage_id)
            if run is None or request_id in self._aborted:
                return None
            outputs[stage.stage_id] = UpstreamOutput(
                stage_id=stage.stage_id, prompt_token_ids=run.prompt_token_ids,
                output_token_ids=run.output_token_ids, payload=run.payload)
            last = stage
        if last is None or not last.final_output:
            raise StageError(self.entry.stage_id, self.entry.name,
                             "the pipeline has no final downstream stage")
        payload = dict(outputs[last.stage_id].payload)
        rate = payload.pop("sample_rate", None)
        return StageResult(output_type=last.final_output_type or "latent", payload=payload,
                           sample_rate=int(rate[0]) if rate is not None else None,
                           final_input=last_input)

    async def _run_stage(self, request_id, stage, stage_input):
        """Run ``stage`` for the request on one of its replicas; None when aborted."""
        from vllm_omni_plugin.replicas.pool import NoReplicaAvailable, ReplicaFailed
        from vllm_omni_plugin.replicas.task import StageTask, TaskAborted, TaskError

        sub_id = f"{request_id}-s{stage.stage_id}"
        task = StageTask(
            request_id=sub_id, prompt_token_ids=list(stage_input.prompt_token_ids),
            sampling={**stage.default_sampling_params, **stage_input.sampling_overrides},
            payload=stage_input.payload)
        pool = self.pools[stage.stage_id]
        self._inflight.setdefault(request_id, set()).add((stage.stage_id, sub_id))
        self._stage_of[request_id] = stage.stage_id
        try:
            return await pool.run(task)
        except asyncio.CancelledError:
            raise
        except TaskAborted:
            return None
        except (NoReplicaAvailable, ReplicaFailed, TaskError) as exc:
            if request_id in self._aborted:
                return None
            raise StageError(stage.stage_id, stage.name, str(exc), status=exc.status,
                             retry_after=getattr(exc, "retry_after", None)) from exc
        except Exception as exc:
            if request_id in self._aborted:
                return None
            raise StageError(stage.stage_id, stage.name, f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._inflight.get(request_id, set()).discard((stage.stage_id, sub_id))
            pool.forget(sub_id)

    # Payload I/O runs in a thread: tensors can be large and the API server's
    # event loop must keep serving.
    async def _payload(self, stage, key: str) -> dict:
        try:
            return await asyncio.to_thread(self.store.get, key)
        except PayloadError as exc:
            raise StageError(stage.stage_id, stage.name, str(exc)) from exc

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self.store.delete(key)

    async def abort(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if rid not in self._inflight:
                continue
            self._aborted.add(rid)
            self._log_stopped(rid, "aborted")
            for stage_id, sub_id in list(self._inflight.get(rid, ())):
                await self.pools[stage_id].abort(sub_id)

    def _log_stopped(self, request_id: str, how: str) -> None:
        stage_id = self._stage_of.get(request_id, self.entry.stage_id)
        logger.info("request %s %s while at stage %d (%s)", request_id, how, stage_id,
                    self.pipeline.stage(stage_id).name)

    def shutdown(self) -> None:
        from vllm_omni_plugin.replicas.metrics import unregister_metrics

        unregister_metrics(self.pools, self.admission)
        for supervisor in self.supervisors:
            supervisor.close()
        self.cluster.close()
        for pool in self.pools.values():
            pool.close()
        self.pools = {}
        if os.path.isdir(self.store.root):
            self.store.close()


def _stage_output(stage_id: int, request_output, payload):
    from vllm_omni_plugin.processors.hookspecs import UpstreamOutput

    completion = request_output.outputs[0]
    return UpstreamOutput(
        stage_id=stage_id,
        prompt_token_ids=list(request_output.prompt_token_ids or []),
        output_token_ids=list(completion.token_ids),
        payload=payload,
    )


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
