"""Request flow between stages.

What a request asks beyond vLLM's fields comes from the API layer's
:class:`~vllm_omni_plugin.engine.omni_request.OmniRequest` (never from the
client's ``extra_args``: keys in the plugin's namespace are dropped here).
A request that asks only for text does not come here (:meth:`Orchestrator.passes_through`:
the engine client runs it on vLLM's ``AsyncLLM`` as plain vLLM does), unless the entry
stage has a prefill stage or requests have a timeout; then the entry stage's output is
streamed unchanged. When it asks for more (audio), the request
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
import itertools
from collections.abc import Mapping
from types import MappingProxyType

from vllm.sampling_params import RequestOutputKind

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.compat.internals import cache_salt_of, prompt_token_ids_of
from vllm_omni_plugin.engine.admission import AdmissionGate, AdmissionRefused
from vllm_omni_plugin.engine.errors import StageError, record_failure
from vllm_omni_plugin.engine.omni_request import (
    TEXT,
    OmniRequest,
    StageResult,
    current_omni_request,
)
from vllm_omni_plugin.engine.pd import ABORTED, RemotePrefill, decode_extra
from vllm_omni_plugin.engine.pipeline_run import PipelineRun
from vllm_omni_plugin.engine.streaming import InputStream, StageStreams, join_rows
from vllm_omni_plugin.kv_transfer import KV_TRANSFER_PARAMS
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import PayloadError, PayloadStore, safe_key
from vllm_omni_plugin.processors.hookspecs import StageRequest, UpstreamOutput
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
        #: the requests with parts on stage replicas (what :meth:`abort` finds), by id
        self._runs: dict[str, PipelineRun] = {}
        self._expiring: set[asyncio.Task] = set()
        self._serial = itertools.count()
        self._pd = None if self.prefill is None else RemotePrefill(
            self.prefill, self.entry, self._run_task)
        self._streams = StageStreams(self._stage_input, self._run_stage, pools)

    @property
    def runs(self) -> Mapping[str, PipelineRun]:
        """The requests with parts on stage replicas (what :meth:`abort` finds), by id; a
        read-only view."""
        return MappingProxyType(self._runs)

    # -- request flow ---------------------------------------------------------
    def passes_through(self, sampling_params) -> bool:
        """Whether a request is plain vLLM generation on the entry stage, which the engine
        client then runs without the orchestrator (no wrapper, no per-request state): it
        asks for text alone (the current :class:`OmniRequest`, or none), carries no key in
        the plugin's namespace (which :meth:`generate` drops), and the pipeline has neither
        a prefill stage for the entry stage nor a request timeout."""
        request = current_omni_request()
        return (self.prefill is None and self.request_timeout is None
                and (request is None or request.text_only)
                and not (sampling_params.extra_args
                         and xargs.reserved_keys(sampling_params.extra_args)))

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        """The entry stage's outputs for the request; for a pipeline request the
        final one comes after every downstream stage ran (the result goes into
        the current :class:`OmniRequest`).

        Raises:
            StageError: a text-only request failed in the entry stage's worker.
        """
        run = PipelineRun(request_id, current_omni_request() or OmniRequest(),
                          self.entry.stage_id)
        timer = None if self.request_timeout is None else asyncio.get_running_loop(
            ).call_later(self.request_timeout, self._expire, run)
        try:
            async for out in self._generate(run, prompt, sampling_params, *args, **kwargs):
                yield out
        finally:
            if timer is not None:
                timer.cancel()
            await self._close(run)
        if run.final is not None and not run.expired:
            yield run.final

    async def _generate(self, run: PipelineRun, prompt, sampling_params, *args, **kwargs):
        """The request's outputs: a text request's as its entry stage gives them; a
        pipeline request's but the final one, which goes into ``run.final`` once the
        downstream stages ran (or one failed): admission, the entry stage (a task on one
        of its replicas, or the head's engine), companions, the downstream stages."""
        extra = xargs.without_reserved(sampling_params.extra_args)
        extra.pop(KV_TRANSFER_PARAMS, None)  # the orchestrator pairs prefill and decode
        params = sampling_params.clone()
        if run.request.text_only:
            async for out in self._generate_text(run, prompt, params, extra, *args, **kwargs):
                yield out
            return
        if not await self._admit(run):
            return
        run.payload_key = f"{self._key_base(run)}.s{self.entry.stage_id}.out"
        token_ids = self._entry_task_ids(run, prompt, params)
        if token_ids is None:  # the head's engine publishes the entry stage's rows here
            self.store.create(run.payload_key)
        self._runs[run.request_id] = run
        final = None
        # the input stream of the stage with streaming input: for requests the client streams
        stream = InputStream(self.store, run.payload_key, self.entry.stage_id) \
            if self._stream_input_stage is not None and run.request.partials is not None \
            else None
        outputs: dict = {}
        try:
            if token_ids is not None:
                final = await self._run_entry_task(run, token_ids, params, outputs)
            else:
                async for out in self._run_entry_on_head(run, prompt, params, extra, outputs,
                                                         stream, *args, **kwargs):
                    if out.finished:
                        final = out
                    else:
                        yield out
            if self.entry.stage_id not in outputs:  # aborted, or no final output
                return
            companions = {}
            if run.request.companions:
                companions = await self._run_companions(run)
                if companions is None:
                    return
            if run.downstream is None:
                result = await self._run_downstream(run, outputs, extra, companions)
            else:
                stream.finish(outputs[self.entry.stage_id])
                result = await run.downstream
            if result is None:  # aborted between stages
                return
            run.request.result = result
        except asyncio.CancelledError:
            self._log_stopped(run, "cancelled (client disconnected)")
            raise
        except StageError as exc:
            if not run.expired:  # else the timeout is the request's error
                record_failure(run.request, run.request_id, exc)
        run.final = final

    def _key_base(self, run: PipelineRun) -> str:
        """The start of the request's payload keys: its id (made safe, its first 160
        characters) and a serial number of this orchestrator (a client may reuse a request
        id while the first is in flight; the store is this process's own)."""
        return f"{safe_key(run.request_id)[:160]}.{next(self._serial)}"

    async def _admit(self, run: PipelineRun) -> bool:
        """Reserve the request's slots of the downstream stages (``run.admission``);
        False when the gate refused (the request's result says why: HTTP 429) or the
        request timeout passed while it waited."""
        try:
            run.admission = await self.admission.admit()
        except AdmissionRefused as exc:
            logger.warning("request %s refused: %s", run.request_id, exc)
            run.request.result = StageResult.failure(str(exc), exc.status, exc.retry_after)
            return False
        return not run.expired

    async def _run_entry_on_head(self, run: PipelineRun, prompt, params, extra, outputs: dict,
                                 stream: InputStream | None, *args, **kwargs):
        """Run the request's entry-stage part on the head's engine (after its prefill
        stage, if any), yielding each of its outputs; once it finished, its output goes
        into ``outputs``. With ``stream``, the downstream stages start at its first output
        (``run.downstream``). Yields nothing when aborted during the prefill.

        Raises:
            StageError: the prefill stage failed, or the engine could not load its KV
                cache.
        """
        prefilled = await self._prefill(run, prompt, params, publish=True)
        if prefilled is ABORTED:
            return
        xargs.attach_payload(params, {**extra, **decode_extra(prefilled)},
                             {"out": run.payload_key,
                              **({"prefilled": True} if prefilled else {})})
        run.stage_id = self.entry.stage_id
        # streamed requests get only each step's new tokens (RequestOutputKind.DELTA)
        deltas = [] if params.output_kind == RequestOutputKind.DELTA else None
        final = None
        async for out in self.entry_generate(prompt, params, run.request_id, *args, **kwargs):
            if deltas is not None and out.outputs:
                deltas.extend(out.outputs[0].token_ids)
            if stream is not None and out.outputs:
                stream.update(out.prompt_token_ids,
                              deltas if deltas is not None else out.outputs[0].token_ids)
                if run.downstream is None:
                    run.downstream = asyncio.ensure_future(
                        self._run_downstream(run, outputs, extra, stream=stream))
            if out.finished:
                final = out
            yield out
        if final is None or run.aborted:
            return
        if prefilled:
            self._pd.check_kv_loaded(prefilled, final)
        payload = await self._payload(self.entry, run.payload_key)
        if prefilled:
            payload = join_rows(prefilled.payload, payload)
        outputs[self.entry.stage_id] = _stage_output(self.entry.stage_id, final, payload, deltas)

    async def _close(self, run: PipelineRun) -> None:
        """Give back what the request holds (called once, as :meth:`generate` ends): its
        downstream task (stopped), its admission's slots, its place in :attr:`_runs`, its
        companions' replica affinity and its payload slots."""
        if run.downstream is not None:
            run.downstream.cancel()  # a no-op once it is done
        if run.admission is not None:
            run.admission.release_all()
        self._runs.pop(run.request_id, None)
        if run.error_key is not None:
            self.store.delete(run.error_key)
        if run.payload_key is not None:
            if self._entry_pool is not None:
                self._entry_pool.forget(run.request_id)  # its companions' affinity
            # shielded: a client that goes away can cancel this generator again while it
            # cleans up, and a deletion not started yet would then never run
            await asyncio.shield(asyncio.ensure_future(
                asyncio.to_thread(self.store.delete, run.payload_key)))
        if run.downstream is not None:
            await asyncio.wait({run.downstream})

    def _entry_task_ids(self, run: PipelineRun, prompt, params):
        """The prompt's token ids when the request's entry-stage part runs as a task on
        one of the entry stage's replicas, else None (it runs on the head's engine).

        It does when the entry stage has a pool (no PD) and the client reads nothing of
        the entry stage's output: no text asked for (an image request), not streamed,
        ``n`` 1, and a prompt of plain token ids (multimodal data stays on the head)."""
        if self._entry_pool is None or TEXT in run.request.modalities \
                or run.request.partials is not None or getattr(params, "n", 1) != 1:
            return None
        token_ids = prompt_token_ids_of(prompt)
        if token_ids is None:
            logger.info("request %s: stage %d (%s) runs on the head's engine (the prompt is "
                        "not plain token ids)", run.request_id, self.entry.stage_id,
                        self.entry.name)
        return token_ids

    async def _run_entry_task(self, run: PipelineRun, token_ids: list[int], params,
                              outputs: dict):
        """Run the request's entry-stage part as a task on a replica of the entry stage
        (its companions follow it there: ``parent_request_id``); its output goes into
        ``outputs``. Returns the final ``RequestOutput`` for vLLM's handler (no text: the
        client reads none), None when aborted.

        Raises:
            StageError: the task failed (names the entry stage).
        """
        stage = self.entry
        task = StageTask(request_id=f"{run.request_id}-s{stage.stage_id}",
                         prompt_token_ids=token_ids, sampling=_task_sampling(params),
                         parent_request_id=run.request_id)
        stage_run = await self._run_task(run, stage, task)
        if stage_run is None or run.aborted:
            return None
        outputs[stage.stage_id] = _run_output(stage.stage_id, stage_run)
        return _request_output(run.request_id, stage_run)

    async def _run_companions(self, run: PipelineRun) -> dict | None:
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
        for name, text in run.request.companions.items():
            task = StageTask(request_id=f"{run.request_id}-{safe_key(name)}",
                             prompt_token_ids=list(self.tokenize(text)),
                             sampling={"max_tokens": 1, "temperature": 0.0},
                             parent_request_id=run.request_id)
            try:
                stage_run = await self._run_task(run, stage, task)
            except StageError as exc:
                raise StageError(stage.stage_id, stage.name, f"companion {name!r}: "
                                 f"{exc.detail}", exc.status, exc.retry_after) from exc
            if stage_run is None or run.aborted:
                return None
            outputs[name] = _run_output(stage.stage_id, stage_run)
        return outputs

    async def _generate_text(self, run: PipelineRun, prompt, params, extra, *args, **kwargs):
        """Plain vLLM generation on the entry stage (after its prefill stage, if any),
        with an error slot: a failure of the worker for this request fails it with a
        :class:`StageError` naming the stage instead of the engine."""
        run.error_key = f"{self._key_base(run)}.err"
        self.store.create(run.error_key)
        prefilled = None
        if self.prefill is not None:
            self._runs[run.request_id] = run
            try:
                prefilled = await self._prefill(run, prompt, params, publish=False)
            except StageError as exc:
                record_failure(run.request, run.request_id, exc)
                raise
            if prefilled is ABORTED:
                if run.expired:
                    raise self._timed_out(run)
                return
            extra = {**extra, **decode_extra(prefilled)}
        xargs.attach_payload(params, extra, {"err": run.error_key})
        async for out in self.entry_generate(prompt, params, run.request_id, *args, **kwargs):
            if run.expired:  # recorded by _expire
                raise self._timed_out(run)
            if out.finished:
                error = self.store.error(run.error_key)
                try:
                    if error is not None:
                        raise StageError(self.entry.stage_id, self.entry.name, error)
                    if prefilled:
                        self._pd.check_kv_loaded(prefilled, out)
                except StageError as exc:
                    record_failure(run.request, run.request_id, exc)
                    raise
            yield out

    async def _prefill(self, run: PipelineRun, prompt, params, publish: bool):
        """The request's prompt prefilled on the entry stage's prefill stage
        (:meth:`.pd.RemotePrefill.run`); None when the entry stage has no prefill stage."""
        if self._pd is None:
            return None
        return await self._pd.run(run, prompt_token_ids_of(prompt), params, publish,
                                  cache_salt=cache_salt_of(prompt))

    async def _run_downstream(self, run: PipelineRun, outputs, extra, companions=None,
                              stream: InputStream | None = None) -> StageResult | None:
        """Run every downstream stage, giving its admission slot back as the
        request leaves it; None when the request was aborted meanwhile. Their input
        processors see ``extra`` (the client's ``extra_args``) and ``companions`` (the
        companion prompts' outputs, by name) in their :class:`StageRequest`. A stage with
        ``streaming`` runs on chunks of its input stage's output while that stage runs,
        for a request the client streams (:attr:`OmniRequest.partials`). With ``stream``
        (the entry stage's :class:`InputStream`) this starts while the entry stage runs:
        the stage with ``stream_input`` runs on it, and a stage reading the entry stage's
        output otherwise waits for it to finish."""

        last = None
        request, admission = run.request, run.admission
        stage_request = StageRequest(hf_config=self.hf_config, voice=request.voice,
                                     options=request.options, companions=companions or {},
                                     extra=extra)
        for stage in self._downstream:
            if stage.stage_id in outputs:  # streamed, with its input stage
                admission.release(stage.stage_id)
                last = stage
                continue
            if stream is not None and stage is self._stream_input_stage:
                def produce(on_rows, stage=stage):
                    return self._streams.run_streaming_input(run, stage, stream,
                                                             stage_request, on_rows)
            else:
                if stream is not None and self.entry.stage_id in stage.inputs:
                    await stream.complete()
                stage_input = self._stage_input(stage, [outputs[s] for s in stage.inputs],
                                                stage_request)

                def produce(on_rows, stage=stage, stage_input=stage_input):
                    return self._run_stage(run, stage, stage_input, on_rows=on_rows)
            if run.aborted:
                return None
            streamed = self._streamed_from(stage) if request.partials is not None else None
            try:
                if streamed is None:
                    stage_run = await produce(None)
                else:
                    stage_run = await self._streams.run_chunked(run, stage, produce, streamed,
                                                                outputs, stage_request)
            finally:
                admission.release(stage.stage_id)
            if stage_run is None or run.aborted:
                return None
            outputs[stage.stage_id] = _run_output(stage.stage_id, stage_run)
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

    def _stage_input(self, stage, upstream: list, stage_request: StageRequest):
        """``stage``'s input processor on ``upstream``.

        Raises:
            StageError: the processor failed (400 for a ``ValueError``: a bad request).
        """
        try:
            return self.processors[stage.stage_id](upstream, stage, stage_request)
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

    async def _run_stage(self, run: PipelineRun, stage, stage_input, on_rows=None,
                         part: int | None = None, growth=None, parent: str | None = None):
        """Run ``stage`` for the request on one of its replicas; None when aborted.
        ``part``: the index of a chunk of a streamed request (its own sub-request);
        ``growth``: the rest of an input not complete yet (``StageTask.growth``);
        ``parent``: ``StageTask.parent_request_id``."""
        if stage_input.output is not None:
            logger.info("request %s: stage %d (%s) has nothing to do (%s); its output is "
                        "empty", run.request_id, stage.stage_id, stage.name,
                        stage_input.reason)
            return StageRun(prompt_token_ids=[], output_token_ids=[],
                            payload=dict(stage_input.output))
        suffix = "" if part is None else f"-c{part}"
        task = StageTask(
            request_id=f"{run.request_id}-s{stage.stage_id}{suffix}",
            prompt_token_ids=list(stage_input.prompt_token_ids),
            sampling={**stage.default_sampling_params, **stage_input.sampling_overrides},
            payload=stage_input.payload, parent_request_id=parent, ready=stage_input.ready,
            growth=growth)
        return await self._run_task(run, stage, task, on_rows)

    async def _run_task(self, run: PipelineRun, stage, task, on_rows=None):
        """Run ``task`` (a ``StageTask``) on one of ``stage``'s replicas; None when
        aborted. ``on_rows``: see ``StagePool.run``."""
        sub_id = task.request_id
        pool = self.pools[stage.stage_id]
        run.tasks.add((stage.stage_id, sub_id))
        run.stage_id = stage.stage_id
        try:
            return await pool.run(task, on_rows)
        except asyncio.CancelledError:
            raise
        except TaskAborted:
            return None
        except (NoReplicaAvailable, ReplicaFailed, TaskError) as exc:
            if run.aborted:
                return None
            raise StageError(stage.stage_id, stage.name, str(exc), status=exc.status,
                             retry_after=getattr(exc, "retry_after", None)) from exc
        except Exception as exc:
            if run.aborted:
                return None
            raise StageError(stage.stage_id, stage.name, f"{type(exc).__name__}: {exc}") from exc
        finally:
            run.tasks.discard((stage.stage_id, sub_id))
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
            run = self._runs.get(rid)
            if run is None:
                continue
            run.aborted = True
            self._log_stopped(run, "aborted")
            for stage_id, sub_id in list(run.tasks):
                await self.pools[stage_id].abort(sub_id)

    def _timed_out(self, run: PipelineRun) -> StageError:
        """The error of a request past ``request_timeout`` (HTTP 504), naming the stage
        it was at."""
        stage = self.pipeline.stage(run.stage_id)
        return StageError(stage.stage_id, stage.name,
                          f"the request did not finish within {self.request_timeout:g} s "
                          "(--omni-request-timeout)", status=504)

    def _expire(self, run: PipelineRun) -> None:
        """``request_timeout`` passed: fail the request and abort it at every stage."""
        record_failure(run.request, run.request_id, self._timed_out(run))
        run.expired = True
        task = asyncio.ensure_future(self._abort_everywhere(run.request_id))
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    async def _abort_everywhere(self, request_id: str) -> None:
        await self.abort(request_id)  # the downstream stages and the prefill stage
        await self.entry_abort(request_id)

    def _log_stopped(self, run: PipelineRun, how: str) -> None:
        logger.info("request %s %s while at stage %d (%s)", run.request_id, how, run.stage_id,
                    self.pipeline.stage(run.stage_id).name)


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

