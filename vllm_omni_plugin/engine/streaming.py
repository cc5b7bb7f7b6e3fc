r"""Stage-to-stage streaming: stages that run before their input stage has finished.

For a request the client streams (:attr:`OmniRequest.partials` is a queue), two stage
fields let a stage start early; each has one set of words, used throughout the plugin:

**Streaming input** (stage field ``stream_input``; vLLM's term: a resumable request fed
``StreamingInput`` chunks). The stage (Qwen3-Omni's talker) starts while the entry stage
still generates, as one resumable vLLM request.

- The *input stream* (:class:`InputStream`) is the entry stage's output as it grows:
  its token ids from the entry stage's ``RequestOutput``\ s, its rows from the payload
  store.
- The stage's input processor is called on each newer output; its ``StageInput.ready``
  says how many tokens the stage may generate on the input so far (None: all).
- Each *growth* (``replicas.task.InputGrowth``) is the rows added since, with the new
  ``ready``. On the engine it becomes one ``StreamingInput`` chunk whose
  ``max_tokens`` stops at ``ready`` (``replicas.task``), and the worker appends its
  rows to the request's input payload (the payload flag ``input_grows``).

**Chunked output** (stage field ``streaming``, a ``StreamingConfig``; upstream
vllm-omni's ``async_chunk``). The stage (code2wav) runs once per chunk of its input
stage's output rows while that stage (the talker) still generates.

- The rows the input stage has published so far are its *output rows*
  (:class:`OutputRows`, handed to the replica as ``on_rows``: a
  ``replicas.task.RowsSink``).
- Each chunk is one task of the stage. Its input is a ``StreamChunk`` (the stream's
  id, its first row, whether it is the last) with ``context_rows`` rows of left
  context before it.
- Each chunk's output goes to the API layer (:attr:`OmniRequest.partials`), and all of
  them, joined, are the stage's output.

:class:`StageStreams` runs both for the
:class:`~vllm_omni_plugin.engine.orchestrator.Orchestrator`.
"""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from vllm_omni_plugin.engine.pipeline_run import PipelineRun
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import GrowingPayload, PayloadStore
from vllm_omni_plugin.processors.hookspecs import StreamChunk, UpstreamOutput
from vllm_omni_plugin.replicas.task import InputGrowth

logger = init_logger(__name__)


class StageStreams:
    """Runs stages on streaming input and on chunked output for the orchestrator.

    Args:
        stage_input: ``(stage, upstream outputs, StageRequest)`` -> the stage's
            ``StageInput`` (its input processor; raises ``StageError``).
        run_stage: ``(PipelineRun, stage, stage_input, on_rows=, part=, growth=,
            parent=)`` -> the stage's ``StageRun``, None when aborted (raises
            ``StageError``).
        pools: stage id -> ``StagePool`` (a finished stream's affinity is forgotten).
    """

    def __init__(self, stage_input, run_stage, pools: dict) -> None:
        self._stage_input = stage_input
        self._run_stage = run_stage
        self._pools = pools

    async def run_chunked(self, run: PipelineRun, stage, produce, consumer, outputs,
                          stage_request):
        """Run ``stage`` (``produce(on_rows)``: its run) and, while it runs, ``consumer``
        (its ``streaming`` stage) on each chunk of its output (sizes: see
        ``StreamingConfig``), each after up to ``left_context`` rows of context, one
        consumer task per chunk, in order; each chunk's output goes into
        ``run.request.partials``, and their rows joined into ``outputs`` as the
        consumer's. Returns ``stage``'s run; None when aborted.

        Raises:
            StageError: either stage failed (the other's task is stopped).
        """
        config = consumer.streaming
        stream_id = f"{run.request_id}-s{consumer.stage_id}"
        rows = OutputRows()
        producer = asyncio.ensure_future(produce(rows))
        pieces: list[dict] = []
        start = previous = 0  # the next chunk's first row, the last chunk's rows
        try:
            while True:
                finished = producer.done()
                if finished:
                    stage_run = producer.result()
                    if stage_run is None:
                        return None
                    rows.replace(stage_run.payload)  # a remote replica reports its rows here
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
                chunk_input = self._stage_input(consumer, [upstream], stage_request)
                piece = await self._run_stage(run, consumer, chunk_input, part=len(pieces),
                                              parent=stream_id)
                if piece is None or run.aborted:
                    return None
                pieces.append(piece.payload)
                run.request.partials.put_nowait(piece.payload)
                start, previous = end, end - start
        finally:
            self._pools[consumer.stage_id].forget(stream_id)
            if not producer.done():
                producer.cancel()
                await asyncio.wait({producer})
        if pieces:
            outputs[consumer.stage_id] = UpstreamOutput(
                stage_id=consumer.stage_id, prompt_token_ids=[], output_token_ids=[],
                payload=join_rows(*pieces))
        return stage_run

    async def run_streaming_input(self, run: PipelineRun, stage, stream: InputStream,
                                  stage_request, on_rows=None):
        """Run ``stage`` (``stream_input``) on its input stream: once its input processor
        finds the output so far enough (``ready`` > 0, or the entry stage finished), the
        stage's request starts; each time it has generated what its input is ready for,
        the processor is called again on the newer output and the payload rows added
        since are appended. None when aborted.

        Raises:
            StageError: the processor or the stage failed.
        """
        upstream = await stream.next()
        first = self._stage_input(stage, [upstream], stage_request)
        while first.ready == 0:
            upstream = await stream.next()
            first = self._stage_input(stage, [upstream], stage_request)
        if first.ready is not None:
            logger.info("request %s: stage %d (%s) starts after %d tokens of stage %d, "
                        "fed the rest as they come", run.request_id, stage.stage_id, stage.name,
                        len(upstream.output_token_ids), upstream.stage_id)
        sent = {name: t.shape[0] for name, t in first.payload.items()}

        async def growth():
            ready = first.ready
            while ready is not None:
                more = self._stage_input(stage, [await stream.next()], stage_request)
                if more.ready is not None and more.ready <= ready:
                    continue
                rows = {name: t[sent.get(name, 0):] for name, t in more.payload.items()
                        if t.shape[0] > sent.get(name, 0)}
                sent.update((name, more.payload[name].shape[0]) for name in rows)
                ready = more.ready
                yield InputGrowth(rows, ready)

        return await self._run_stage(run, stage, first, on_rows,
                                     growth=None if first.ready is None else growth())


def join_rows(*payloads: dict) -> dict:
    """Payloads published in parts, joined: a tensor in several is concatenated along dim 0,
    in order. With PD, the prefill stage's rows (the prompt's positions, and its
    once-per-request tensors) followed by the decode stage's (the generated positions); with
    chunked output, a stage's chunks."""
    joined: dict = {}
    for payload in payloads:
        for name, tensor in payload.items():
            joined[name] = torch.cat([joined[name], tensor]) if name in joined else tensor
    return joined


def num_rows(chunks: list[dict]) -> int:
    """Rows (dim 0) of payload chunks: each chunk's tensors share dim 0."""
    return sum(next(iter(c.values())).shape[0] for c in chunks if c)


class OutputRows:
    """The output rows a stage's task has published so far, for its chunked-output
    consumer (see :meth:`StageStreams.run_chunked`); a ``replicas.task.RowsSink``."""

    def __init__(self) -> None:
        self._rows = GrowingPayload()
        self._whole: dict | None = None  # the task's whole payload, once it ended
        self.count = 0
        self.wanted = 0  # see replicas.task.RowsSink
        self._more = asyncio.Event()

    def add(self, chunks: list[dict]) -> None:
        """Append published payload chunks (each ``{name: tensor}``, rows on dim 0, in order)
        and wake :meth:`wait_for_more`."""
        self._rows.extend(chunks)
        self.count += num_rows(chunks)
        self._more.set()

    def replace(self, payload: dict) -> None:
        """The task's whole payload, once it ended (the chunks so far are its first rows)."""
        self._whole, self.count = payload, num_rows([payload])

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


class InputStream:
    """The entry stage's output while it runs, for the stage with streaming input (see
    :meth:`StageStreams.run_streaming_input`): its token ids from its outputs, its rows
    read from the payload store when the stage asks for more."""

    def __init__(self, store: PayloadStore, key: str, stage_id: int) -> None:
        self._store, self._key, self._stage_id = store, key, stage_id
        self._prompt: list[int] = []
        self._tokens: list[int] = []
        self._rows = GrowingPayload()
        self._chunks = 0  # chunks of ``key`` read into _rows
        self._final = None
        self._changed = asyncio.Event()
        self._finished = asyncio.Event()
        #: the processor's state between calls (``UpstreamOutput.state``)
        self._state: dict = {}

    def update(self, prompt_token_ids, output_token_ids) -> None:
        """The entry stage's outputs so far (``output_token_ids`` may be a list that
        keeps growing)."""
        if prompt_token_ids and not self._prompt:
            self._prompt = list(prompt_token_ids)  # then never changed: handed out as is
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
        finished one, or the output so far (``finished`` False); each with the stream's
        one ``state`` dict. The prompt's id list is the same at every call (not to be
        changed), so that a call costs what the output added."""
        await self._changed.wait()
        self._changed.clear()
        if self._final is not None:
            return dataclasses.replace(self._final, state=self._state)
        chunks = await asyncio.to_thread(self._store.chunks, self._key, self._chunks)
        if chunks:
            self._chunks += len(chunks)
            self._rows.extend(chunks)
        return UpstreamOutput(stage_id=self._stage_id, prompt_token_ids=self._prompt,
                              output_token_ids=list(self._tokens),
                              payload=self._rows.tensors(), finished=False,
                              state=self._state)
