"""Request flow between stages.

For a request that asks only for text the entry stage's output is streamed
unchanged (plain vLLM behaviour). When the request asks for more (e.g. audio,
``SamplingParams.extra_args[extra_args.MODALITIES]``), the orchestrator holds
back the entry stage's final output, runs each downstream stage in topological
order — stage input processor, input payload, one request on the stage's
engine — stores the final stage's result for the API layer and then releases
the final output. Abort propagates to every stage; a failure fails the request
with an error naming the stage, and nothing else.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.kv_transfer.payload import PayloadError, PayloadStore, safe_key
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


class StageError(RuntimeError):
    """A stage failed for one request. ``stage_id``/``stage_name`` name it;
    ``status`` is the HTTP status the API layer answers with (400 when the
    request itself was at fault, e.g. an unknown voice, else 500)."""

    def __init__(self, stage_id: int, stage_name: str, message: str, status: int = 500):
        super().__init__(f"stage {stage_id} ({stage_name}): {message}")
        self.stage_id = stage_id
        self.stage_name = stage_name
        self.status = status


@dataclass
class StageResult:
    """What the final non-entry stage produced for one request."""

    output_type: str
    payload: dict[str, Any] = field(default_factory=dict)
    sample_rate: int | None = None  # Hz, for audio
    status: int = 200  # HTTP status for the API layer when ``error`` is set
    #: the final stage's input payload (e.g. code2wav's codec codes), small by design
    final_input: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    created: float = field(default_factory=time.monotonic)


class ResultBox:
    """Bounded, time-limited hand-over of stage results to the API layer."""

    def __init__(self, max_items: int = 1024, ttl_s: float = 600.0):
        self._items: dict[str, StageResult] = {}
        self.max_items, self.ttl_s = max_items, ttl_s

    def put(self, key: str, result: StageResult) -> None:
        now = time.monotonic()
        for k in [k for k, r in self._items.items() if now - r.created > self.ttl_s]:
            del self._items[k]
        while len(self._items) >= self.max_items:
            del self._items[next(iter(self._items))]
        self._items[key] = result

    def pop(self, key: str) -> StageResult | None:
        return self._items.pop(key, None)


#: Process-wide: the API server middleware and the engine client share a process.
RESULTS = ResultBox()


class Orchestrator:
    def __init__(self, client, pipeline, store: PayloadStore, pools: dict, cluster):
        self.client = client
        self.pipeline = pipeline
        self.store = store
        self.pools = pools  # stage_id -> StagePool (downstream stages)
        self.cluster = cluster  # HeadCluster: master, coordinator, remote replicas
        self.entry = pipeline.entry_stage
        self._inflight: dict[str, set[tuple[int, str]]] = {}
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
        from vllm_omni_plugin.replicas.cluster import HeadCluster
        from vllm_omni_plugin.replicas.metrics import register_metrics
        from vllm_omni_plugin.replicas.pool import StagePool
        from vllm_omni_plugin.replicas.replica import LocalReplica

        pipeline = load_pipeline_config(settings["stage_configs_path"])
        conf = {"host": "127.0.0.1", "port": 0, "heartbeat_timeout": 30.0,
                "lb_policy": "random", "wait_timeout": 30.0, **settings.get("cluster", {})}
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
        for replica in replicas:
            pools[replica.stage_id].add(replica)
        register_metrics(pools)
        orchestrator = cls(client, pipeline, store, pools, cluster)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # built outside an event loop: start on the first request
        else:
            orchestrator._ensure_started()
        return orchestrator

    def _ensure_started(self) -> None:
        """Start attaching remote replicas (needs the API server's event loop)."""
        if not self._started:
            self._started = True
            self.cluster.start(self.pools)

    # -- request flow ---------------------------------------------------------
    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        self._ensure_started()
        extra = dict(sampling_params.extra_args or {})
        modalities = extra.get(xargs.MODALITIES) or ["text"]
        if list(modalities) == ["text"]:
            async for out in self.client.entry_generate(
                prompt, sampling_params, request_id, *args, **kwargs
            ):
                yield out
            return

        result_key = str(extra.get(xargs.RESULT) or uuid.uuid4().hex)
        base = safe_key(f"{request_id}.{uuid.uuid4().hex[:6]}")
        entry_out_key = f"{base}.s{self.entry.stage_id}.out"
        params = sampling_params.clone()
        params.extra_args = {**extra, xargs.PAYLOAD: {"out": entry_out_key}}
        keys = [entry_out_key]
        self.store.create(entry_out_key)
        self._inflight[request_id] = set()
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
            result = await self._run_downstream(request_id, base, outputs, extra, keys)
            if result is None:  # aborted between stages
                return
            RESULTS.put(result_key, result)
        except StageError as exc:
            logger.error("request %s failed: %s", request_id, exc)
            RESULTS.put(result_key, StageResult(output_type="error", error=str(exc),
                                                status=exc.status))
        finally:
            await asyncio.to_thread(self._delete, keys)
            self._inflight.pop(request_id, None)
            self._aborted.discard(request_id)
        if final is not None:
            yield final

    async def _run_downstream(self, request_id, base, outputs, extra, keys) -> StageResult | None:
        """Run every downstream stage; None when the request was aborted meanwhile."""
        from vllm_omni_plugin.processors.hookspecs import UpstreamOutput
        from vllm_omni_plugin.processors.registry import get_processor

        last, last_input = None, {}
        for stage in self.pipeline.topological_order():
            if stage.stage_id == self.entry.stage_id:
                continue
            try:
                processor = get_processor(stage.input_processor)
                extras = {**extra, "hf_config": self.client.model_config.hf_config}
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
            run = await self._run_stage(request_id, stage, stage_input)
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
        try:
            return await pool.run(task)
        except asyncio.CancelledError:
            raise
        except TaskAborted:
            return None
        except (NoReplicaAvailable, ReplicaFailed, TaskError) as exc:
            if request_id in self._aborted:
                return None
            raise StageError(stage.stage_id, stage.name, str(exc), status=exc.status) from exc
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
            for stage_id, sub_id in list(self._inflight.get(rid, ())):
                await self.pools[stage_id].abort(sub_id)

    def shutdown(self) -> None:
        from vllm_omni_plugin.replicas.metrics import unregister_metrics

        unregister_metrics(self.pools)
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
