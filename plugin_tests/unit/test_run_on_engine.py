"""One stage task on an engine (``replicas.task.run_on_engine``) with a scripted engine
that publishes into a real :class:`PayloadStore` the way the worker does (a step's rows
appended before the step's output is reported); real engines are in
``plugin_tests/engine/`` and the ``*_serve.py`` tests."""

from __future__ import annotations

import asyncio
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
