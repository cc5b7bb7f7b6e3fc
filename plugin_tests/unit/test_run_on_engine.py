"""One stage task on an engine (``replicas.task.run_on_engine``) with a scripted engine
that publishes into a real :class:`PayloadStore` the way the worker does (a step's rows
appended before the step's output is reported); real engines are in
``plugin_tests/engine/`` and the ``*_serve.py`` tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import torch

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.payload_store import PayloadStore
from vllm_omni_plugin.replicas.task import StageTask, run_on_engine

STEPS = 6


class FrameEngine:
    """Each step publishes one row (``codes`` ``[[step]]``) for the step before it, as the
    talker does (no row for the first code 0), then reports the step's token."""

    def __init__(self, store: PayloadStore) -> None:
        self.store = store

    async def generate(self, prompt, params, request_id):
        # its rows map one to one to the positions it feeds: no prefix-cache read
        assert params.skip_reading_prefix_cache
        out_key = xargs.payload_keys(params.extra_args).output
        for step in range(STEPS):
            if step:
                self.store.append(out_key, {"codes": torch.tensor([[step - 1]])})
            await asyncio.sleep(0)
            completion = SimpleNamespace(token_ids=list(range(step + 1)),
                                         finish_reason="stop" if step == STEPS - 1 else None)
            yield SimpleNamespace(finished=step == STEPS - 1, prompt_token_ids=[1],
                                  outputs=[completion])

    async def abort(self, request_id):
        raise AssertionError("not aborted in these tests")


class Sink:
    """Records each delivery: the task's output tokens then, and the rows delivered."""

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.rows: list[int] = []
        self.deliveries: list[list[int]] = []

    def add(self, chunks):
        rows = [int(r) for c in chunks for r in c["codes"][:, 0]]
        self.deliveries.append(rows)
        self.rows.extend(rows)


def _run(tmp_path, sink: Sink):
    store = PayloadStore(str(tmp_path / "run"))
    task = StageTask(request_id="r-1", prompt_token_ids=[1], sampling={"max_tokens": STEPS})
    return asyncio.run(run_on_engine(FrameEngine(store), store, task, on_rows=sink)), store


def test_rows_reach_the_sink_in_order_once_it_wants_them(tmp_path):
    sink = Sink(wanted=4)
    run, store = _run(tmp_path, sink)
    # nothing is read before the 4th output token; each row is delivered once, in order
    assert sink.deliveries == [[0, 1, 2], [3], [4]]
    assert run.payload["codes"][:, 0].tolist() == sink.rows == list(range(STEPS - 1))
    assert store.keys() == []


def test_a_sink_wanting_more_tokens_than_made_gets_nothing_and_the_run_all_rows(tmp_path):
    sink = Sink(wanted=STEPS + 1)  # more tokens than the task makes
    run, _ = _run(tmp_path, sink)
    assert sink.deliveries == []
    assert run.payload["codes"][:, 0].tolist() == list(range(STEPS - 1))


# -- a task whose input grows: one resumable request fed in chunks -----------------------
class SessionEngine:
    """Runs a request fed by an async generator of ``StreamingInput`` as vLLM does: each
    chunk generates its ``max_tokens`` tokens (100, 101, ... over the whole request; one
    equal to ``stop_at`` stops it), reported as deltas, the chunk's last with a finish
    reason but not finished. Records each chunk's prompt ids, ``max_tokens`` and the input
    rows in the store when it started."""

    def __init__(self, store: PayloadStore, stop_at: int | None = None) -> None:
        self.store = store
        self.stop_at = stop_at
        self.chunks: list[tuple[list[int], int, list[int]]] = []

    async def generate(self, inputs, params, request_id):
        in_key = xargs.payload_keys(params.extra_args).input
        assert xargs.payload_keys(params.extra_args).input_grows
        count = 0
        async for chunk in inputs:
            limit = chunk.sampling_params.max_tokens
            rows = self.store.get(in_key)["rows"][:, 0].tolist()
            self.chunks.append((list(chunk.prompt["prompt_token_ids"]), limit, rows))
            for k in range(limit):
                token = 100 + count
                count += 1
                stop = token == self.stop_at
                reason = "stop" if stop else "length" if k == limit - 1 else None
                yield SimpleNamespace(finished=False, prompt_token_ids=[1], outputs=[
                    SimpleNamespace(token_ids=[token], finish_reason=reason)])
                if stop:
                    break

    async def abort(self, request_id):
        raise AssertionError("not aborted in these tests")


def growing_task(readies):
    from vllm_omni_plugin.replicas.task import InputGrowth

    async def growth():
        for i, ready in enumerate(readies):
            yield InputGrowth({"rows": torch.tensor([[10 + i]])}, ready)

    return StageTask(request_id="r-2", prompt_token_ids=[1, 2], sampling={"max_tokens": 6},
                     payload={"rows": torch.tensor([[0]])}, ready=1, growth=growth())


def test_a_growing_input_feeds_one_request_chunk_by_chunk(tmp_path):
    store = PayloadStore(str(tmp_path / "run"))
    engine = SessionEngine(store)
    run = asyncio.run(run_on_engine(engine, store, growing_task([3, None])))
    # each chunk: the token sampled last fed back first, as many new tokens as the input
    # is ready for (max_tokens in all at the end), its rows appended before it starts
    assert engine.chunks == [([1, 2], 1, [0]), ([100], 2, [0, 10]), ([102], 3, [0, 10, 11])]
    assert run.output_token_ids == list(range(100, 106)) and run.finish_reason == "length"
    assert store.keys() == []


def test_a_stop_token_ends_a_growing_request_without_more_input(tmp_path):
    store = PayloadStore(str(tmp_path / "run"))
    engine = SessionEngine(store, stop_at=101)
    run = asyncio.run(run_on_engine(engine, store, growing_task([3, 5, None])))
    assert [c[:2] for c in engine.chunks] == [([1, 2], 1), ([100], 2)]
    assert run.output_token_ids == [100, 101] and run.finish_reason == "stop"


# -- cancelled while its input is being written ------------------------------------------
class SlowPutStore(PayloadStore):
    """A store whose ``put`` (run in a thread) takes a while to start writing, so that a
    task cancelled meanwhile (a client that went away) has its clean-up run first."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.putting = threading.Event()

    def put(self, key, tensors):
        self.putting.set()
        time.sleep(0.3)
        super().put(key, tensors)


def test_a_task_cancelled_while_its_input_is_written_leaves_no_payload(tmp_path):
    """A task cancelled while its input payload is written in a thread: the clean-up
    deletes the input after the write ends, not before (a key written after its deletion
    stays in the store for good: the soak saw payload files left after the load)."""
    store = SlowPutStore(str(tmp_path / "run"))
    task = StageTask(request_id="r-3", prompt_token_ids=[1], sampling={"max_tokens": 2},
                     payload={"rows": torch.tensor([[0]])})

    async def main():
        running = asyncio.ensure_future(run_on_engine(FrameEngine(store), store, task))
        await asyncio.to_thread(store.putting.wait, 5)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running

    asyncio.run(main())  # (its end waits for the write's thread)
    assert store.keys() == []
