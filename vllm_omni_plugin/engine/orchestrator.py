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
nothing else. With a request timeout (``--omni-request-timeout``) a request still
running when it passes is aborted at every stage and fails with HTTP 504 naming the
stage it was at.

A request whose client reads nothing of the entry stage's output (no text asked for: an
image request) runs its entry-stage part as a task of the entry stage's pool, like any
other stage's: on the head's own engine or on a headless replica of the entry stage
(``vllm serve --headless --stage-id <entry>``). Its companion prompts
(:attr:`OmniRequest.companions`, e.g. a CFG branch's context) follow it to the same
replica. Text, and anything with multimodal input, stays on the head's engine.

When the entry stage is a decode stage (``pd.role: decode``), every request's prompt
is first prefilled on its prefill stage (:mod:`.pd`).

For a request the client streams, a stage with ``stream_input`` (the talker) starts
while the entry stage still generates, and a final stage with ``streaming`` (code2wav)
runs on chunks of its input stage's output (:mod:`.streaming`, which also gives the
words for both).
"""

from __future__ import annotations

import asyncio
import uuid

from vllm.sampling_params import RequestOutputKind

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.compat.internals import prompt_token_ids_of
from vllm_omni_plugin.engine.admission import AdmissionGate, AdmissionRefused
from vllm_omni_plugin.engine.errors import StageError, record_failure
from vllm_omni_plugin.engine.omni_request import (
    TEXT,
    OmniRequest,
    StageResult,
    current_omni_request,
)
from vllm_omni_plugin.engine.pd import ABORTED, RemotePrefill, decode_extra
from vllm_omni_plugin.engine.streaming import InputStream, StageStreams, join_rows
from vllm_omni_plugin.kv_transfer import KV_TRANSFER_PARAMS
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import PayloadError, PayloadStore, safe_key
from vllm_omni_plugin.processors.hookspecs import UpstreamOutput
from vllm_omni_plugin.replicas.pool import NoReplicaAvailable, ReplicaFailed
from vllm_omni_plugin.replicas.task import StageRun, StageTask, TaskAborted, TaskError

logger = init_logger(__name__)


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
        pools: stage id -> ``StagePool`` of every downstream stage and of the entry
            stage's prefill stage, if any; and of the entry stage itself, if it runs
            tasks (see :meth:`generate`).
        admission: the gate bounding pipeline requests per downstream stage.
        processors: stage id -> the stage input processor of every downstream stage.
        tokenize: text -> the entry stage's prompt token ids (for companion prompts
            run as tasks); None when the entry stage runs no tasks.
        entry_abort: aborts a request on the entry stage (vLLM's ``AsyncLLM.abort``
            of the served model); needed with ``request_timeout``.
        request_timeout: seconds a request may run before it is aborted and fails
            (HTTP 504); None: no limit.

    Raises:
        ValueError: a downstream stage has no pool or no processor (names it).
    """

    def __init__(self, entry_generate, hf_config, pipeline, store: PayloadStore, pools: dict,
                 admission: AdmissionGate, processors: dict, tokenize=None,
                 entry_abort=None, request_timeout: float | None = None) -> None:
        self.entry_generate = entry_generate
        self.entry_abort = entry_abort
        self.request_timeout = request_timeout
        if request_timeout is not None and entry_abort is None:
            raise ValueError("a request timeout needs the entry stage's abort")
        self.tokenize = tokenize
        self.hf_config = hf_config
        self.pipeline = pipeline
        self.store = store
        self.pools = pools
        self.admission = admission
        self.processors = processors
        self.entry = pipeline.entry_stage
        self._downstream = [s for s in pipeline.topological_order()
                            if s.stage_id != self.entry.stage_id]
        #: the stage fed the entry stage's output while it runs, if any
        self._stream_input_stage = next((s for s in self._downstream if s.stream_input), None)
        for stage in self._downstream:
            for what, table in (("stage pool", pools), ("input processor", processors)):
                if stage.stage_id not in table:
                    raise ValueError(f"stage {stage.stage_id} ({stage.name}): no {what}")
        self.prefill = pipeline.prefill_stage_for(self.entry.stage_id)
        if self.prefill is not None and self.prefill.stage_id not in pools:
            raise ValueError(f"stage {self.prefill.stage_id} ({self.prefill.name}): "
                             "no stage pool")
        #: the pool of the entry stage's replicas (the head's engine and headless ones)
        self._entry_pool = pools.get(self.entry.stage_id)
        if self._entry_pool is not None and tokenize is None:
            raise ValueError(f"stage {self.entry.stage_id} ({self.entry.name}): a stage "
                             "pool but no tokenizer")
        self._inflight: dict[str, set[tuple[int, str]]] = {}
        self._stage_of: dict[str, int] = {}  # pipeline request -> the stage it is at
        self._aborted: set[str] = set()
        self._expired: set[str] = set()  # requests past the request timeout
        self._expiring: set[asyncio.Task] = set()
        self._pd = None if self.prefill is None else RemotePrefill(
            self.prefill, self.entry, self._run_task, self._aborted)
        self._streams = StageStreams(self._stage_input, self._run_stage, pools, self._aborted)

    # -- request flow ---------------------------------------------------------
    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        """The entry stage's outputs for the request; for a pipeline request the
        final one comes after every downstream stage ran (the result goes into
        the current :class:`OmniRequest`).

        Raises:
            StageError: a text-only request failed in the entry stage's worker.
        """
        request = current_omni_request() or OmniRequest()
        timer = None if self.request_timeout is None else asyncio.get_running_loop(
            ).call_later(self.request_timeout, self._expire, request, request_id)
        try:
            async for out in self._generate(request, prompt, sampling_params, request_id,
                                            *args, **kwargs):
                yield out
        finally:
            if timer is not None:
                timer.cancel()
            self._expired.discard(request_id)

    async def _generate(self, request: OmniRequest, prompt, sampling_params, request_id,
                        *args, **kwargs):
        extra = xargs.without_reserved(sampling_params.extra_args)
        extra.pop(KV_TRANSFER_PARAMS, None)  # the orchestrator pairs prefill and decode
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
        if request_id in self._expired:  # the request timeout passed while it waited
            admission.release_all()
            return
        base = safe_key(f"{request_id}.{uuid.uuid4().hex[:6]}")
        entry_out_key = f"{base}.s{self.entry.stage_id}.out"
        token_ids = self._entry_task_ids(request, prompt, params, request_id)
        if token_ids is None:  # the head's engine publishes the entry stage's rows here
            self.store.create(entry_out_key)
        self._inflight[request_id] = set()
        final = None
        # the input stream of the stage with streaming input: for requests the client streams
        stream = InputStream(self.store, entry_out_key, self.entry.stage_id) \
            if self._stream_input_stage is not None and request.partials is not None else None
        downstream = None
        outputs: dict = {}
        try:
            if token_ids is not None:
                final = await self._run_entry_task(request_id, token_ids, params, outputs)
                if final is None:
                    return
            else:
                prefilled = await self._prefill(request_id, prompt, params, publish=True)
                if prefilled is ABORTED:
                    return
                params.extra_args = {**extra, **decode_extra(prefilled),
                                     xargs.PAYLOAD: {"out": entry_out_key,
                                                     **({"prefilled": True} if prefilled else {})}}
                self._stage_of[request_id] = self.entry.stage_id
                # streamed requests get only each step's new tokens (RequestOutputKind.DELTA)
                deltas = [] if params.output_kind == RequestOutputKind.DELTA else None
                async for out in self.entry_generate(prompt, params, request_id, *args, **kwargs):
                    if deltas is not None and out.outputs:
                        deltas.extend(out.outputs[0].token_ids)
                    if stream is not None and out.outputs:
                        stream.update(out.prompt_token_ids,
                                    deltas if deltas is not None else out.outputs[0].token_ids)
                        if downstream is None:
                            downstream = asyncio.ensure_future(self._run_downstream(
                                request, request_id, outputs, extra, admission, stream))
                    if out.finished:
                        final = out
                    else:
                        yield out
                if final is None or request_id in self._aborted:
                    return
                if prefilled:
                    self._pd.check_kv_loaded(prefilled, final)
                payload = await self._payload(self.entry, entry_out_key)
                if prefilled:
                    payload = join_rows(prefilled.payload, payload)
                outputs[self.entry.stage_id] = _stage_output(self.entry.stage_id, final, payload,
                                                             deltas)
            if request.companions:
                companions = await self._run_companions(request, request_id)
                if companions is None:
                    return
                extra = {**extra, "companions": companions}
            if downstream is None:
                result = await self._run_downstream(request, request_id, outputs, extra,
                                                    admission)
            else:
                stream.finish(outputs[self.entry.stage_id])
                result = await downstream
            if result is None:  # aborted between stages
                return
            request.result = result
        except asyncio.CancelledError:
            self._log_stopped(request_id, "cancelled (client disconnected)")
            raise
        except StageError as exc:
            if request_id not in self._expired:  # else the timeout is the request's error
                record_failure(request, request_id, exc)
        finally:
            if downstream is not None:
                downstream.cancel()  # a no-op once it is done
            admission.release_all()
            self._inflight.pop(request_id, None)
            self._stage_of.pop(request_id, None)
            self._aborted.discard(request_id)
            if self._entry_pool is not None:
                self._entry_pool.forget(request_id)  # its companions' affinity
            # shielded: a client that goes away can cancel this generator again while it
            # cleans up, and a deletion not started yet would then never run
            await asyncio.shield(asyncio.ensure_future(
                asyncio.to_thread(self.store.delete, entry_out_key)))
            if downstream is not None:
                await asyncio.wait({downstream})
        if final is not None and request_id not in self._expired:
            yield final

    def _entry_task_ids(self, request: OmniRequest, prompt, params, request_id):
        """The prompt's token ids when the request's entry-stage part runs as a task on
        one of the entry stage's replicas, else None (it runs on the head's engine).

        It does when the entry stage has a pool (no PD) and the client reads nothing of
        the entry stage's output: no text asked for (an image request), not streamed,
        ``n`` 1, and a prompt of plain token ids (multimodal data stays on the head)."""
        if self._entry_pool is None or TEXT in request.modalities \
                or request.partials is not None or getattr(params, "n", 1) != 1:
            return None
        token_ids = prompt_token_ids_of(prompt)
        if token_ids is None:
            logger.info("request %s: stage %d (%s) runs on the head's engine (the prompt is "
                        "not plain token ids)", request_id, self.entry.stage_id,
                        self.entry.name)
        return token_ids

    async def _run_entry_task(self, request_id, token_ids: list[int], params,
                              outputs: dict):
        """Run the request's entry-stage part as a task on a replica of the entry stage
        (its companions follow it there: ``parent_request_id``); its output goes into
        ``outputs``. Returns the final ``RequestOutput`` for vLLM's handler (no text: the
        client reads none), None when aborted.

        Raises:
            StageError: the task failed (names the entry stage).
        """
        stage = self.entry
        task = StageTask(request_id=f"{request_id}-s{stage.stage_id}",
                         prompt_token_ids=token_ids, sampling=_task_sampling(params),
                         parent_request_id=request_id)
        run = await self._run_task(request_id, stage, task)
        if run is None or request_id in self._aborted:
            return None
        outputs[stage.stage_id] = _run_output(stage.stage_id, run)
        return _request_output(request_id, run)

    async def _run_companions(self, request: OmniRequest, request_id) -> dict | None:
        """Run the request's companion prompts (:attr:`OmniRequest.companions`) as tasks
        of the entry stage, one after another, on the replica the request's own task ran
        on while it is up (``parent_request_id``); their :class:`UpstreamOutput` by name,
        None when aborted meanwhile.

        Raises:
            StageError: a companion failed, or the entry stage runs no tasks (PD); names
                the entry stage and the companion.
        """
        stage = self.entry
        if self._entry_pool is None:
            raise StageError(stage.stage_id, stage.name, "companion prompts need the entry "
                             "stage to run tasks, which it does not as a decode stage (pd)")
        outputs = {}
        for name, text in request.companions.items():
            task = StageTask(request_id=f"{request_id}-{safe_key(name)}",
                             prompt_token_ids=list(self.tokenize(text)),
                             sampling={"max_tokens": 1, "temperature": 0.0},
                             parent_request_id=request_id)
            try:
                run = await self._run_task(request_id, stage, task)
            except StageError as exc:
                raise StageError(stage.stage_id, stage.name, f"companion {name!r}: "
                                 f"{exc.detail}", exc.status, exc.retry_after) from exc
            if run is None or request_id in self._aborted:
                return None
            outputs[name] = _run_output(stage.stage_id, run)
        return outputs

    async def _generate_text(self, request: OmniRequest, prompt, params, extra, request_id,
                             *args, **kwargs):
        """Plain vLLM generation on the entry stage (after its prefill stage, if any),
        with an error slot: a failure of the worker for this request fails it with a
        :class:`StageError` naming the stage instead of the engine."""
        err_key = f"{safe_key(request_id)}.{uuid.uuid4().hex[:6]}.err"
        self.store.create(err_key)
        prefilled = None
        try:
            if self.prefill is not None:
                self._inflight[request_id] = set()
                try:
                    prefilled = await self._prefill(request_id, prompt, params,
                                                    publish=False)
                except StageError as exc:
                    record_failure(request, request_id, exc)
                    raise
                if prefilled is ABORTED:
                    if request_id in self._expired:
                        raise self._timed_out(request_id)
                    return
                extra = {**extra, **decode_extra(prefilled)}
            params.extra_args = {**extra, xargs.PAYLOAD: {"err": err_key}}
            async for out in self.entry_generate(prompt, params, request_id, *args, **kwargs):
                if request_id in self._expired:  # recorded by _expire
                    raise self._timed_out(request_id)
                if out.finished:
                    error = self.store.error(err_key)
                    try:
                        if error is not None:
                            raise StageError(self.entry.stage_id, self.entry.name, error)
                        if prefilled:
                            self._pd.check_kv_loaded(prefilled, out)
                    except StageError as exc:
                        record_failure(request, request_id, exc)
                        raise
                yield out
        finally:
            self.store.delete(err_key)
            self._inflight.pop(request_id, None)
            self._stage_of.pop(request_id, None)
            self._aborted.discard(request_id)

    async def _prefill(self, request_id, prompt, params, publish: bool):
        """The request's prompt prefilled on the entry stage's prefill stage
        (:meth:`.pd.RemotePrefill.run`); None when the entry stage has no prefill stage."""
        if self._pd is None:
            return None
        return await self._pd.run(request_id, prompt_token_ids_of(prompt), params, publish)

    async def _run_downstream(self, request: OmniRequest, request_id, outputs, extra,
                              admission, stream: InputStream | None = None
                              ) -> StageResult | None:
        """Run every downstream stage, giving its admission slot back as the
        request leaves it; None when the request was aborted meanwhile. A stage with
        ``streaming`` runs on chunks of its input stage's output while that stage runs,
        for a request the client streams (:attr:`OmniRequest.partials`). With ``stream``
        (the entry stage's :class:`InputStream`) this starts while the entry stage runs:
        the stage with ``stream_input`` runs on it, and a stage reading the entry stage's
        output otherwise waits for it to finish."""

        last = None
        extras = {**extra, xargs.SPEAKER: request.voice, "hf_config": self.hf_config,
                  **request.options}
        for stage in self._downstream:
            if stage.stage_id in outputs:  # streamed, with its input stage
                admission.release(stage.stage_id)
                last = stage
                continue
            if stream is not None and stage is self._stream_input_stage:
                def produce(on_rows, stage=stage):
                    return self._streams.run_streaming_input(request_id, stage, stream,
                                                             extras, on_rows)
            else:
                if stream is not None and self.entry.stage_id in stage.inputs:
                    await stream.complete()
                stage_input = self._stage_input(stage, [outputs[s] for s in stage.inputs],
                                                extras)

                def produce(on_rows, stage=stage, stage_input=stage_input):
                    return self._run_stage(request_id, stage, stage_input, on_rows=on_rows)
            if request_id in self._aborted:
                return None
            streamed = self._streamed_from(stage) if request.partials is not None else None
            try:
                if streamed is None:
                    run = await produce(None)
                else:
                    run = await self._streams.run_chunked(request, request_id, stage, produce,
                                                          streamed, outputs, extras)
            finally:
                admission.release(stage.stage_id)
            if run is None or request_id in self._aborted:
                return None
            outputs[stage.stage_id] = _run_output(stage.stage_id, run)
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

    def _stage_input(self, stage, upstream: list, extras: dict):
        """``stage``'s input processor on ``upstream``.

        Raises:
            StageError: the processor failed (400 for a ``ValueError``: a bad request).
        """
        try:
            return self.processors[stage.stage_id](upstream, stage, dict(extras))
        except ValueError as exc:  # processors raise ValueError for bad requests
            raise StageError(stage.stage_id, stage.name,
                             f"input processor {stage.input_processor!r}: {exc}",
                             status=400) from exc
        except Exception as exc:
            raise StageError(stage.stage_id, stage.name,
                             f"input processor {stage.input_processor!r}: {exc}") from exc

    def _streamed_from(self, stage):
        """The downstream stage that streams ``stage``'s output (``streaming``), or None."""
        return next((s for s in self._downstream
                     if s.streaming is not None and s.inputs == [stage.stage_id]), None)

    async def _run_stage(self, request_id, stage, stage_input, on_rows=None,
                         part: int | None = None, growth=None, parent: str | None = None):
        """Run ``stage`` for the request on one of its replicas; None when aborted.
        ``part``: the index of a chunk of a streamed request (its own sub-request);
        ``growth``: the rest of an input not complete yet (``StageTask.growth``);
        ``parent``: ``StageTask.parent_request_id``."""
        if stage_input.output is not None:
            logger.info("request %s: stage %d (%s) has nothing to do (%s); its output is "
                        "empty", request_id, stage.stage_id, stage.name, stage_input.reason)
            return StageRun(prompt_token_ids=[], output_token_ids=[],
                            payload=dict(stage_input.output))
        suffix = "" if part is None else f"-c{part}"
        task = StageTask(
            request_id=f"{request_id}-s{stage.stage_id}{suffix}",
            prompt_token_ids=list(stage_input.prompt_token_ids),
            sampling={**stage.default_sampling_params, **stage_input.sampling_overrides},
            payload=stage_input.payload, parent_request_id=parent, ready=stage_input.ready,
            growth=growth)
        return await self._run_task(request_id, stage, task, on_rows)

    async def _run_task(self, request_id, stage, task, on_rows=None):
        """Run ``task`` (a ``StageTask``) on one of ``stage``'s replicas; None when
        aborted. ``on_rows``: see ``StagePool.run``."""
        sub_id = task.request_id
        pool = self.pools[stage.stage_id]
        self._inflight.setdefault(request_id, set()).add((stage.stage_id, sub_id))
        self._stage_of[request_id] = stage.stage_id
        try:
            return await pool.run(task, on_rows)
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

    async def abort(self, request_id) -> None:
        """Abort requests' tasks on stage replicas (downstream, prefill and entry-stage tasks)
        and mark the requests aborted; a part running on the head's own engine is not
        aborted here (that is vLLM's ``AsyncLLM.abort``).

        Args:
            request_id: One request id, or an iterable of ids; ids with no request in
                flight here are skipped.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if rid not in self._inflight:
                continue
            self._aborted.add(rid)
            self._log_stopped(rid, "aborted")
            for stage_id, sub_id in list(self._inflight.get(rid, ())):
                await self.pools[stage_id].abort(sub_id)

    def _timed_out(self, request_id: str) -> StageError:
        """The error of a request past ``request_timeout`` (HTTP 504), naming the stage
        it was at."""
        stage = self.pipeline.stage(self._stage_of.get(request_id, self.entry.stage_id))
        return StageError(stage.stage_id, stage.name,
                          f"the request did not finish within {self.request_timeout:g} s "
                          "(--omni-request-timeout)", status=504)

    def _expire(self, request: OmniRequest, request_id: str) -> None:
        """``request_timeout`` passed: fail the request and abort it at every stage."""
        record_failure(request, request_id, self._timed_out(request_id))
        self._expired.add(request_id)
        task = asyncio.ensure_future(self._abort_everywhere(request_id))
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    async def _abort_everywhere(self, request_id: str) -> None:
        await self.abort(request_id)  # the downstream stages and the prefill stage
        await self.entry_abort(request_id)

    def _log_stopped(self, request_id: str, how: str) -> None:
        stage_id = self._stage_of.get(request_id, self.entry.stage_id)
        logger.info("request %s %s while at stage %d (%s)", request_id, how, stage_id,
                    self.pipeline.stage(stage_id).name)


#: ``SamplingParams`` fields an entry-stage task takes from the client's request
_TASK_SAMPLING = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed",
                  "ignore_eos", "stop_token_ids")


def _task_sampling(params) -> dict:
    """The ``StageTask.sampling`` of the client's ``SamplingParams`` (its
    :data:`_TASK_SAMPLING` fields that are set)."""
    values = {name: getattr(params, name, None) for name in _TASK_SAMPLING}
    if values["stop_token_ids"] is not None:
        values["stop_token_ids"] = list(values["stop_token_ids"])
    return {name: value for name, value in values.items() if value is not None}


def _request_output(request_id: str, run):
    """The finished ``RequestOutput`` of an entry-stage task's :class:`StageRun`, for
    vLLM's handler: its token ids and finish reason, no text (the client reads none)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(index=0, text="", token_ids=list(run.output_token_ids),
                                  cumulative_logprob=None, logprobs=None,
                                  finish_reason=run.finish_reason)
    return RequestOutput(request_id=request_id, prompt=None,
                         prompt_token_ids=list(run.prompt_token_ids), prompt_logprobs=None,
                         outputs=[completion], finished=True)


def _run_output(stage_id: int, run):
    """The :class:`UpstreamOutput` of a stage task's :class:`StageRun`."""
    return UpstreamOutput(stage_id=stage_id, prompt_token_ids=run.prompt_token_ids,
                          output_token_ids=run.output_token_ids, payload=run.payload)


def _stage_output(stage_id: int, request_output, payload, generated: list[int] | None):
    """The entry stage's :class:`UpstreamOutput`; ``generated`` holds the output token ids
    gathered from every output of a streamed request (None: the final output has them)."""
    if generated is None:
        generated = list(request_output.outputs[0].token_ids)
    return UpstreamOutput(
        stage_id=stage_id,
        prompt_token_ids=list(request_output.prompt_token_ids or []),
        output_token_ids=generated,
        payload=payload,
    )

