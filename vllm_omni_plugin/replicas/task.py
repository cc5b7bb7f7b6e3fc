"""One stage task on one vLLM engine: the unit a replica runs.

Shared by the head's in-process replicas (:class:`~.local.LocalReplica`) and
by headless replicas (:class:`~.server.ReplicaServer`): write the input
tensors to the replica's payload store, run the request on the stage's
``AsyncLLM``, read the output tensors back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
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
        parent_request_id: For a CFG companion, its parent's ``request_id``:
            the companion is routed to the parent's replica.
        publish: Whether the engine publishes output tensors (False: the run's
            payload is empty, and only a failure is recorded).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    payload: dict[str, torch.Tensor] = field(default_factory=dict)
    parent_request_id: str | None = None
    publish: bool = True


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

    def add(self, chunks: list[dict[str, torch.Tensor]]) -> None: ...


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
    params.extra_args = {**xargs.without_reserved(params.extra_args), xargs.PAYLOAD: keys}
    produced = False
    final = None
    seen = 0  # payload chunks handed to on_rows
    try:
        if task.payload:
            await asyncio.to_thread(store.put, in_key, task.payload)
        store.create(out_key)
        prompt = TokensPrompt(prompt_token_ids=list(task.prompt_token_ids))
        try:
            async with aclosing(engine.generate(prompt, params, task.request_id)) as stream:
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
        await asyncio.to_thread(_delete, store, (in_key, out_key))


def _delete(store: PayloadStore, keys) -> None:
    for key in keys:
        store.delete(key)
