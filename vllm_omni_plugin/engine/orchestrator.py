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
import uuid

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.engine.admission import AdmissionGate, AdmissionRefused
from vllm_omni_plugin.engine.omni_request import (
    OmniRequest,
    StageResult,
    current_omni_request,
)
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import PayloadError, PayloadStore, safe_key

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
    """Moves one request through the pipeline's stages; built by
    :func:`~vllm_omni_plugin.engine.bootstrap.build_head`.

    Args:
        entry_generate: runs a request on the entry stage (vLLM's
            ``AsyncLLM.generate`` of the served model): ``(prompt, params,
            request_id, ...)`` -> async iterator of ``RequestOutput``.
        hf_config: the served checkpoint's HF config (for stage input processors).
        pipeline: the ``PipelineConfig``.
        store: the payload store stages exchange tensors through.
        pools: stage id -> ``StagePool`` of every downstream stage.
        admission: the gate bounding pipeline requests per downstream stage.
        processors: stage id -> the stage input processor of every downstream stage.

    Raises:
        ValueError: a downstream stage has no pool or no processor (names it).
    """

    def __init__(self, entry_generate, hf_config, pipeline, store: PayloadStore, pools: dict,
                 admission: AdmissionGate, processors: dict) -> None:
        self.entry_generate = entry_generate
        self.hf_config = hf_config
        self.pipeline = pipeline
        self.store = store
        self.pools = pools
        self.admission = admission
        self.processors = processors
        self.entry = pipeline.entry_stage
        self._downstream = [s for s in pipeline.topological_order()
                            if s.stage_id != self.entry.stage_id]
        for stage in self._downstream:
            for what, table in (("stage pool", pools), ("input processor", processors)):
                if stage.stage_id not in table:
                    raise ValueError(f"stage {stage.stage_id} ({stage.name}): no {what}")
        self._inflight: dict[str, set[tuple[int, str]]] = {}
        self._stage_of: dict[str, int] = {}  # pipeline request -> the stage it is at
        self._aborted: set[str] = set()

    # -- request flow ---------------------------------------------------------
    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        """The entry stage's outputs for the request; for a pipeline request the
        final one comes after every downstream stage ran (the result goes into
        the current :class:`OmniRequest`).

        Raises:
            StageError: a text-only request failed in the entry stage's worker.
        """
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
            async for out in self.entry_generate(prompt, params, request_id, *args, **kwargs):
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
            _record_failure(request, request_id, exc)
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
            async for out in self.entry_generate(prompt, params, request_id, *args, **kwargs):
                if out.finished:
                    error = self.store.error(err_key)
                    if error is not None:
                        exc = StageError(self.entry.stage_id, self.entry.name, error)
                        _record_failure(request, request_id, exc)
                        raise exc
                yield out
        finally:
            self.store.delete(err_key)

    async def _run_downstream(self, request: OmniRequest, request_id, outputs, extra,
                              admission) -> StageResult | None:
        """Run every downstream stage, giving its admission slot back as the
        request leaves it; None when the request was aborted meanwhile."""
        from vllm_omni_plugin.processors.hookspecs import UpstreamOutput

        last = None
        extras = {**extra, xargs.SPEAKER: request.voice, "hf_config": self.hf_config}
        for stage in self._downstream:
            try:
                upstream = [outputs[s] for s in stage.inputs]
                stage_input = self.processors[stage.stage_id](upstream, stage, dict(extras))
            except ValueError as exc:  # processors raise ValueError for bad requests
                raise StageError(stage.stage_id, stage.name,
                                 f"input processor {stage.input_processor!r}: {exc}",
                                 status=400) from exc
            except Exception as exc:
                raise StageError(stage.stage_id, stage.name,
                                 f"input processor {stage.input_processor!r}: {exc}") from exc
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
                           stage_outputs={s: o for s, o in outputs.items()
                                          if s != self.entry.stage_id})

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


def _record_failure(request: OmniRequest, request_id: str, exc: StageError) -> None:
    """Log a failed request and hand its error to the API layer."""
    logger.error("request %s failed: %s", request_id, exc)
    request.result = StageResult.failure(str(exc), exc.status, exc.retry_after)


def _stage_output(stage_id: int, request_output, payload):
    from vllm_omni_plugin.processors.hookspecs import UpstreamOutput

    completion = request_output.outputs[0]
    return UpstreamOutput(
        stage_id=stage_id,
        prompt_token_ids=list(request_output.prompt_token_ids or []),
        output_token_ids=list(completion.token_ids),
        payload=payload,
    )

