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

A request whose client reads nothing of the entry stage's output (no text asked for: an
image request) runs its entry-stage part as a task of the entry stage's pool, like any
other stage's: on the head's own engine or on a headless replica of the entry stage
(``vllm serve --headless --stage-id <entry>``). Its companion prompts
(:attr:`OmniRequest.companions`, e.g. a CFG branch's context) follow it to the same
replica. Text, and anything with multimodal input, stays on the head's engine.

When the entry stage is a decode stage (``pd.role: decode``), every request first
runs on a replica of its prefill stage: the prompt's token ids, one output token,
``ignore_eos``, vLLM's ``kv_transfer_params`` asking the prefill engine to keep the KV
cache under a fresh ``transfer_id``. The entry engine then gets the client's prompt and
sampling parameters plus the parameters that make it pull that KV cache (the prefill
replica says where from). The prefill stage publishes the prompt's rows, the entry
stage the generated ones; the downstream stages see them joined, as without PD.
Client ``kv_transfer_params`` never reach an engine.

A final stage with ``streaming`` (code2wav) runs, for a request the client streams, on
chunks of its input stage's output while that stage (the talker) still generates: each
chunk of rows, after some rows of left context, is one task of the stage, and its output
goes to the API layer (:attr:`OmniRequest.partials`) as soon as it is ready. A stage
with ``stream_input`` (the talker) starts, for such a request, while the entry stage still
generates: its input processor is called on the entry stage's output so far until it says
the input is enough (``StageInput.ready``), and the stage's one request is fed the rest
as the entry stage produces it (a resumable vLLM request, see ``replicas.task``).
"""

from __future__ import annotations

import asyncio
import uuid

from vllm.sampling_params import RequestOutputKind

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.engine.admission import AdmissionGate, AdmissionRefused
from vllm_omni_plugin.engine.omni_request import (
    TEXT,
    OmniRequest,
    StageResult,
    current_omni_request,
)
from vllm_omni_plugin.kv_transfer import (
    KV_TRANSFER_PARAMS,
    decode_request_params,
    prefill_request_params,
)
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import (
    GrowingPayload,
    PayloadError,
    PayloadStore,
    safe_key,
)

logger = init_logger(__name__)


class StageError(RuntimeError):
    """A stage failed for one request. ``stage_id``/``stage_name`` name it;
    ``status`` is the HTTP status the API layer answers with (400 when the
    request itself was at fault, e.g. an unknown voice, 503 when the stage has
    no replica, else 500); ``retry_after`` seconds go with a 503."""

    def __init__(self, stage_id: int, stage_name: str, message: str, status: int = 500,
                 retry_after: float | None = None):
        super().__init__(f"stage {stage_id} ({stage_name}): {message}")
        self.detail = message
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
        pools: stage id -> ``StagePool`` of every downstream stage and of the entry
            stage's prefill stage, if any; and of the entry stage itself, if it runs
            tasks (see :meth:`generate`).
        admission: the gate bounding pipeline requests per downstream stage.
        processors: stage id -> the stage input processor of every downstream stage.
        tokenize: text -> the entry stage's prompt token ids (for companion prompts
            run as tasks); None when the entry stage runs no tasks.

    Raises:
        ValueError: a downstream stage has no pool or no processor (names it).
    """

    def __init__(self, entry_generate, hf_config, pipeline, store: PayloadStore, pools: dict,
                 admission: AdmissionGate, processors: dict, tokenize=None) -> None:
        self.entry_generate = entry_generate
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
        self._fed = next((s for s in self._downstream if s.stream_input), None)
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
        base = safe_key(f"{request_id}.{uuid.uuid4().hex[:6]}")
        entry_out_key = f"{base}.s{self.entry.stage_id}.out"
        token_ids = self._entry_task_ids(request, prompt, params, request_id)
        if token_ids is None:  # the head's engine publishes the entry stage's rows here
            self.store.create(entry_out_key)
        self._inflight[request_id] = set()
        final = None
        # a stage fed while the entry stage runs: for requests the client streams
        feed = _EntryFeed(self.store, entry_out_key, self.entry.stage_id) \
            if self._fed is not None and request.partials is not None else None
        downstream = None
        outputs: dict = {}
        try:
            if token_ids is not None:
                final = await self._run_entry_task(request_id, token_ids, params, outputs)
                if final is None:
                    return
            else:
                prefilled = await self._remote_prefill(request_id, prompt, params, publish=True)
                if prefilled is _ABORTED:
                    return
                params.extra_args = {**extra, **_decode_extra(prefilled),
                                     xargs.PAYLOAD: {"out": entry_out_key,
                                                     **({"prefilled": True} if prefilled else {})}}
                self._stage_of[request_id] = self.entry.stage_id
                # streamed requests get only each step's new tokens (RequestOutputKind.DELTA)
                deltas = [] if params.output_kind == RequestOutputKind.DELTA else None
                async for out in self.entry_generate(prompt, params, request_id, *args, **kwargs):
                    if deltas is not None and out.outputs:
                        deltas.extend(out.outputs[0].token_ids)
                    if feed is not None and out.outputs:
                        feed.update(out.prompt_token_ids,
                                    deltas if deltas is not None else out.outputs[0].token_ids)
                        if downstream is None:
                            downstream = asyncio.ensure_future(self._run_downstream(
                                request, request_id, outputs, extra, admission, feed))
                    if out.finished:
                        final = out
                    else:
                        yield out
                if final is None:
                    return
                self._check_kv_loaded(prefilled, final)
                payload = await self._payload(self.entry, entry_out_key)
                if prefilled:
                    payload = _join_rows(prefilled.payload, payload)
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
                feed.finish(outputs[self.entry.stage_id])
                result = await downstream
            if result is None:  # aborted between stages
                return
            request.result = result
        except asyncio.CancelledError:
            self._log_stopped(request_id, "cancelled (client disconnected)")
            raise
        except StageError as exc:
            _record_failure(request, request_id, exc)
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
        if final is not None:
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
        from vllm_omni_plugin.replicas.task import StageTask

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
        from vllm_omni_plugin.replicas.task import StageTask

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
                    prefilled = await self._remote_prefill(request_id, prompt, params,
                                                           publish=False)
                except StageError as exc:
                    _record_failure(request, request_id, exc)
                    raise
                if prefilled is _ABORTED:
                    return
                extra = {**extra, **_decode_extra(prefilled)}
            params.extra_args = {**extra, xargs.PAYLOAD: {"err": err_key}}
            async for out in self.entry_generate(prompt, params, request_id, *args, **kwargs):
                if out.finished:
                    error = self.store.error(err_key)
                    try:
                        if error is not None:
                            raise StageError(self.entry.stage_id, self.entry.name, error)
                        self._check_kv_loaded(prefilled, out)
                    except StageError as exc:
                        _record_failure(request, request_id, exc)
                        raise
                yield out
        finally:
            self.store.delete(err_key)
            self._inflight.pop(request_id, None)
            self._stage_of.pop(request_id, None)
            self._aborted.discard(request_id)

    async def _remote_prefill(self, request_id, prompt, params, publish: bool):
        """Run the request's prompt on the entry stage's prefill stage.

        Returns the :class:`_Prefilled` result; None when the entry stage has no
        prefill stage, or prefills this request itself (a prompt given other than as
        token ids, such as one with multimodal data, or ``n > 1``); :data:`_ABORTED`
        when the request was aborted meanwhile.

        Raises:
            StageError: the prefill stage failed, or did not keep the KV cache.
        """
        if self.prefill is None:
            return None
        token_ids = prompt_token_ids_of(prompt)
        if token_ids is None or getattr(params, "n", 1) != 1:
            logger.info("request %s: prefilled by stage %d itself (%s)", request_id,
                        self.entry.stage_id, "n > 1" if token_ids else
                        "the prompt is not plain token ids")
            return None
        from vllm_omni_plugin.replicas.task import StageTask

        stage = self.prefill
        transfer_id = uuid.uuid4().hex
        task = StageTask(
            request_id=f"{request_id}-s{stage.stage_id}", prompt_token_ids=token_ids,
            sampling={"max_tokens": 1, "min_tokens": 0, "ignore_eos": True,
                      "temperature": 0.0, "extra_args": {
                          KV_TRANSFER_PARAMS: prefill_request_params(transfer_id)}},
            publish=publish)
        run = await self._run_task(request_id, stage, task)
        if run is None or request_id in self._aborted:
            return _ABORTED
        if run.finish_reason != "length" or not run.prefill_engine:
            raise StageError(stage.stage_id, stage.name, "the prefill engine did not keep "
                             f"the KV cache (finish reason {run.finish_reason!r}, engine "
                             f"{run.prefill_engine})")
        return _Prefilled(decode_request_params(transfer_id, run.prefill_engine), run.payload)

    def _check_kv_loaded(self, prefilled: _Prefilled | None, final) -> None:
        """Raise when the entry engine ended a prefilled request with finish reason
        ``error``: it could not load the prompt's KV cache (the prefill replica died or
        is unreachable, or the transfer outlasted the connector's timeout).

        Raises:
            StageError: names the prefill stage and engine.
        """
        if not prefilled or not final.outputs or final.outputs[0].finish_reason != "error":
            return
        engine = prefilled.decode_params
        raise StageError(
            self.prefill.stage_id, self.prefill.name,
            f"stage {self.entry.stage_id} ({self.entry.name}) could not load the prompt's "
            f"KV cache from prefill engine {engine.get('remote_engine_id')} "
            f"({engine.get('remote_bootstrap_addr')}); the decode engine's log says why",
            status=503)

    async def _run_downstream(self, request: OmniRequest, request_id, outputs, extra,
                              admission, feed: _EntryFeed | None = None
                              ) -> StageResult | None:
        """Run every downstream stage, giving its admission slot back as the
        request leaves it; None when the request was aborted meanwhile. A stage with
        ``streaming`` runs on chunks of its input stage's output while that stage runs,
        for a request the client streams (:attr:`OmniRequest.partials`). With ``feed``
        this starts while the entry stage runs: the stage with ``stream_input`` is fed
        from it, and a stage reading the entry stage's output otherwise waits for it."""

        last = None
        extras = {**extra, xargs.SPEAKER: request.voice, "hf_config": self.hf_config,
                  **request.options}
        for stage in self._downstream:
            if stage.stage_id in outputs:  # streamed, with its input stage
                admission.release(stage.stage_id)
                last = stage
                continue
            if feed is not None and stage is self._fed:
                def produce(on_rows, stage=stage):
                    return self._run_fed(request_id, stage, feed, extras, on_rows)
            else:
                if feed is not None and self.entry.stage_id in stage.inputs:
                    await feed.complete()
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
                    run = await self._run_streaming(request, request_id, stage, produce,
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

    async def _run_streaming(self, request: OmniRequest, request_id, stage, produce,
                             consumer, outputs, extras):
        """Run ``stage`` (``produce(on_rows)``: its run) and, while it runs, ``consumer``
        (its ``streaming`` stage) on each chunk of its output (sizes: see
        ``StreamingConfig``), each after up to ``left_context`` rows of context, one
        consumer task per chunk, in order; each chunk's output goes into
        :attr:`OmniRequest.partials`, and their rows joined into ``outputs`` as the
        consumer's. Returns ``stage``'s run; None when aborted.

        Raises:
            StageError: either stage failed (the other's task is stopped).
        """
        from vllm_omni_plugin.processors.hookspecs import StreamChunk, UpstreamOutput

        config = consumer.streaming
        stream_id = f"{request_id}-s{consumer.stage_id}"
        rows = _Rows()
        producer = asyncio.ensure_future(produce(rows))
        pieces: list[dict] = []
        start = previous = 0  # the next chunk's first row, the last chunk's rows
        try:
            while True:
                finished = producer.done()
                if finished:
                    run = producer.result()
                    if run is None:
                        return None
                    rows.replace(run.payload)  # a remote replica reports its rows here
                available = rows.count - start
                size = config.chunk_rows(previous)
                if available < size and not (finished and available > 0):
                    if finished:
                        break
                    rows.wanted = start + size
                    await rows.wait_for_more(producer)
                    continue
                # the first chunk stays small (time to first output); a later one takes
                # every row there is, so rows that came meanwhile share one left context
                end = start + (available if start else min(size, available))
                context = min(config.left_context, start)
                upstream = UpstreamOutput(
                    stage_id=stage.stage_id, prompt_token_ids=[], output_token_ids=[],
                    payload=rows.slice(start - context, end), context_rows=context,
                    chunk=StreamChunk(stream_id, start, finished and end == rows.count))
                chunk_input = self._stage_input(consumer, [upstream], extras)
                piece = await self._run_stage(request_id, consumer, chunk_input,
                                              part=len(pieces), parent=stream_id)
                if piece is None or request_id in self._aborted:
                    return None
                pieces.append(piece.payload)
                request.partials.put_nowait(piece.payload)
                start, previous = end, end - start
        finally:
            self.pools[consumer.stage_id].forget(stream_id)
            if not producer.done():
                producer.cancel()
                await asyncio.wait({producer})
        if pieces:
            outputs[consumer.stage_id] = UpstreamOutput(
                stage_id=consumer.stage_id, prompt_token_ids=[], output_token_ids=[],
                payload=_join_rows(*pieces))
        return run

    async def _run_stage(self, request_id, stage, stage_input, on_rows=None,
                         part: int | None = None, growth=None, parent: str | None = None):
        """Run ``stage`` for the request on one of its replicas; None when aborted.
        ``part``: the index of a chunk of a streamed request (its own sub-request);
        ``growth``: the rest of an input not complete yet (``StageTask.growth``);
        ``parent``: ``StageTask.parent_request_id``."""
        from vllm_omni_plugin.replicas.task import StageRun, StageTask

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

    async def _run_fed(self, request_id, stage, feed: _EntryFeed, extras, on_rows=None):
        """Run ``stage`` (``stream_input``) on the entry stage's output as it comes: once
        its input processor finds the output so far enough (``ready`` > 0, or the entry
        stage finished), the stage's request starts; each time it has generated what its
        input is ready for, the processor is called again on the newer output and the
        payload rows added since are appended. None when aborted.

        Raises:
            StageError: the processor or the stage failed.
        """
        from vllm_omni_plugin.replicas.task import InputGrowth

        upstream = await feed.next()
        first = self._stage_input(stage, [upstream], extras)
        while first.ready == 0:
            upstream = await feed.next()
            first = self._stage_input(stage, [upstream], extras)
        if first.ready is not None:
            logger.info("request %s: stage %d (%s) starts after %d tokens of stage %d, "
                        "fed the rest as they come", request_id, stage.stage_id, stage.name,
                        len(upstream.output_token_ids), upstream.stage_id)
        sent = {name: t.shape[0] for name, t in first.payload.items()}

        async def growth():
            ready = first.ready
            while ready is not None:
                more = self._stage_input(stage, [await feed.next()], extras)
                if more.ready is not None and more.ready <= ready:
                    continue
                rows = {name: t[sent.get(name, 0):] for name, t in more.payload.items()
                        if t.shape[0] > sent.get(name, 0)}
                sent.update((name, more.payload[name].shape[0]) for name in rows)
                ready = more.ready
                yield InputGrowth(rows, ready)

        return await self._run_stage(request_id, stage, first, on_rows,
                                     growth=None if first.ready is None else growth())

    async def _run_task(self, request_id, stage, task, on_rows=None):
        """Run ``task`` (a ``StageTask``) on one of ``stage``'s replicas; None when
        aborted. ``on_rows``: see ``StagePool.run``."""
        from vllm_omni_plugin.replicas.pool import NoReplicaAvailable, ReplicaFailed
        from vllm_omni_plugin.replicas.task import TaskAborted, TaskError

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


class _Prefilled:
    """A prompt prefilled on the prefill stage: the decode engine's ``kv_transfer_params``
    and the prompt's published rows (``{}`` when not published)."""

    def __init__(self, decode_params: dict, payload: dict) -> None:
        self.decode_params = decode_params
        self.payload = payload


#: :meth:`Orchestrator._remote_prefill`'s result for a request aborted meanwhile.
_ABORTED = object()


def _decode_extra(prefilled: _Prefilled | None) -> dict:
    return {KV_TRANSFER_PARAMS: prefilled.decode_params} if prefilled else {}


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


def _join_rows(*payloads: dict) -> dict:
    """Payloads published in parts, joined: a tensor in several is concatenated along dim 0,
    in order. With PD, the prefill stage's rows (the prompt's positions, and its
    once-per-request tensors) followed by the decode stage's (the generated positions); with
    streaming, a stage's chunks."""
    import torch

    joined: dict = {}
    for payload in payloads:
        for name, tensor in payload.items():
            joined[name] = torch.cat([joined[name], tensor]) if name in joined else tensor
    return joined


class _Rows:
    """The output rows a streamed stage's task has published so far (see
    :meth:`Orchestrator._run_streaming`); a ``replicas.task.RowsSink``."""

    def __init__(self) -> None:
        self._rows = GrowingPayload()
        self._whole: dict | None = None  # the task's whole payload, once it ended
        self.count = 0
        self.wanted = 0  # see replicas.task.RowsSink
        self._more = asyncio.Event()

    def add(self, chunks: list[dict]) -> None:
        self._rows.extend(chunks)
        self.count += _num_rows(chunks)
        self._more.set()

    def replace(self, payload: dict) -> None:
        """The task's whole payload, once it ended (the chunks so far are its first rows)."""
        self._whole, self.count = payload, _num_rows([payload])

    def slice(self, begin: int, end: int) -> dict:
        """Rows ``[begin, end)`` of every tensor."""
        rows = self._whole if self._whole is not None else self._rows.tensors()
        return {name: tensor[begin:end] for name, tensor in rows.items()}

    async def wait_for_more(self, task: asyncio.Future) -> None:
        """Until more rows come or ``task`` ends."""
        self._more.clear()
        waiter = asyncio.ensure_future(self._more.wait())
        try:
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()


class _EntryFeed:
    """The entry stage's output while it runs, for the stage fed from it (see
    :meth:`Orchestrator._run_fed`): its token ids from its outputs, its rows read from the
    payload store when the fed stage asks for more."""

    def __init__(self, store: PayloadStore, key: str, stage_id: int) -> None:
        self._store, self._key, self._stage_id = store, key, stage_id
        self._prompt: list[int] = []
        self._tokens: list[int] = []
        self._rows = GrowingPayload()
        self._chunks = 0  # chunks of ``key`` read into _rows
        self._final = None
        self._changed = asyncio.Event()
        self._finished = asyncio.Event()

    def update(self, prompt_token_ids, output_token_ids) -> None:
        """The entry stage's outputs so far (``output_token_ids`` may be a list that
        keeps growing)."""
        if prompt_token_ids and not self._prompt:
            self._prompt = list(prompt_token_ids)
        self._tokens = output_token_ids
        self._changed.set()

    def finish(self, output) -> None:
        """The entry stage's finished :class:`UpstreamOutput`."""
        self._final = output
        self._changed.set()
        self._finished.set()

    async def complete(self):
        """The finished output, once there."""
        await self._finished.wait()
        return self._final

    async def next(self):
        """The entry stage's output once it changed since the previous call: the
        finished one, or the output so far (``finished`` False)."""
        from vllm_omni_plugin.processors.hookspecs import UpstreamOutput

        await self._changed.wait()
        self._changed.clear()
        if self._final is not None:
            return self._final
        chunks = await asyncio.to_thread(self._store.chunks, self._key, self._chunks)
        if chunks:
            self._chunks += len(chunks)
            self._rows.extend(chunks)
        return UpstreamOutput(stage_id=self._stage_id, prompt_token_ids=list(self._prompt),
                              output_token_ids=list(self._tokens),
                              payload=self._rows.tensors(), finished=False)


def _num_rows(chunks: list[dict]) -> int:
    """Rows (dim 0) of payload chunks: each chunk's tensors share dim 0."""
    return sum(next(iter(c.values())).shape[0] for c in chunks if c)


def prompt_token_ids_of(prompt) -> list[int] | None:
    """The token ids of a prompt as vLLM's API server passes it to ``generate`` (a
    mapping with ``prompt_token_ids``, or an ``EngineCoreRequest``), or None when the
    prompt also carries multimodal data or embeddings, or has no token ids."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        other = prompt.get("type", "token") != "token" or any(
            prompt.get(k) for k in ("multi_modal_data", "mm_kwargs", "mm_placeholders",
                                    "prompt_embeds"))
    else:
        ids = getattr(prompt, "prompt_token_ids", None)
        other = bool(getattr(prompt, "mm_features", None)) or getattr(
            prompt, "prompt_embeds", None) is not None
    if other or not isinstance(ids, list) or not ids:
        return None
    return list(ids)


def _record_failure(request: OmniRequest, request_id: str, exc: StageError) -> None:
    """Log a failed request and hand its error to the API layer."""
    logger.error("request %s failed: %s", request_id, exc)
    request.result = StageResult.failure(str(exc), exc.status, exc.retry_after)


def _run_output(stage_id: int, run):
    """The :class:`UpstreamOutput` of a stage task's :class:`StageRun`."""
    from vllm_omni_plugin.processors.hookspecs import UpstreamOutput

    return UpstreamOutput(stage_id=stage_id, prompt_token_ids=run.prompt_token_ids,
                          output_token_ids=run.output_token_ids, payload=run.payload)


def _stage_output(stage_id: int, request_output, payload, generated: list[int] | None):
    """The entry stage's :class:`UpstreamOutput`; ``generated`` holds the output token ids
    gathered from every output of a streamed request (None: the final output has them)."""
    from vllm_omni_plugin.processors.hookspecs import UpstreamOutput

    if generated is None:
        generated = list(request_output.outputs[0].token_ids)
    return UpstreamOutput(
        stage_id=stage_id,
        prompt_token_ids=list(request_output.prompt_token_ids or []),
        output_token_ids=generated,
        payload=payload,
    )

