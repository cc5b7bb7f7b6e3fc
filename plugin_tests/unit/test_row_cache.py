"""The row cache (``worker/row_cache.py``): which KV blocks' rows are held, updated from
scripted ``SchedulerOutput``s shaped like vLLM's, and the rows a prefix-cache hit gets in
the worker's payloads (``worker/stage_io.py``). The scheduler's cut of a hit and the
rows against a cold run are checked on real engines
(``engine/test_pipeline_engine.py::test_spoken_answers_read_the_prefix_cache``)."""

from __future__ import annotations

from types import SimpleNamespace

from plugin_tests.helpers import RowsModel
from vllm_omni_plugin.extra_args import PAYLOAD
from vllm_omni_plugin.worker.row_cache import RowBlockIndex, RowCache, publishes_rows
from vllm_omni_plugin.worker.stage_io import StageIO

SIZE = 4  # tokens per KV block


def _params(out: str | None = None, prefilled: bool = False):
    keys = {} if out is None else {"out": out, "err": out + ".err",
                                   **({"prefilled": True} if prefilled else {})}
    return SimpleNamespace(extra_args={PAYLOAD: keys} if keys else None,
                           all_stop_token_ids={7})


def _new(req_id, blocks, computed=0, out=None, prompt_len=10):
    return SimpleNamespace(req_id=req_id, sampling_params=_params(out), block_ids=(blocks,),
                           num_computed_tokens=computed, prompt_token_ids=[1] * prompt_len)


def _step(new=(), cached=(), scheduled=None, finished=(), preempted=(), resumed=()):
    """``cached``: ``[(req_id, num_computed, new block ids or None), ...]``."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new), finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], num_computed_tokens=[c for _, c, _ in cached],
            new_block_ids=[None if b is None else (b,) for _, _, b in cached],
            resumed_req_ids=set(resumed)),
        num_scheduled_tokens=dict(scheduled or {}),
        total_num_scheduled_tokens=sum((scheduled or {}).values()))


def test_only_requests_that_publish_their_own_rows_count():
    assert publishes_rows(_params("k"))
    assert not publishes_rows(_params())
    assert not publishes_rows(_params("k", prefilled=True))  # its prompt was computed elsewhere
    assert not publishes_rows(SimpleNamespace(extra_args={PAYLOAD: "bad"}))


def test_blocks_a_publishing_request_fills_are_held_until_allocated_anew():
    index = RowBlockIndex(SIZE, max_blocks=10)
    # a 10-token prompt over blocks 1, 2, 3: two full blocks after its prefill
    step = index.update(_step(new=[_new("a", [1, 2, 3], out="ka")], scheduled={"a": 10}))
    assert step.filled == [("a", 0, 1), ("a", 1, 2)] and list(index.held) == [1, 2]
    # decode: position 10, then 11 fills block 3
    assert index.update(_step(cached=[("a", 10, None)], scheduled={"a": 1})).filled == []
    step = index.update(_step(cached=[("a", 11, None)], scheduled={"a": 1}))
    assert step.filled == [("a", 2, 3)]
    # a text request fills nothing; the blocks it is given anew lose their rows
    step = index.update(_step(new=[_new("t", [2, 9])], finished={"a"}, scheduled={"t": 8}))
    assert step.dropped == [2] and list(index.held) == [1, 3] and step.filled == []
    # a publishing request hitting block 1 (4 tokens) gets it; 5 and 6 are its own
    step = index.update(_step(new=[_new("b", [1, 5, 6], computed=4, out="kb")],
                              scheduled={"b": 6}))
    assert step.hits == {"b": [1]} and step.filled == [("b", 1, 5)]
    assert index.held_prefix([1, 3, 2]) == 2 and index.held_prefix([2, 1]) == 0


def test_the_least_recently_used_block_goes_first_past_the_limit():
    index = RowBlockIndex(SIZE, max_blocks=2)
    index.update(_step(new=[_new("a", [1, 2], out="ka")], scheduled={"a": 8}))
    index.update(_step(new=[_new("b", [1, 5], computed=4, out="kb")], scheduled={"b": 4}))
    # b's hit made block 1 the most recently used: 2 went when 5 came in
    assert list(index.held) == [1, 5]
    step = index.update(_step(new=[_new("c", [6], out="kc")], scheduled={"c": 4}))
    assert step.dropped == [1] and list(index.held) == [5, 6]


def test_a_preempted_request_fills_its_new_blocks_once_resumed():
    index = RowBlockIndex(SIZE, max_blocks=10)
    index.update(_step(new=[_new("a", [1, 2, 3], out="ka")], scheduled={"a": 6}))
    assert list(index.held) == [1]
    index.update(_step(preempted={"a"}))
    # resumed: block 1 hit again, 7 and 8 its new blocks, 8 tokens computed again
    step = index.update(_step(cached=[("a", 4, [1, 7, 8])], resumed={"a"},
                              scheduled={"a": 8}))
    assert step.hits == {"a": [1]} and step.filled == [("a", 1, 7), ("a", 2, 8)]


def _io(store, max_blocks=10) -> StageIO:
    io = StageIO(0, store)
    io.rows = RowCache(RowBlockIndex(SIZE, max_blocks))
    return io


def _step_of(io, model, step, order, *positions):
    assert io.begin_step(step)
    model.forward(*positions)
    io.publish(model, order, step)


def test_a_hit_publishes_the_rows_the_request_that_filled_the_blocks_computed(store):
    """Request ``a`` computes 10 positions (two full blocks); ``b`` hits both and computes
    2 more: its payload holds ``a``'s rows of positions 0-7, then its own, with the
    ``tts_embed`` once; the worker keeps the rows of ``a``'s blocks only."""
    io, model = _io(store), RowsModel()
    for key in ("ka", "kb"):
        store.create(key)
    _step_of(io, model, _step(new=[_new("a", [1, 2, 3], out="ka")], scheduled={"a": 10}),
             ["a"], range(10))
    assert io.rows.bytes == 8 * 4
    model_b = RowsModel()
    step = _step(new=[_new("b", [1, 2, 4], computed=8, out="kb")],
                 cached=[("a", 10, None)], scheduled={"a": 1, "b": 2})
    assert io.begin_step(step)
    model_b.forward(range(100, 101), range(200, 202))  # a at 100, b's own rows at 200
    io.publish(model_b, ["a", "b"], step)
    got = store.get("kb")
    assert got["embed"].flatten().tolist() == [*range(8), 200, 201]
    assert got["tts_embed"].shape == (3, 1)
    assert not io.tracked("b").failed


def test_the_worker_holds_the_rows_of_the_blocks_the_index_holds_only(store):
    """A limit of one block: of the two blocks a request fills in one step, the index
    keeps the second, and the worker stores that one's rows only."""
    io, model = _io(store, max_blocks=1), RowsModel()
    store.create("ka")
    _step_of(io, model, _step(new=[_new("a", [1, 2, 3], out="ka")], scheduled={"a": 8}),
             ["a"], range(8))
    assert list(io.rows.index.held) == [2] and list(io.rows._blocks) == [2]
    assert io.rows._blocks[2]["embed"].flatten().tolist() == [4, 5, 6, 7]
    assert io.rows.bytes == 4 * 4


def test_a_block_filled_over_decode_steps_gets_the_rows_of_each(store):
    """A 6-token prompt fills block 1 and leaves positions 4-5 waiting; two decode steps
    (positions 6, 7) fill block 2 with the rows of all three steps, in order."""
    io, model = _io(store), RowsModel()
    store.create("ka")
    _step_of(io, model, _step(new=[_new("a", [1, 2], out="ka")], scheduled={"a": 6}),
             ["a"], range(6))
    for position in (6, 7):
        _step_of(io, model, _step(cached=[("a", position, None)], scheduled={"a": 1}),
                 ["a"], range(position, position + 1))
    assert io.rows._blocks[2]["embed"].flatten().tolist() == [4, 5, 6, 7]
    assert store.get("ka")["embed"].flatten().tolist() == list(range(8))


def test_a_hit_on_blocks_the_worker_lacks_fails_that_request_only(store, caplog):
    """The scheduler's index and the worker's out of step (a bug): the request that hit
    fails with an error naming the blocks; the others go on."""
    io, model = _io(store), RowsModel()
    for key in ("ka", "kb"):
        store.create(key)
    _step_of(io, model, _step(new=[_new("a", [1, 2], out="ka")], scheduled={"a": 8}),
             ["a"], range(8))
    io.rows._blocks.clear()  # the fault: rows the index says are held are gone
    step = _step(new=[_new("b", [1, 5], computed=4, out="kb")], scheduled={"b": 4})
    io.begin_step(step)
    assert io.tracked("b").failed
    assert "hit KV blocks [1] whose rows this worker does not hold" in caplog.text


def test_row_cache_size_follows_the_settings_prefix_caching_and_the_kv_role():
    """Blocks of rows the row cache holds: the settings' bytes over one block's rows; none
    outside omni mode, with prefix caching off or on a PD decode engine (a KV consumer: its
    prompts' KV and rows come from the prefill stage), which a prefill engine (a KV
    producer) is not."""
    from vllm_omni_plugin.config.settings import OmniSettings
    from vllm_omni_plugin.worker.row_cache import row_cache_blocks

    class Model:
        @staticmethod
        def payload_bytes_per_position(model_config):
            return 1024

    def config(caching=True, role=None, row_cache_bytes=1 << 20, omni=True):
        settings = OmniSettings(stage_configs_path="p.yaml", stage_id=0,
                                row_cache_bytes=row_cache_bytes)
        transfer = None if role is None else SimpleNamespace(
            is_kv_consumer=role == "kv_consumer", is_kv_producer=role == "kv_producer")
        return SimpleNamespace(
            additional_config=settings.additional_config() if omni else {},
            cache_config=SimpleNamespace(enable_prefix_caching=caching, block_size=16),
            kv_transfer_config=transfer, model_config=None)

    assert row_cache_blocks(config(), Model) == (1 << 20) // (16 * 1024)
    assert row_cache_blocks(config(role="kv_producer"), Model) == 64
    assert row_cache_blocks(config(role="kv_consumer"), Model) == 0
    assert row_cache_blocks(config(caching=False), Model) == 0
    assert row_cache_blocks(config(omni=False), Model) == 0
    assert row_cache_blocks(config(row_cache_bytes=0), Model) == 0
    assert row_cache_blocks(config(), object) == 0  # a model that publishes no rows


def test_the_metrics_sum_a_stages_row_caches_and_skip_engines_without_one(monkeypatch):
    """:class:`RowCacheWatch` over scripted engines (a fake: the watch's bookkeeping is
    under test; real engines' counts reach ``/metrics`` in ``e2e/test_e2e_serve.py`` and
    ``e2e/test_pd_serve.py``): two engines of stage 3 with a row cache (on their second
    worker, as a TP rank that publishes) summed into stage 3's samples, and an engine
    without one, read once and then no more."""
    import asyncio

    from vllm_omni_plugin.replicas import metrics

    class Engine:
        def __init__(self, stats):
            self.stats, self.calls = stats, 0

        async def collective_rpc(self, method):
            assert method == "omni_row_cache_stats"
            self.calls += 1
            return [None, self.stats]

    first = Engine({"blocks": 2, "max_blocks": 8, "bytes": 10, "hit_blocks": 1})
    second = Engine({"blocks": 3, "max_blocks": 8, "bytes": 20, "hit_blocks": 0})
    without = Engine(None)
    monkeypatch.setattr(metrics, "ROW_CACHE_POLL_S", 0.01)  # the reads' period and bound
    watch = metrics.RowCacheWatch([(3, lambda: first), (0, lambda: without),
                                   (3, lambda: second)])

    async def three_rounds():
        watch.start()
        while second.calls < 3:
            await asyncio.sleep(0.01)  # the poll's turn
        watch.stop()

    asyncio.run(asyncio.wait_for(three_rounds(), timeout=5))
    assert without.calls == 1
    assert watch.per_stage() == {3: {"blocks": 5, "max_blocks": 16, "bytes": 30,
                                     "hit_blocks": 1}}
    samples = {(family.name, sample.labels["stage"]): sample.value
               for family in metrics.PoolCollector({}, row_cache=watch).collect()
               for sample in family.samples if family.name.startswith("vllm_omni:row_cache")}
    assert samples == {("vllm_omni:row_cache_blocks", "3"): 5,
                       ("vllm_omni:row_cache_bytes", "3"): 30,
                       ("vllm_omni:row_cache_hit_blocks", "3"): 1}
