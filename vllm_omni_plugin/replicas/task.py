"""One stage task on one vLLM engine: the unit a replica runs.

Shared by the head's in-process replicas (:class:`~.replica.LocalReplica`) and
by headless replicas (:class:`~.server.ReplicaServer`): write the input
tensors to the replica's payload store, run the request on the stage's
``AsyncLLM``, read the output tensors back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.payload_store import PayloadError, PayloadStore, safe_key


@dataclass
class StageTask:
    """One request for one stage.

    Attributes:
        request_id: Sub-request id at this stage (unique per head).
        prompt_token_ids: Stage prompt.
        sampling: ``vllm.SamplingParams`` keyword arguments.
        payload: Input tensors (name -> tensor, any dtype/shape).
        parent_request_id: For a CFG companion, its parent's ``request_id``; for a chunk
            of a streamed request, its stream's id: tasks naming one parent are routed to
            one replica (the first one's).
        publish: Whether the engine publishes output tensors (False: the run's
            payload is empty, and only a failure is recorded).
        ready: for an input that is not complete yet, the output tokens it lets the
            stage generate in all; None when ``payload`` is the whole input.
        growth: for an input that is not complete yet, the rest of it, pulled as the
            stage needs it (see :class:`InputGrowth`); the last item has ``ready`` None.
        cache_salt: vLLM's ``cache_salt`` of the prompt (the client's): the engine's
            prefix cache serves it only blocks computed under the same salt.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    payload: dict[str, torch.Tensor] = field(default_factory=dict)
    parent_request_id: str | None = None
    publish: bool = True
    ready: int | None = None
    growth: AsyncIterator[InputGrowth] | None = None
    cache_salt: str | None = None


@dataclass
class InputGrowth:
    """More of a task's input: ``payload`` rows appended to its input payload (dim 0 of
    each tensor), after which the stage may have generated ``ready`` output tokens in all
    (None: the input is complete, only the sampling's ``max_tokens`` bounds it)."""

    payload: dict[str, torch.Tensor]
    ready: int | None


@dataclass
class StageRun:
    """What a stage produced for a task.

    Attributes:
        finish_reason: vLLM's finish reason of the request (``"length"``, ``"stop"``...).
        prefill_engine: on a prefill stage, where the decode engine pulls the prompt's KV
            cache from (``remote_engine_id``, ``remote_bootstrap_addr``); else None.
    """

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    payload: dict[str, torch.Tensor]
    finish_reason: str | None = None
    prefill_engine: dict[str, str] | None = None


class TaskError(RuntimeError):
    """The task failed on a healthy replica; ``status`` is the HTTP status (400/500)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class TaskAborted(RuntimeError):
    """The task was aborted (client disconnect or abort)."""


class ReplicaLost(RuntimeError):
    """The replica died or left while running the task.

    ``produced_output``: the engine had already produced output for the task,
    so it must not be run again elsewhere.
    """

    def __init__(self, message: str, produced_output: bool) -> None:
        super().__init__(message)
        self.produced_output = produced_output


def engine_is_dead(exc: BaseException) -> bool:
    """True when ``exc`` says the engine itself is gone (vLLM's ``EngineDeadError``)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


class RowsSink(Protocol):
    """Takes the output payload chunks a stage engine publishes for a task while it runs
    (each ``{name: tensor}``, rows on dim 0, in order; together they are the run's
    payload)."""

    #: Output tokens the task has to have before the next read is worth it (a stage
    #: publishes at most about one row per output token: the talker one frame per code 0).
    wanted: int

    def add(self, chunks: list[dict[str, torch.Tensor]]) -> None:
        """Take the chunks published since the previous call, in order (each
        ``{name: tensor}``, ``[rows, ...]`` CPU tensors in the dtypes the stage published,
        e.g. the talker's ``codes`` ``[k, 16]`` int64)."""


async def run_on_engine(engine, store: PayloadStore, task: StageTask,
                        on_progress: Callable[[int], None] | None = None,
                        aborted: Callable[[], bool] | None = None,
                        host: str = "127.0.0.1",
                        on_rows: RowsSink | None = None) -> StageRun:
    """Run ``task`` on ``engine`` (an ``AsyncLLM`` of the stage).

    ``on_progress(num_tokens)`` is called once, when the engine first reports
    output tokens for the task. ``aborted()`` is polled on every output: an
    abort that reached the replica before its engine knew the request stops
    it there. ``host``: the address other engines reach this one at (a prefill
    engine's bootstrap server, see :attr:`StageRun.prefill_engine`).
    ``on_rows``: gets the payload chunks the worker published since the previous read
    (the worker appends a step's rows before the engine reports the step), read after
    an engine output with at least ``on_rows.wanted`` output tokens, for a task that
    publishes.

    Raises:
        TaskError: bad sampling parameters, engine error or missing output.
        ReplicaLost: the engine died (``EngineDeadError``).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        params = SamplingParams(**task.sampling)
    except Exception as exc:
        raise TaskError(f"sampling params {task.sampling}: {exc}") from exc
    from vllm_omni_plugin.kv_transfer import prefill_engine_params

    base = safe_key(task.request_id)
    in_key, out_key = f"{base}.in", f"{base}.out"
    # a stage whose request is all in its prompt (code2wav) gets no input key
    keys = {"out": out_key} if task.publish else {"err": out_key}
    if task.payload:
        keys["in"] = in_key
    xargs.attach_payload(params, xargs.without_reserved(params.extra_args), keys)
    produced = False
    final = None
    seen = 0  # payload chunks handed to on_rows
    write = None  # the input's write, in a thread
    try:
        if task.payload:
            # shielded: a caller that goes away (a client that disconnected) must not leave
            # the write running past the clean-up below, which would delete the key before
            # the write creates it, leaving it in the store for good
            write = asyncio.ensure_future(asyncio.to_thread(store.put, in_key, task.payload))
            await asyncio.shield(write)
        store.create(out_key)
        if task.growth is not None:
            params.extra_args[xargs.PAYLOAD]["input_grows"] = True
            outputs = _fed(engine, store, in_key, task, params)
        else:
            prompt = TokensPrompt(prompt_token_ids=list(task.prompt_token_ids))
            if task.cache_salt is not None:
                prompt["cache_salt"] = task.cache_salt
            outputs = engine.generate(prompt, params, task.request_id)
        try:
            async with aclosing(outputs) as stream:
                async for out in stream:
                    final = out
                    if aborted is not None and aborted():
                        await engine.abort(task.request_id)
                        raise TaskAborted(task.request_id)
                    if not produced and out.outputs and len(out.outputs[0].token_ids):
                        produced = True
                        if on_progress is not None:
                            on_progress(len(out.outputs[0].token_ids))
                    if on_rows is not None and task.publish and out.outputs and len(
                            out.outputs[0].token_ids) >= on_rows.wanted:
                        chunks = await asyncio.to_thread(store.chunks, out_key, seen)
                        if chunks:
                            seen += len(chunks)
                            on_rows.add(chunks)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if engine_is_dead(exc):
                # vLLM's own message points at a stack trace in the server log,
                # which is no help to a client
                raise ReplicaLost("its engine core died", produced) from exc
            raise TaskError(f"{type(exc).__name__}: {exc}") from exc
        if final is None or not final.finished:
            raise TaskError("produced no final output")
        if task.publish:
            try:
                payload = await asyncio.to_thread(store.get, out_key)
            except PayloadError as exc:
                raise TaskError(str(exc)) from exc
        else:
            if (error := store.error(out_key)) is not None:
                raise TaskError(error)
            payload = {}
        return StageRun(prompt_token_ids=list(final.prompt_token_ids or []),
                        output_token_ids=list(final.outputs[0].token_ids), payload=payload,
                        finish_reason=final.outputs[0].finish_reason,
                        prefill_engine=prefill_engine_params(
                            getattr(engine, "vllm_config", None), host))
    finally:
        # shielded as the orchestrator's deletion: a second cancellation must not stop it
        await asyncio.shield(asyncio.ensure_future(_clean_up(store, (in_key, out_key), write)))


async def _fed(engine, store: PayloadStore, in_key: str, task: StageTask, params):
    """Run a task whose input grows as one resumable vLLM request fed by an async generator
    of ``StreamingInput`` chunks; yields its outputs with cumulative token ids and, after
    the input stream closes, the last one again as the final output.

    A chunk lets the request generate up to the tokens its input is ready for (see
    :class:`InputGrowth`); the request then pauses (vLLM's ``WAITING_FOR_STREAMING_REQ``)
    holding its KV cache. vLLM keeps only the tokens fed back, so the next chunk's prompt
    is the token sampled last, after the rows the chunk needs are appended to the input
    payload. A stop token or ``max_tokens`` in all ends the stream.
    """
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    limit = params.max_tokens
    params.output_kind = RequestOutputKind.DELTA
    tokens: list[int] = []
    chunk_ended = asyncio.Event()
    reason: list[str | None] = [None]

    def chunk(prompt_ids: list[int], ready: int | None):
        sampling = params.clone()
        sampling.max_tokens = (limit if ready is None else min(ready, limit)) - len(tokens)
        return StreamingInput(prompt=TokensPrompt(prompt_token_ids=prompt_ids),
                              sampling_params=sampling)

    async def inputs():
        ready = task.ready
        yield chunk(list(task.prompt_token_ids), ready)
        async with aclosing(task.growth) as growth:
            while True:
                await chunk_ended.wait()
                chunk_ended.clear()
                if reason[0] != "length" or len(tokens) >= limit:
                    return
                while ready is not None and ready <= len(tokens):
                    more = await anext(growth, None)
                    if more is None:
                        ready = None
                        break
                    if more.payload:
                        await asyncio.to_thread(store.append, in_key, more.payload)
                    ready = more.ready
                yield chunk([tokens[-1]], ready)

    last = None
    async with aclosing(engine.generate(inputs(), params, task.request_id)) as stream:
        async for out in stream:
            if out.outputs:
                completion = out.outputs[0]
                tokens.extend(completion.token_ids)
                completion.token_ids = list(tokens)
                if completion.finish_reason is not None:
                    reason[0] = completion.finish_reason
                    chunk_ended.set()
            out.finished = False
            last = out
            yield out
    if last is not None:
        last.finished = True
        yield last


async def _clean_up(store: PayloadStore, keys, write: asyncio.Future | None) -> None:
    """Delete ``keys`` once ``write`` (the task's input being written, or None) ended."""
    if write is not None:
        await asyncio.wait({write})
        if not write.cancelled():
            write.exception()  # (raised to the task already, unless it was cancelled)
    await asyncio.to_thread(_delete, store, keys)


def _delete(store: PayloadStore, keys) -> None:
    for key in keys:
        store.delete(key)
