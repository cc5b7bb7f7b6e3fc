"""The stage payload channel of the plugin's worker, with scripted scheduler outputs.

``worker/stage_io.py``, ``compat/model_runner.py`` and the worker's graph-mode check
against fakes shaped like vLLM's ``SchedulerOutput`` and model runners; the engine tests
run the real ones.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from plugin_tests.helpers import RowsModel
from vllm_omni_plugin.compat.model_runner import batch_req_ids, watch_step
from vllm_omni_plugin.extra_args import PAYLOAD
from vllm_omni_plugin.worker.omni_worker import check_graph_mode
from vllm_omni_plugin.worker.stage_io import ScheduledRequest, StageIO, StageStep, keep_rows


def _params(extra=None, stop=(7,)):
    return SimpleNamespace(extra_args=extra, all_stop_token_ids=set(stop))


def _new(req_id, extra=None, computed=0, prompt_len=4):
    return SimpleNamespace(req_id=req_id, sampling_params=_params(extra),
                           num_computed_tokens=computed, prompt_token_ids=[1] * prompt_len)


def _step(new=(), cached=(), scheduled=None, finished=()):
    """A SchedulerOutput: ``cached`` is ``[(req_id, num_computed), ...]``."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new), finished_req_ids=set(finished),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=dict(scheduled or {}),
        total_num_scheduled_tokens=sum((scheduled or {}).values()))


def _out(store, key):
    store.create(key)
    return {PAYLOAD: {"out": key, "err": key + ".err"}}


def test_rows_follow_the_runner_order_and_skip_plain_requests(store):
    io, model = StageIO(0, store), RowsModel()
    step = _step(new=[_new("a", _out(store, "ka")), _new("plain"), _new("b", _out(store, "kb"))],
                 scheduled={"a": 3, "plain": 2, "b": 4})
    assert io.begin_step(step)
    model.forward(range(9))
    io.publish(model, ["b", "plain", "a"], step)  # the runner's row order
    assert store.get("kb")["embed"].flatten().tolist() == [0, 1, 2, 3]
    assert store.get("ka")["embed"].flatten().tolist() == [6, 7, 8]
    assert store.get("ka")["tts_embed"].shape == (3, 1)
    # a decode step: one row each, no second tts_embed
    step = _step(cached=[("a", 3), ("b", 4), ("plain", 2)], scheduled={"a": 1, "b": 1, "plain": 1})
    assert io.begin_step(step)
    model.forward(range(3))
    io.publish(model, ["a", "b", "plain"], step)
    assert store.get("ka")["embed"].flatten().tolist() == [6, 7, 8, 0]
    assert store.get("ka")["tts_embed"].shape == (3, 1)


def test_a_step_publishes_one_file_for_all_its_requests(store):
    """Every publishing request's chunk of a step is in one file, linked into each key
    (a file per request and step cost about 0.1 ms each: as much as the tiny thinker's
    whole decode step of 16 requests); each key reads back only its own rows, and once
    the keys are deleted nothing is left."""
    import os

    io, model = StageIO(0, store), RowsModel()
    keys = {r: _out(store, f"k{r}") for r in "abc"}
    step = _step(new=[_new(r, keys[r]) for r in "abc"], scheduled=dict.fromkeys("abc", 2))
    io.begin_step(step)
    model.forward(range(6))
    io.publish(model, list("abc"), step)
    files = [os.path.join(store.root, f"k{r}", "00000000.st") for r in "abc"]
    assert len({os.stat(f).st_ino for f in files}) == 1
    assert [store.get(f"k{r}")["embed"].flatten().tolist() for r in "abc"] == [
        [0, 1], [2, 3], [4, 5]]
    assert store.keys() == ["ka", "kb", "kc"]
    for r in "abc":
        store.delete(f"k{r}")
    assert os.listdir(store.root) == []


def test_plain_requests_alone_publish_nothing(store):
    io = StageIO(0, store)
    assert not io.begin_step(_step(new=[_new("plain")], scheduled={"plain": 4}))


def test_recompute_after_preemption_publishes_no_row_twice(store):
    io, model = StageIO(0, store), RowsModel()
    step = _step(new=[_new("a", _out(store, "ka"))], scheduled={"a": 5})
    io.begin_step(step)
    model.forward(range(5))
    io.publish(model, ["a"], step)
    # preempted, then recomputed from 0 in two chunks of 4, then it goes on
    for computed, n in ((0, 4), (4, 4)):
        step = _step(cached=[("a", computed)], scheduled={"a": n})
        io.begin_step(step)
        model.forward(range(n))
        io.publish(model, ["a"], step)
    assert store.get("ka")["embed"].flatten().tolist() == [0, 1, 2, 3, 4, 1, 2, 3]


def test_bad_keys_fail_the_request_and_force_its_stop_token(store, caplog):
    io = StageIO(3, store)
    step = _step(new=[_new("bad", {PAYLOAD: {"bogus": "x"}}), _new("ok")],
                 scheduled={"bad": 2, "ok": 2})
    io.begin_step(step)
    output = SimpleNamespace(req_ids=["ok", "bad"], sampled_token_ids=[[5], [9]])
    io.override_failed(output)
    assert output.sampled_token_ids == [[5], [7]]
    assert "stage 3: request bad failed" in caplog.text


def test_a_non_boolean_prefilled_flag_fails_the_request(store):
    io = StageIO(0, store)
    keys = _out(store, "k")
    keys[PAYLOAD]["prefilled"] = "yes"
    io.begin_step(_step(new=[_new("a", keys, computed=3)], scheduled={"a": 1}))
    assert io.tracked("a").failed


def test_a_model_without_stage_outputs_fails_publishing_requests(store):
    io = StageIO(1, store)
    keys = _out(store, "k")
    step = _step(new=[_new("a", keys)], scheduled={"a": 2})
    io.begin_step(step)
    io.publish(object(), ["a"], step)
    assert "publishes no stage outputs" in store.error("k")


def test_prefix_cache_hit_fails_a_publishing_request(store):
    io = StageIO(0, store)
    io.begin_step(_step(new=[_new("a", _out(store, "k"), computed=32)], scheduled={"a": 4}))
    assert "enable_prefix_caching: false" in store.error("k")


def test_a_prefilled_request_publishes_only_its_generated_positions(store):
    """A decode-stage request whose prompt KV came from the prefill stage starts at the
    last prompt position; the prefill stage published the prompt's rows (and the
    once-per-request tensors), so this engine publishes from the first generated token."""
    io, model = StageIO(0, store), RowsModel()
    keys = _out(store, "k")
    keys[PAYLOAD]["prefilled"] = True
    step = _step(new=[_new("a", keys, computed=3, prompt_len=4)], scheduled={"a": 1})
    assert io.begin_step(step)
    model.forward(range(1))
    io.publish(model, ["a"], step)
    assert store.error("k") is None and store.get("k") == {}
    for computed in (4, 5):  # decode steps feed the generated tokens
        step = _step(cached=[("a", computed)], scheduled={"a": 1})
        io.begin_step(step)
        model.forward(range(1))
        io.publish(model, ["a"], step)
    assert store.get("k")["embed"].flatten().tolist() == [0, 0]
    assert "tts_embed" not in store.get("k")


def test_batch_req_ids_reads_either_runner_layout():
    v1 = SimpleNamespace(execute_model_state=SimpleNamespace(logits=None),
                         input_batch=SimpleNamespace(req_ids=["x", "y"]))
    assert batch_req_ids(v1) == ["x", "y"]
    v2 = SimpleNamespace(execute_model_state=SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["y", "x"])))
    assert batch_req_ids(v2) == ["y", "x"]
    with pytest.raises(RuntimeError, match="compat/model_runner.py"):
        batch_req_ids(SimpleNamespace())


class _V2Runner:
    """vLLM's V2 ``GPUModelRunner`` as far as the row map goes, from the installed
    release's own parts: ``prepare_inputs`` orders the step with V2's
    ``sort_batch_req_ids`` (decodes first) into V2's ``InputBatch``; ``execute_model``
    keeps that batch in a local during the forward and stores it in
    ``execute_model_state`` only after it, as V2 does (the shim test checks that order
    in V2's source)."""

    def __init__(self, forward):
        self.forward, self.execute_model_state = forward, None

    def prepare_inputs(self, scheduler_output, *args):
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        counts = scheduler_output.num_scheduled_tokens
        req_ids = sort_batch_req_ids(counts, {}, 1)
        buffers = InputBuffers(max_num_reqs=8, max_num_tokens=64, device=torch.device("cpu"))
        batch = InputBatch.make_dummy(len(req_ids), sum(counts.values()), buffers)
        return dataclasses.replace(batch, req_ids=req_ids)

    def execute_model(self, scheduler_output):
        input_batch = self.prepare_inputs(scheduler_output, None, None)
        self.forward()
        self.execute_model_state = SimpleNamespace(input_batch=input_batch)

    def sample_tokens(self):
        self.execute_model_state = None


def test_a_stage_step_maps_rows_inside_a_v2_forward(store):
    """V2 (vLLM's default runner on CUDA) has no batch attribute during the forward,
    where the talker, code2wav and the DiT read their rows: before the fix,
    ``requests()`` raised there and the engine died on its first request."""
    io = StageIO(1, store)
    seen = []
    runner = _V2Runner(lambda: seen.append(step_view.requests()))
    for step in (_step(new=[_new("a", _out(store, "ka"), prompt_len=5)], cached=[("old", 9)],
                       scheduled={"a": 5, "old": 1}),
                 _step(new=[_new("b", _out(store, "kb"), prompt_len=3)],
                       cached=[("a", 5), ("old", 10)], scheduled={"b": 3, "a": 1, "old": 1})):
        io.begin_step(step, always=True)
        watch_step(runner)
        step_view = StageStep(io, runner, step)
        runner.execute_model(step)
        assert batch_req_ids(runner) == [r.req_id for r in seen[-1]]  # after the forward
        runner.sample_tokens()
    assert seen == [[ScheduledRequest("old", 0, 1, 9, 0), ScheduledRequest("a", 1, 5, 0, 5)],
                    [ScheduledRequest("a", 0, 1, 5, 5), ScheduledRequest("old", 1, 1, 10, 0),
                     ScheduledRequest("b", 2, 3, 0, 3)]]
    watch_step(runner)  # the next step, before its prepare_inputs: no stale batch
    with pytest.raises(RuntimeError, match="compat/model_runner.py"):
        batch_req_ids(runner)


def test_async_runner_output_of_a_failed_request_carries_its_stop_token(store):
    """With async scheduling (GPU) the worker returns vLLM's AsyncModelRunnerOutput;
    the failed request's stop token is put in when the output is read."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    from vllm_omni_plugin.worker.omni_worker import _FixedAsyncOutput

    kv_output = object()

    class Pending(AsyncModelRunnerOutput):
        def get_output(self):
            return ModelRunnerOutput(req_ids=["bad", "ok"], req_id_to_index={"bad": 0, "ok": 1},
                                     sampled_token_ids=[[9], [5]])

        def get_kv_connector_output(self):  # abstract since vLLM 0.33
            return kv_output

    io = StageIO(0, store)
    io.begin_step(_step(new=[_new("bad", {PAYLOAD: [1]}), _new("ok")],
                        scheduled={"bad": 1, "ok": 1}))
    fixed = _FixedAsyncOutput(Pending(), io)
    assert fixed.get_output().sampled_token_ids == [[7], [5]]
    assert fixed.get_kv_connector_output() is kv_output


def _runner(*req_ids):
    """A V1 model runner as far as the row map goes."""
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(req_ids)))


def test_a_stage_step_maps_rows_and_hands_over_inputs_and_params(store):
    store.put("in-a", {"x": torch.arange(3)})
    io = StageIO(1, store)
    keys = {PAYLOAD: {"in": "in-a", **_out(store, "out-a")[PAYLOAD]}}
    step = _step(new=[_new("a", keys, prompt_len=6), _new("plain")],
                 cached=[("old", 9)], scheduled={"a": 6, "plain": 2, "old": 1},
                 finished=["gone"])
    assert io.begin_step(step, always=True)
    view = StageStep(io, _runner("old", "a", "plain"), step)
    assert view.requests() == [ScheduledRequest("old", 0, 1, 9, 0),
                               ScheduledRequest("a", 1, 6, 0, 6),
                               ScheduledRequest("plain", 7, 2, 0, 0)]
    assert view.inputs("a")["x"].tolist() == [0, 1, 2] and view.inputs("plain") == {}
    assert view.params("a") is step.scheduled_new_reqs[0].sampling_params
    assert view.finished == {"gone"}
    view.fail("a", ValueError("bad frame"))
    assert view.failed("a") and "ValueError: bad frame" in store.error("out-a")
    output = SimpleNamespace(req_ids=["a", "plain"], sampled_token_ids=[[3], [4]])
    io.override_failed(output)
    assert output.sampled_token_ids == [[7], [4]]


def test_a_model_that_reads_its_step_may_fail_a_request_without_payload_keys(store, caplog):
    """A text-only request reaches the entry stage without payload keys (the engine client
    passes it to vLLM's AsyncLLM). The worker tracks such requests only for a model that
    reads its step (``track_plain``), which may fail any request: the failure is logged
    and the request emits its stop token; the rest of the batch goes on."""
    plain_step = _step(new=[_new("plain"), _new("other")], scheduled={"plain": 2, "other": 1})
    untracked = StageIO(0, store)
    assert not untracked.begin_step(plain_step) and untracked.tracked("plain") is None

    io = StageIO(0, store)
    io.track_plain = True
    io.begin_step(plain_step, always=True)
    view = StageStep(io, _runner("plain", "other"), plain_step)
    with caplog.at_level(logging.ERROR):
        view.fail("plain", ValueError("bad row"))
    assert view.failed("plain") and not view.failed("other")
    assert "request plain failed: ValueError: bad row" in caplog.text
    output = SimpleNamespace(req_ids=["plain", "other"], sampled_token_ids=[[3], [4]])
    io.override_failed(output)
    assert output.sampled_token_ids == [[7], [4]] and store.keys() == []


def test_an_unreadable_input_payload_fails_its_request_only(store):
    io = StageIO(2, store)
    keys = {PAYLOAD: {"in": "missing", **_out(store, "out-b")[PAYLOAD]}}
    io.begin_step(_step(new=[_new("b", keys), _new("plain")], scheduled={"b": 4, "plain": 4}))
    assert store.error("out-b") is not None
    assert io.tracked("b").failed and io.tracked("plain") is None


def test_per_request_outputs_are_published_with_the_requests_rows(store):
    class PerRequest:
        def stage_output_requests(self):
            return {"a": {"codes": torch.tensor([[1, 2]])}}

    io = StageIO(1, store)
    step = _step(new=[_new("a", _out(store, "ka")), _new("b", _out(store, "kb"))],
                 scheduled={"a": 2, "b": 2})
    io.begin_step(step)
    io.publish(PerRequest(), ["a", "b"], step)
    assert store.get("ka")["codes"].tolist() == [[1, 2]]
    assert store.get("kb") == {} and store.error("kb") is None


def test_a_growing_input_takes_the_chunks_appended_before_each_step(store):
    store.put("in-g", {"x": torch.arange(2), "once": torch.ones(1)})
    io = StageIO(1, store)
    keys = {PAYLOAD: {"in": "in-g", "input_grows": True, **_out(store, "out-g")[PAYLOAD]}}
    io.begin_step(_step(new=[_new("g", keys)], scheduled={"g": 4}), always=True)
    assert io.tracked("g").inputs["x"].tolist() == [0, 1]
    store.append("in-g", {"x": torch.tensor([2, 3])})
    io.begin_step(_step(cached=[("g", 4)], scheduled={"g": 1}), always=True)
    io.begin_step(_step(cached=[("g", 5)], scheduled={"g": 1}), always=True)  # nothing new
    inputs = io.tracked("g").inputs
    assert inputs["x"].tolist() == [0, 1, 2, 3] and inputs["once"].tolist() == [1.0]
    assert not io.tracked("g").failed


def test_a_growing_input_copies_each_row_about_once(store):
    """A talker fed while the thinker runs gets a chunk of rows nearly every step: its
    input keeps them in buffers that double when full, so 200 chunks move the rows
    O(log 200) times (joining the whole input again for each chunk copied it 200 times,
    O(rows²) a request). A chunk of another dtype fails the request naming the tensor."""
    store.put("in-r", {"x": torch.zeros(3, 2)})
    io = StageIO(1, store)
    keys = {PAYLOAD: {"in": "in-r", "input_grows": True, **_out(store, "out-r")[PAYLOAD]}}
    io.begin_step(_step(new=[_new("r", keys)], scheduled={"r": 4}), always=True)
    seen = []  # every step's tensor, kept alive so that no two storages share an address
    for i in range(200):
        store.append("in-r", {"x": torch.full((1, 2), float(i))})
        io.begin_step(_step(cached=[("r", 4 + i)], scheduled={"r": 1}), always=True)
        seen.append(io.tracked("r").inputs["x"])
    x = seen[-1]
    assert x.shape == (203, 2) and x[3:, 0].tolist() == [float(i) for i in range(200)]
    storages = {t.untyped_storage().data_ptr() for t in seen}
    assert len(storages) <= 6, len(storages)
    store.append("in-r", {"x": torch.zeros(1, 2, dtype=torch.int64)})
    io.begin_step(_step(cached=[("r", 204)], scheduled={"r": 1}), always=True)
    assert io.tracked("r").failed and "'x'" in store.error("out-r")


def test_a_missing_growing_input_fails_its_request(store):
    io = StageIO(1, store)
    keys = {PAYLOAD: {"in": "nothing", "input_grows": True, **_out(store, "out-m")[PAYLOAD]}}
    io.begin_step(_step(new=[_new("m", keys)], scheduled={"m": 4}), always=True)
    assert io.tracked("m").failed and "missing or empty" in store.error("out-m")


def test_kept_rows_survive_a_replay_that_runs_no_python(store):
    """The thinker's rows under FULL CUDA graphs: a replay rewrites the buffers (the
    captured copies) without running ``forward``; what the worker publishes after it is
    the replayed step's rows, not those the last Python forward left."""
    buffers = {"embed": torch.zeros(8, 1)}

    class Thinker:
        def forward(self, embed):
            keep_rows(buffers, embed=embed)

        def stage_output_rows(self):
            return buffers

    io, model = StageIO(0, store), Thinker()
    step = _step(new=[_new("a", _out(store, "ka"), prompt_len=5)], scheduled={"a": 5})
    io.begin_step(step)
    address = buffers["embed"].data_ptr()
    model.forward(torch.arange(5.0)[:, None])  # a prefill: eager, Python runs
    io.publish(model, ["a"], step)
    step = _step(cached=[("a", 5)], scheduled={"a": 1})
    io.begin_step(step)
    buffers["embed"][:1].copy_(torch.tensor([[42.0]]))  # a decode step's replay
    io.publish(model, ["a"], step)
    assert store.get("ka")["embed"].flatten().tolist() == [0, 1, 2, 3, 4, 42]
    assert buffers["embed"].data_ptr() == address
    with pytest.raises(ValueError, match="9 rows exceeds the 8 rows kept for 'embed'"):
        model.forward(torch.zeros(9, 1))


def test_stage_models_refuse_graph_modes_that_would_skip_their_python():
    """vLLM's GPU default (FULL_AND_PIECEWISE) on the talker, code2wav or the DiT, which
    read their step from Python, is refused at start-up naming the fix; the thinker,
    whose rows survive replay, keeps it; PIECEWISE (Python runs between the pieces) is
    fine for a model that only publishes rows."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_omni_plugin.models.bagel.dit import BagelDiTStage
    from vllm_omni_plugin.models.qwen3_omni.code2wav import Qwen3OmniCode2WavStage
    from vllm_omni_plugin.models.qwen3_omni.talker import Qwen3OmniTalkerStage
    from vllm_omni_plugin.models.qwen3_omni.thinker import Qwen3OmniThinkerStage

    def model(cls):  # the class's declarations, without building its layers
        return cls.__new__(cls)

    class RowsInPython:
        def stage_output_rows(self):
            return {}

    for cls in (Qwen3OmniTalkerStage, Qwen3OmniCode2WavStage, BagelDiTStage):
        for mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE):
            with pytest.raises(ValueError, match=f"stage 2: {cls.__name__} .*enforce_eager"):
                check_graph_mode(model(cls), mode, 2)
        check_graph_mode(model(cls), CUDAGraphMode.NONE, 2)
    check_graph_mode(model(Qwen3OmniThinkerStage), CUDAGraphMode.FULL_AND_PIECEWISE, 0)
    with pytest.raises(ValueError, match="stage 0: RowsInPython .*cudagraph_mode: PIECEWISE"):
        check_graph_mode(RowsInPython(), CUDAGraphMode.FULL_DECODE_ONLY, 0)
    check_graph_mode(RowsInPython(), CUDAGraphMode.PIECEWISE, 0)


def test_a_profile_peak_beyond_the_share_fails_start_up_naming_the_stage():
    """The decision the worker takes after measuring a KV-less stage's memory profile on
    a GPU (a peak cannot be measured on vLLM's CPU build): within the share it passes,
    beyond it start-up fails with the stage, the model and both figures."""
    from vllm_omni_plugin.worker.omni_worker import StageMemoryProfile, check_profile_fits

    gib = 1 << 30
    check_profile_fits(StageMemoryProfile(1, "BagelDiTStage", 30 * gib, 30 * gib, 2.0), 0.37)
    with pytest.raises(ValueError, match=r"stage 1: BagelDiTStage's largest workload .* "
                       r"peaks at 31.50 GiB .* gpu_memory_utilization 0.37 = 29.45 GiB: "
                       r"raise this stage's engine_args.gpu_memory_utilization"):
        check_profile_fits(StageMemoryProfile(1, "BagelDiTStage", int(31.5 * gib),
                                              int(29.45 * gib), 2.0), 0.37)


def test_vllm_gpu_worker_profiles_memory_with_a_forward_the_worker_can_mark():
    """What the worker's ``stage_profiling`` relies on (vLLM's CPU build cannot run it):
    vLLM's GPU worker runs its model runner's ``profile_run`` inside
    ``determine_available_memory``, and both model runners' (V1's and V2's)
    ``profile_run`` is one dummy forward of ``max_num_tokens``, outside any step. vLLM's
    EngineCore calls ``determine_available_memory`` only for a model with a KV cache and
    ``compile_or_warm_up_model`` for every engine, so the worker profiles a model without
    one (code2wav, the DiT) in the latter (review 2, N3). The forward itself, marked, is
    run by vLLM's CPU engine start-up in ``engine/test_code2wav_engine.py`` and
    ``engine/test_bagel_dit_engine.py``."""
    import ast
    import importlib.util
    from pathlib import Path

    def method(module: str, cls: str, name: str) -> str:
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        owner = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
        return ast.unparse(next(n for n in owner.body
                                if isinstance(n, ast.FunctionDef) and n.name == name))

    assert "self.model_runner.profile_run(" in method(
        "vllm.v1.worker.gpu_worker", "Worker", "determine_available_memory")
    init = ast.parse(method("vllm.v1.engine.core", "EngineCore", "_initialize_kv_caches"))
    gate = next(n for n in ast.walk(init) if isinstance(n, ast.If)
                and ast.unparse(n.test) == "has_kv_cache")
    gated = ast.unparse(gate)
    assert "self.model_executor.determine_available_memory()" in gated
    assert "compile_or_warm_up_model" not in gated
    assert "self.model_executor.compile_or_warm_up_model()" in ast.unparse(init)
    for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
        profile = method(module, "GPUModelRunner", "profile_run").replace("\n", " ")
        assert profile.count("self._dummy_run(") == 1, module
        assert "self._dummy_run(self.max_num_tokens" in profile, module
