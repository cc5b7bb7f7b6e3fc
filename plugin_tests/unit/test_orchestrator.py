"""Orchestrator request flow without engines: chain and fan-out of stages,
abort, a stage failure, a bad or missing processor, the closed ``extra_args``
namespace, admission.

The entry stage is a scripted async generator that publishes its payload into
a real :class:`PayloadStore` the way a worker does; downstream stages are
scripted pools (``run``/``abort``/``forget``, what the orchestrator uses of a
:class:`~vllm_omni_plugin.replicas.pool.StagePool`), so each outcome can be
chosen per test. The same flow with real engines is in
``test_pipeline_engine.py`` and the ``*_serve.py`` tests.
"""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest
import torch
from vllm.sampling_params import RequestOutputKind

from plugin_tests.helpers import LONG_WAIT, until
from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.config.loader import parse_pipeline_config
from vllm_omni_plugin.config.schema import StreamingConfig
from vllm_omni_plugin.coordinator import RoundRobinBalancer
from vllm_omni_plugin.engine.admission import AdmissionGate
from vllm_omni_plugin.engine.omni_request import OmniRequest, omni_request_scope
from vllm_omni_plugin.engine.orchestrator import Orchestrator, StageError
from vllm_omni_plugin.payload_store import PayloadStore
from vllm_omni_plugin.processors.hookspecs import StageInput
from vllm_omni_plugin.replicas.pool import StagePool
from vllm_omni_plugin.replicas.replica import Replica
from vllm_omni_plugin.replicas.task import StageRun, StageTask, TaskError

PROMPT = [5, 6, 7]
ENTRY_TOKENS = [11, 12]


def _pipeline(fan_out: bool):
    stage = {"kind": "ar", "input_processor": "p"}
    stages = [{"stage_id": 0, "name": "thinker", "kind": "ar", "final_output": True,
               "final_output_type": "text"}]
    if fan_out:  # 0 -> {1, 2} -> 3
        stages += [{**stage, "stage_id": 1, "name": "left", "inputs": [0]},
                   {**stage, "stage_id": 2, "name": "right", "inputs": [0]},
                   {**stage, "stage_id": 3, "name": "join", "inputs": [1, 2],
                    "kind": "generation", "final_output": True, "final_output_type": "audio"}]
    else:  # 0 -> 1 -> 2
        stages += [{**stage, "stage_id": 1, "name": "talker", "inputs": [0]},
                   {**stage, "stage_id": 2, "name": "code2wav", "inputs": [1],
                    "kind": "generation", "final_output": True, "final_output_type": "audio"}]
    return parse_pipeline_config({"stages": stages}, check_processors=False)


class Entry:
    """The entry stage: publishes ``hidden`` under the request's output key,
    or a failure under its error slot when ``fail_with`` is set."""

    def __init__(self, store: PayloadStore, fail_with: str | None = None) -> None:
        self.store = store
        self.fail_with = fail_with
        self.seen_extra_args: list[dict] = []
        self.seen_skip_reading: list[bool] = []

    async def __call__(self, prompt, params, request_id):
        self.seen_extra_args.append(dict(params.extra_args or {}))
        self.seen_skip_reading.append(params.skip_reading_prefix_cache)
        keys = xargs.payload_keys(params.extra_args)
        if keys.output:
            self.store.append(keys.output, {"hidden": torch.ones(len(PROMPT), 2)})
        if self.fail_with and keys.error:
            self.store.put_error(keys.error, self.fail_with)
        completion = SimpleNamespace(token_ids=[ENTRY_TOKENS[0]])
        yield SimpleNamespace(finished=False, prompt_token_ids=PROMPT, outputs=[completion])
        await asyncio.sleep(0)
        # a streamed request (RequestOutputKind.DELTA) gets only the new tokens each time
        delta = params.output_kind == RequestOutputKind.DELTA
        completion = SimpleNamespace(token_ids=list(ENTRY_TOKENS[1:] if delta else ENTRY_TOKENS),
                                     finish_reason="length")
        yield SimpleNamespace(finished=True, prompt_token_ids=PROMPT, outputs=[completion])


class Pool:
    """A stage pool whose ``run`` is scripted: "ok", "fail" or "block" (until aborted)."""

    def __init__(self, stage_id: int, outcome: str = "ok") -> None:
        self.stage_id = stage_id
        self.outcome = outcome
        self.tasks = []
        self.aborted: list[str] = []
        self.forgotten: list[str] = []
        self._abort = asyncio.Event()

    async def run(self, task, on_rows=None):
        self.tasks.append(task)
        if self.outcome == "fail":
            raise TaskError("worker failed: boom", 500)
        if self.outcome == "block":
            await self._abort.wait()
            from vllm_omni_plugin.replicas.task import TaskAborted

            raise TaskAborted(task.request_id)
        payload = {"out": torch.full((1,), float(self.stage_id))}
        if self.stage_id in (2, 3):
            payload = {"waveform": torch.zeros(4), "sample_rate": torch.tensor([24000])}
        return StageRun(list(task.prompt_token_ids), [100 + self.stage_id], payload)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort.set()

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def _recording_processor(calls: list):
    def processor(upstream, stage, request):
        calls.append((stage.stage_id, [u.stage_id for u in upstream], request.voice))
        return StageInput(prompt_token_ids=[1, 2], payload={"x": torch.zeros(1)})

    return processor


def _orchestrator(tmp_path, fan_out=False, outcomes=None, entry_fail=None, bounds=4,
                  admission_timeout=1.0):
    pipeline = _pipeline(fan_out)
    store = PayloadStore(str(tmp_path / "run"))
    ids = [s.stage_id for s in pipeline.stages if s.stage_id != 0]
    pools = {i: Pool(i, (outcomes or {}).get(i, "ok")) for i in ids}
    calls: list = []
    orchestrator = Orchestrator(
        Entry(store, entry_fail), SimpleNamespace(), pipeline, store, pools,
        AdmissionGate(dict.fromkeys(ids, bounds), admission_timeout),
        dict.fromkeys(ids, _recording_processor(calls)))
    return orchestrator, calls


async def _run(orchestrator, request: OmniRequest, request_id="req-1", extra_args=None,
               output_kind=RequestOutputKind.CUMULATIVE):
    from vllm import SamplingParams

    outputs = []
    with omni_request_scope(request):
        async for out in orchestrator.generate(
                {"prompt_token_ids": PROMPT},
                SamplingParams(max_tokens=4, extra_args=extra_args, output_kind=output_kind),
                request_id):
            outputs.append(out)
    return outputs


def _audio(voice=None) -> OmniRequest:
    return OmniRequest(modalities=("text", "audio"), voice=voice)


def test_chain_runs_each_stage_and_hands_the_result_to_the_request(tmp_path):
    orchestrator, calls = _orchestrator(tmp_path)
    request = _audio(voice="ethan")
    outputs = asyncio.run(_run(orchestrator, request))
    assert [o.finished for o in outputs] == [False, True]  # final released after the stages
    assert calls == [(1, [0], "ethan"), (2, [1], "ethan")]
    result = request.result
    assert result.error is None and result.output_type == "audio" and result.sample_rate == 24000
    assert set(result.payload) == {"waveform"}
    assert orchestrator.pools[1].tasks[0].request_id == "req-1-s1"
    assert orchestrator.pools[1].forgotten == ["req-1-s1"]
    assert orchestrator.store.keys() == [] and orchestrator.admission.in_flight == {1: 0, 2: 0}


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_downstream_stages_see_every_generated_token_streamed_or_not(tmp_path, kind):
    orchestrator, _ = _orchestrator(tmp_path)
    seen = []

    def processor(upstream, stage, request):
        seen.append(list(upstream[0].output_token_ids))
        return StageInput(prompt_token_ids=[1, 2])

    orchestrator.processors = dict.fromkeys(orchestrator.processors, processor)
    asyncio.run(_run(orchestrator, _audio(), output_kind=kind))
    assert seen[0] == ENTRY_TOKENS


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_stage_left_nothing_to_do_does_not_run_and_its_output_goes_on(tmp_path, streamed):
    """The talker's processor finds nothing to speak: the talker never runs, its given
    output (0 frames) is code2wav's input, and code2wav's processor gives 0 samples: the
    request succeeds with them (no chunk is decoded for a streamed request)."""
    orchestrator, _ = _orchestrator(tmp_path)
    seen = []

    def to_talker(upstream, stage, request):
        return StageInput.nothing_to_do({"codes": torch.zeros(0, 16, dtype=torch.long)},
                                        "nothing to say")

    def to_code2wav(upstream, stage, request):
        seen.append(upstream[0].payload["codes"].shape)
        return StageInput.nothing_to_do(
            {"waveform": torch.zeros(0), "sample_rate": torch.tensor([24000])}, "no frames")

    orchestrator.processors = {1: to_talker, 2: to_code2wav}
    if streamed:
        orchestrator.pipeline.stage(2).streaming = StreamingConfig(chunk_size=2,
                                                                   left_context=1)
    request = _streamed_audio() if streamed else _audio()
    asyncio.run(asyncio.wait_for(_run(orchestrator, request), 30))
    assert seen == [(0, 16)]
    assert not orchestrator.pools[1].tasks and not orchestrator.pools[2].tasks
    result = request.result
    assert result.error is None and result.sample_rate == 24000
    assert result.payload["waveform"].shape == (0,)
    assert orchestrator.store.keys() == [] and orchestrator.admission.in_flight == {1: 0, 2: 0}
    assert orchestrator.runs == {}


def test_fan_out_feeds_each_stage_its_listed_inputs_in_order(tmp_path):
    orchestrator, calls = _orchestrator(tmp_path, fan_out=True)
    request = _audio()
    asyncio.run(_run(orchestrator, request))
    assert calls == [(1, [0], None), (2, [0], None), (3, [1, 2], None)]
    assert request.result.error is None and request.result.output_type == "audio"


def test_text_only_request_never_reaches_downstream_stages(tmp_path):
    orchestrator, calls = _orchestrator(tmp_path)
    request = OmniRequest()
    outputs = asyncio.run(_run(orchestrator, request))
    assert len(outputs) == 2 and calls == [] and request.result is None
    assert not orchestrator.pools[1].tasks and orchestrator.store.keys() == []


def test_only_a_plain_text_request_passes_through_to_vllm(tmp_path):
    """The engine client runs a request on vLLM's AsyncLLM itself, with no orchestrator,
    when it asks for text alone, carries no key of the plugin's namespace, and the
    pipeline has no prefill stage and no request timeout; anything else goes through the
    orchestrator (which drops the keys, pairs prefill and decode, or enforces the
    timeout)."""
    from vllm import SamplingParams

    plain, _ = _orchestrator(tmp_path)
    pd, _ = _pd_orchestrator(tmp_path)
    timed = _timed(plain.store, Entry(plain.store), lambda request_id: None)

    def passes(orchestrator, request=None, extra_args=None) -> bool:
        params = SamplingParams(max_tokens=4, extra_args=extra_args)
        if request is None:  # a request from a route the omni middleware does not read
            return orchestrator.passes_through(params)
        with omni_request_scope(request):
            return orchestrator.passes_through(params)

    assert passes(plain) and passes(plain, OmniRequest())
    assert passes(plain, OmniRequest(), {"keep": 1})
    assert not passes(plain, _audio())
    assert not passes(plain, OmniRequest(), {xargs.PAYLOAD: {"out": "k"}})
    assert not passes(plain, None, {"omni_plugin_modalities": ["text", "audio"]})
    assert not passes(pd, OmniRequest()) and not passes(timed, OmniRequest())


def test_client_keys_in_the_plugin_namespace_never_reach_an_engine(tmp_path):
    orchestrator, _ = _orchestrator(tmp_path)
    for request in (OmniRequest(), _audio()):
        asyncio.run(_run(orchestrator, request, extra_args={
            xargs.PAYLOAD: "x", "omni_plugin_modalities": ["text", "audio"], "keep": 1}))
    for seen in orchestrator.entry_generate.seen_extra_args:
        assert seen["keep"] == 1 and "omni_plugin_modalities" not in seen
        xargs.payload_keys(seen)  # what the orchestrator wrote is well-formed
    assert len(orchestrator.pools[1].tasks) == 1  # the text-only request ran no pipeline


def test_only_a_request_that_publishes_rows_skips_reading_the_prefix_cache(tmp_path):
    """A spoken request's entry stage publishes a row per position: vLLM must compute
    every position (``skip_reading_prefix_cache``); a text-only one reads the cache."""
    orchestrator, _ = _orchestrator(tmp_path)
    for request in (OmniRequest(), _audio()):
        asyncio.run(_run(orchestrator, request))
    assert orchestrator.entry_generate.seen_skip_reading == [False, True]


def test_stage_failure_fails_the_request_naming_the_stage(tmp_path):
    orchestrator, calls = _orchestrator(tmp_path, outcomes={1: "fail"})
    request = _audio()
    outputs = asyncio.run(_run(orchestrator, request))
    assert outputs[-1].finished  # the text is still released; the API answers the error
    assert request.result.status == 500
    assert request.result.error == "stage 1 (talker): worker failed: boom"
    assert [c[0] for c in calls] == [1]  # stage 2 never ran
    assert orchestrator.store.keys() == [] and orchestrator.admission.in_flight == {1: 0, 2: 0}


def test_processor_rejecting_the_request_is_a_400_naming_stage_and_processor(tmp_path):
    orchestrator, _ = _orchestrator(tmp_path)

    def reject(upstream, stage, request):
        raise ValueError("unknown voice 'nobody'")

    orchestrator.processors[1] = reject
    request = _audio(voice="nobody")
    asyncio.run(_run(orchestrator, request))
    assert request.result.status == 400
    assert request.result.error == ("stage 1 (talker): input processor 'p': "
                                    "unknown voice 'nobody'")


def test_missing_processor_or_pool_is_refused_at_construction(tmp_path):
    pipeline = _pipeline(fan_out=False)
    store = PayloadStore(str(tmp_path / "run"))
    gate = AdmissionGate({1: 1, 2: 1}, 1.0)
    pools = {1: Pool(1), 2: Pool(2)}
    with pytest.raises(ValueError, match=r"stage 2 \(code2wav\): no input processor"):
        Orchestrator(Entry(store), None, pipeline, store, pools, gate, {1: print})
    with pytest.raises(ValueError, match=r"stage 1 \(talker\): no stage pool"):
        Orchestrator(Entry(store), None, pipeline, store, {2: Pool(2)}, gate,
                     {1: print, 2: print})


def test_abort_reaches_the_stage_and_ends_the_request_without_result(tmp_path):
    async def scenario():
        orchestrator, _ = _orchestrator(tmp_path, outcomes={1: "block"})
        request = _audio()
        running = asyncio.create_task(_run(orchestrator, request))
        await until(lambda: orchestrator.pools[1].tasks, LONG_WAIT, what="stage 1's task")
        await orchestrator.abort("req-1")
        outputs = await asyncio.wait_for(running, LONG_WAIT)
        return orchestrator, request, outputs

    orchestrator, request, outputs = asyncio.run(scenario())
    assert orchestrator.pools[1].aborted == ["req-1-s1"]
    assert request.result is None and all(not o.finished for o in outputs)
    assert orchestrator.store.keys() == [] and orchestrator.admission.in_flight == {1: 0, 2: 0}


def test_long_and_reused_request_ids_get_valid_keys_of_their_own(tmp_path):
    """Payload keys are at most 200 characters: a 300-character request id is cut, and a
    serial number keeps two requests of the same id apart (a client may reuse one)."""
    async def scenario():
        orchestrator, _ = _orchestrator(tmp_path)
        rid = "r" * 300
        requests = [_audio(), _audio()]
        await asyncio.gather(*(_run(orchestrator, r, request_id=rid) for r in requests))
        return orchestrator, requests, orchestrator.entry_generate.seen_extra_args

    orchestrator, requests, seen = asyncio.run(scenario())
    assert all(r.result is not None and not r.result.error for r in requests)
    keys = [xargs.payload_keys(extra).output for extra in seen]
    assert len(set(keys)) == 2 and all(len(k) <= 200 for k in keys)
    assert orchestrator.store.keys() == [] and orchestrator.runs == {}


def test_text_request_failing_in_the_entry_worker_raises_naming_the_stage(tmp_path):
    orchestrator, _ = _orchestrator(tmp_path, entry_fail="RuntimeError: model broke")
    request = OmniRequest()
    with pytest.raises(StageError, match=r"^stage 0 \(thinker\): RuntimeError: model broke$"):
        asyncio.run(_run(orchestrator, request))
    assert request.result.status == 500 and orchestrator.store.keys() == []


def test_full_stage_refuses_with_429_before_the_entry_stage_runs(tmp_path):
    async def scenario():
        orchestrator, _ = _orchestrator(tmp_path, outcomes={1: "block"}, bounds=1,
                                        admission_timeout=0.01)
        first = asyncio.create_task(_run(orchestrator, _audio(), request_id="first"))
        await until(lambda: orchestrator.pools[1].tasks, LONG_WAIT, what="stage 1's task")
        refused = _audio()
        outputs = await asyncio.wait_for(_run(orchestrator, refused, request_id="second"),
                                         LONG_WAIT)
        await orchestrator.abort("first")
        await asyncio.wait_for(first, LONG_WAIT)
        return orchestrator, refused, outputs

    orchestrator, refused, outputs = asyncio.run(scenario())
    assert outputs == [] and refused.result.status == 429 and refused.result.retry_after >= 1
    assert len(orchestrator.entry_generate.seen_extra_args) == 1  # only the admitted one


# -- prefill/decode disaggregation ---------------------------------------------------
PREFILL_ENGINE = {"remote_engine_id": "thinker_prefill-abc",
                  "remote_bootstrap_addr": "http://127.0.0.1:9"}


def _pd_pipeline():
    stage = {"kind": "ar", "input_processor": "p"}
    return parse_pipeline_config({"stages": [
        {"stage_id": 0, "name": "thinker", "kind": "ar", "final_output": True,
         "final_output_type": "text", "pd": {"role": "decode"},
         "engine_args": {"enable_prefix_caching": False}},
        {**stage, "stage_id": 1, "name": "talker", "inputs": [0]},
        {**stage, "stage_id": 2, "name": "code2wav", "inputs": [1], "kind": "generation",
         "final_output": True, "final_output_type": "audio"},
        {"stage_id": 3, "name": "thinker_prefill", "kind": "ar",
         "pd": {"role": "prefill", "decode_stage": 0}},
    ]}, check_processors=False)


class PrefillPool(Pool):
    """The prefill stage: publishes the prompt's rows (``hidden`` 2.0, ``once``) when the
    task publishes; ``finish`` scripts vLLM's finish reason."""

    def __init__(self, outcome: str = "ok", finish: str = "length") -> None:
        super().__init__(3, outcome)
        self.finish = finish

    async def run(self, task, on_rows=None):
        await super().run(task)  # records, fails or blocks as scripted
        payload = ({"hidden": torch.full((len(PROMPT), 2), 2.0), "once": torch.zeros(3)}
                   if task.publish else {})
        return StageRun(list(task.prompt_token_ids), [99], payload, self.finish,
                        dict(PREFILL_ENGINE))


class DecodeEntry(Entry):
    """A decode engine: with ``prefilled`` it publishes only the generated positions; a
    request that pulls KV ends with ``pulled_finish`` (vLLM's ``error`` when the pull
    failed, with no token)."""

    def __init__(self, store: PayloadStore, pulled_finish: str = "length") -> None:
        super().__init__(store)
        self.pulled_finish = pulled_finish

    async def __call__(self, prompt, params, request_id):
        keys = xargs.payload_keys(params.extra_args)
        pulls = "kv_transfer_params" in (params.extra_args or {})
        if pulls and self.pulled_finish == "error":
            self.seen_extra_args.append(dict(params.extra_args))
            completion = SimpleNamespace(token_ids=[], finish_reason="error")
            yield SimpleNamespace(finished=True, prompt_token_ids=PROMPT, outputs=[completion])
            return
        if not keys.prefilled:
            async for out in super().__call__(prompt, params, request_id):
                yield out
            return
        self.seen_extra_args.append(dict(params.extra_args))
        self.store.append(keys.output, {"hidden": torch.full((1, 2), 3.0)})
        # a streamed request (RequestOutputKind.DELTA) gets only the new tokens each time
        delta = params.output_kind == RequestOutputKind.DELTA
        completion = SimpleNamespace(token_ids=list(ENTRY_TOKENS[1:] if delta else ENTRY_TOKENS),
                                     finish_reason="length")
        yield SimpleNamespace(finished=True, prompt_token_ids=PROMPT, outputs=[completion])


def _pd_orchestrator(tmp_path, prefill_outcome="ok", finish="length", pulled_finish="length"):
    pipeline = _pd_pipeline()
    store = PayloadStore(str(tmp_path / "run"))
    pools = {1: Pool(1), 2: Pool(2), 3: PrefillPool(prefill_outcome, finish)}
    upstream_payloads: list = []

    def processor(upstream, stage, request):
        upstream_payloads.append({u.stage_id: dict(u.payload) for u in upstream})
        return StageInput(prompt_token_ids=[1, 2], payload={"x": torch.zeros(1)})

    orchestrator = Orchestrator(
        DecodeEntry(store, pulled_finish), SimpleNamespace(), pipeline, store, pools,
        AdmissionGate({1: 4, 2: 4}, 1.0), {1: processor, 2: processor})
    return orchestrator, upstream_payloads


def test_pd_prefills_on_the_prefill_stage_then_pulls_on_the_entry(tmp_path):
    orchestrator, upstream = _pd_orchestrator(tmp_path)
    request = _audio()
    asyncio.run(_run(orchestrator, request,
                     extra_args={"kv_transfer_params": {"transfer_id": "client-chosen"}}))
    assert request.result.error is None
    (task,) = orchestrator.pools[3].tasks
    assert task.request_id == "req-1-s3" and task.prompt_token_ids == PROMPT and task.publish
    sent = task.sampling["extra_args"]["kv_transfer_params"]
    assert task.sampling["max_tokens"] == 1 and task.sampling["ignore_eos"] is True
    assert sent["do_remote_decode"] is True and sent["transfer_id"] != "client-chosen"
    (seen,) = orchestrator.entry_generate.seen_extra_args
    assert seen["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False,
                                          "transfer_id": sent["transfer_id"], **PREFILL_ENGINE}
    assert seen[xargs.PAYLOAD]["prefilled"] is True
    # the talker sees the prompt's rows from the prefill stage, then the generated ones
    hidden = upstream[0][0]["hidden"]
    assert hidden[:, 0].tolist() == [2.0] * len(PROMPT) + [3.0]
    assert upstream[0][0]["once"].shape == (3,)
    assert orchestrator.store.keys() == [] and orchestrator.runs == {}


def test_pd_text_only_request_prefills_without_publishing(tmp_path):
    orchestrator, _ = _pd_orchestrator(tmp_path)
    outputs = asyncio.run(_run(orchestrator, OmniRequest(),
                               extra_args={"kv_transfer_params": {"do_remote_prefill": True}}))
    assert outputs[-1].finished
    (task,) = orchestrator.pools[3].tasks
    assert task.publish is False
    (seen,) = orchestrator.entry_generate.seen_extra_args
    assert seen["kv_transfer_params"]["transfer_id"] == (
        task.sampling["extra_args"]["kv_transfer_params"]["transfer_id"])
    assert set(seen[xargs.PAYLOAD]) == {"err"}
    assert not orchestrator.pools[1].tasks
    assert orchestrator.store.keys() == [] and orchestrator.runs == {}


def test_pd_transfer_ids_are_fresh_per_request(tmp_path):
    orchestrator, _ = _pd_orchestrator(tmp_path)
    for i in range(3):
        asyncio.run(_run(orchestrator, OmniRequest(), request_id=f"r{i}"))
    ids = {t.sampling["extra_args"]["kv_transfer_params"]["transfer_id"]
           for t in orchestrator.pools[3].tasks}
    assert len(ids) == 3


def test_client_kv_transfer_params_never_reach_the_entry_without_pd(tmp_path):
    orchestrator, _ = _orchestrator(tmp_path)
    asyncio.run(_run(orchestrator, OmniRequest(),
                     extra_args={"kv_transfer_params": {"do_remote_prefill": True}}))
    assert "kv_transfer_params" not in orchestrator.entry_generate.seen_extra_args[0]


@pytest.mark.parametrize("outcome,finish,error", [
    ("fail", "length", "stage 3 (thinker_prefill): worker failed: boom"),
    ("ok", "stop", "stage 3 (thinker_prefill): the prefill engine did not keep the KV cache "
                   "(finish reason 'stop'"),
])
def test_pd_prefill_failure_fails_the_request_naming_the_prefill_stage(
        tmp_path, outcome, finish, error):
    orchestrator, _ = _pd_orchestrator(tmp_path, prefill_outcome=outcome, finish=finish)
    request = _audio()
    asyncio.run(_run(orchestrator, request))
    assert request.result.status == 500 and request.result.error.startswith(error)
    text = OmniRequest()
    with pytest.raises(StageError, match=r"^stage 3 \(thinker_prefill\)"):
        asyncio.run(_run(orchestrator, text, request_id="req-2"))
    assert text.result.error.startswith(error)
    assert orchestrator.entry_generate.seen_extra_args == []  # the entry never ran
    assert orchestrator.store.keys() == [] and orchestrator.runs == {}


def test_pd_failed_kv_load_fails_the_request_naming_the_prefill_engine(tmp_path):
    """The decode engine ends a request whose KV cache did not arrive with vLLM's finish
    reason ``error`` (the connector's transfer timeout, a dead or unreachable prefill
    replica): a 503 naming the prefill stage and engine, no downstream stage runs."""
    orchestrator, upstream = _pd_orchestrator(tmp_path, pulled_finish="error")
    want = (r"^stage 3 \(thinker_prefill\): stage 0 \(thinker\) could not load the prompt's "
            r"KV cache from prefill engine thinker_prefill-abc \(http://127.0.0.1:9\)")
    request = _audio()
    asyncio.run(_run(orchestrator, request))
    assert request.result.status == 503
    assert re.match(want, request.result.error)
    assert upstream == [] and not orchestrator.pools[1].tasks
    text = OmniRequest()
    with pytest.raises(StageError, match=want) as info:
        asyncio.run(_run(orchestrator, text, request_id="req-2"))
    assert info.value.status == 503 and text.result.status == 503
    assert re.match(want, text.result.error)
    assert orchestrator.store.keys() == [] and orchestrator.runs == {}


def test_pd_abort_during_prefill_ends_the_request(tmp_path):
    async def scenario():
        orchestrator, _ = _pd_orchestrator(tmp_path, prefill_outcome="block")
        running = asyncio.create_task(_run(orchestrator, OmniRequest()))
        await until(lambda: orchestrator.pools[3].tasks, LONG_WAIT, what="the prefill task")
        await orchestrator.abort("req-1")
        return orchestrator, await asyncio.wait_for(running, LONG_WAIT)

    orchestrator, outputs = asyncio.run(scenario())
    assert outputs == [] and orchestrator.pools[3].aborted == ["req-1-s3"]
    assert orchestrator.entry_generate.seen_extra_args == []
    assert orchestrator.store.keys() == [] and orchestrator.runs == {}


@pytest.mark.parametrize("prompt", [
    "a text prompt",
    {"type": "multimodal", "prompt_token_ids": PROMPT, "mm_kwargs": {"image": [1]}},
    {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": object()}},
])
def test_pd_prompts_other_than_token_ids_are_prefilled_by_the_entry(tmp_path, prompt):
    from vllm import SamplingParams

    orchestrator, _ = _pd_orchestrator(tmp_path)

    async def scenario():
        with omni_request_scope(OmniRequest()):
            return [o async for o in orchestrator.generate(
                prompt, SamplingParams(max_tokens=4), "req-1")]

    assert asyncio.run(scenario())[-1].finished
    assert orchestrator.pools[3].tasks == []
    assert "kv_transfer_params" not in orchestrator.entry_generate.seen_extra_args[0]


# -- stage-to-stage streaming --------------------------------------------------------
FRAMES = 5


def _streaming_orchestrator(tmp_path, talker, code2wav, first_chunk_size=None):
    """thinker -> talker -> code2wav with ``streaming`` on code2wav (chunks of 2 frames
    after 1 frame of context, the first of ``first_chunk_size``); the processor for code2wav
    passes the chunk's codes, context and place in the stream (``chunk``: first row, last;
    ``stream_id``) on as the task's payload."""
    pipeline = _pipeline(fan_out=False)
    pipeline.stage(2).streaming = StreamingConfig(chunk_size=2, left_context=1,
                                                  first_chunk_size=first_chunk_size)
    store = PayloadStore(str(tmp_path / "run"))

    def to_code2wav(upstream, stage, request):
        (up,) = upstream
        payload = {"codes": up.payload["codes"], "context": torch.tensor([up.context_rows])}
        if up.chunk is not None:
            payload.update(chunk=torch.tensor([up.chunk.first_row, up.chunk.last]),
                           stream_id=up.chunk.stream_id)
        return StageInput(prompt_token_ids=[1], payload=payload)

    orchestrator = Orchestrator(
        Entry(store), SimpleNamespace(), pipeline, store, {1: talker, 2: code2wav},
        AdmissionGate({1: 4, 2: 4}, 1.0),
        {1: _recording_processor([]), 2: to_code2wav})
    return orchestrator


class FrameTalker(Pool):
    """A talker that publishes ``FRAMES`` frames (``codes`` ``[[i]]``) in batches of
    ``batches`` frames, waiting before each batch after the first until code2wav has run
    one more chunk (``live``); or publishes nothing as it goes (``live=False``: a remote
    replica) and returns them all at the end."""

    def __init__(self, live: bool = True, batches: tuple[int, ...] = (2, 2, 1)) -> None:
        super().__init__(1)
        assert sum(batches) == FRAMES
        self.live = live
        self.batches = batches
        self.chunks_ran = 0
        self.chunk_ran = asyncio.Event()
        self.cancelled = False

    async def run(self, task, on_rows=None):
        self.tasks.append(task)
        try:
            first = 0
            for i, size in enumerate(self.batches):
                while self.live and self.chunks_ran < i:
                    self.chunk_ran.clear()
                    await self.chunk_ran.wait()
                if self.live:
                    on_rows.add([{"codes": torch.arange(first, first + size).reshape(-1, 1)}])
                first += size
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return StageRun(list(task.prompt_token_ids), [7] * FRAMES,
                        {"codes": torch.arange(FRAMES).reshape(-1, 1)})


class ChunkDecoder(Pool):
    """code2wav: the waveform of a chunk is its frames after the context, as floats."""

    def __init__(self, talker: FrameTalker, fail: bool = False) -> None:
        super().__init__(2)
        self.talker = talker
        self.fail = fail

    async def run(self, task, on_rows=None):
        self.tasks.append(task)
        if self.fail:
            raise TaskError("decoder broke", 500)
        self.talker.chunks_ran += 1
        self.talker.chunk_ran.set()
        context = int(task.payload["context"][0])
        return StageRun([1], [0], {"waveform": task.payload["codes"][context:, 0].float(),
                                   "sample_rate": torch.tensor([24000])})


def _streamed_audio() -> OmniRequest:
    request = _audio()
    request.partials = asyncio.Queue()
    return request


def _pieces(request: OmniRequest) -> list[list[float]]:
    pieces = []
    while not request.partials.empty():
        pieces.append(request.partials.get_nowait()["waveform"].tolist())
    return pieces


def test_streamed_request_decodes_chunks_while_the_talker_runs(tmp_path):
    talker = FrameTalker()
    decoder = ChunkDecoder(talker)
    orchestrator = _streaming_orchestrator(tmp_path, talker, decoder)
    request = _streamed_audio()
    # the talker waits for each chunk's decode: without streaming this deadlocks
    asyncio.run(asyncio.wait_for(_run(orchestrator, request), 30))
    assert [t.request_id for t in decoder.tasks] == ["req-1-s2-c0", "req-1-s2-c1",
                                                     "req-1-s2-c2"]
    assert [t.payload["codes"][:, 0].tolist() for t in decoder.tasks] == [
        [0, 1], [1, 2, 3], [3, 4]]
    assert [int(t.payload["context"][0]) for t in decoder.tasks] == [0, 1, 1]
    # one stream: the chunks say where they start, and go to one replica
    assert [int(t.payload["chunk"][0]) for t in decoder.tasks] == [0, 2, 4]
    assert {t.payload["stream_id"] for t in decoder.tasks} == {"req-1-s2"}
    assert [t.parent_request_id for t in decoder.tasks] == ["req-1-s2"] * 3
    assert _pieces(request) == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    result = request.result
    assert result.error is None and result.sample_rate == 24000
    assert result.payload["waveform"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert orchestrator.store.keys() == [] and orchestrator.admission.in_flight == {1: 0, 2: 0}
    assert orchestrator.runs == {}


@pytest.mark.parametrize("live", [True, False], ids=["local", "remote"])
def test_a_chunk_covers_every_row_there_is_when_it_starts(tmp_path, live):
    """Rows that came while the previous chunk decoded go into one chunk, even more than
    ``chunk_size`` (2): fewer chunks re-decode less context. A remote talker's rows all
    come at its end."""
    talker = FrameTalker(live, batches=(2, 3))
    decoder = ChunkDecoder(talker)
    orchestrator = _streaming_orchestrator(tmp_path, talker, decoder)
    request = _streamed_audio()
    asyncio.run(asyncio.wait_for(_run(orchestrator, request), 30))
    assert [t.payload["codes"][:, 0].tolist() for t in decoder.tasks] == [
        [0, 1], [1, 2, 3, 4]]
    assert [int(t.payload["context"][0]) for t in decoder.tasks] == [0, 1]
    if not live:  # the talker had ended when each chunk started: the second is the last
        assert [t.payload["chunk"].tolist() for t in decoder.tasks] == [[0, 0], [2, 1]]
    assert _pieces(request) == [[0.0, 1.0], [2.0, 3.0, 4.0]]
    assert request.result.payload["waveform"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert orchestrator.store.keys() == []


def test_first_chunk_size_sets_only_the_first_chunk(tmp_path):
    talker = FrameTalker(batches=(1, 2, 2))
    decoder = ChunkDecoder(talker)
    orchestrator = _streaming_orchestrator(tmp_path, talker, decoder, first_chunk_size=1)
    request = _streamed_audio()
    asyncio.run(asyncio.wait_for(_run(orchestrator, request), 30))
    assert [t.payload["codes"][:, 0].tolist() for t in decoder.tasks] == [
        [0], [0, 1, 2], [2, 3, 4]]
    assert [int(t.payload["context"][0]) for t in decoder.tasks] == [0, 1, 1]
    assert _pieces(request) == [[0.0], [1.0, 2.0], [3.0, 4.0]]
    assert request.result.payload["waveform"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_request_not_streamed_decodes_the_whole_output_once(tmp_path):
    talker = FrameTalker(live=False)
    decoder = ChunkDecoder(talker)
    orchestrator = _streaming_orchestrator(tmp_path, talker, decoder)
    request = _audio()
    asyncio.run(_run(orchestrator, request))
    assert [t.request_id for t in decoder.tasks] == ["req-1-s2"]
    assert "chunk" not in decoder.tasks[0].payload  # not a chunk of a stream
    assert request.result.payload["waveform"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_failed_chunk_stops_the_talker_and_fails_the_request_naming_code2wav(tmp_path):
    talker = FrameTalker()
    orchestrator = _streaming_orchestrator(tmp_path, talker, ChunkDecoder(talker, fail=True))
    request = _streamed_audio()
    asyncio.run(asyncio.wait_for(_run(orchestrator, request), 30))
    assert request.result.error == "stage 2 (code2wav): decoder broke"
    assert talker.cancelled  # its task was stopped mid-way
    assert orchestrator.store.keys() == [] and orchestrator.admission.in_flight == {1: 0, 2: 0}
    assert orchestrator.runs == {}


# -- a stage fed while the entry stage runs (stream_input) ------------------------------
class GrowingEntry:
    """The entry stage publishing one row per position as a worker does (the prompt's,
    then one per fed token) over 4 outputs; after the second it waits until the talker's
    task has started (``talker_started``): a talker that only starts at the end would
    deadlock."""

    def __init__(self, store: PayloadStore, talker_started: asyncio.Event) -> None:
        self.store = store
        self.talker_started = talker_started

    async def __call__(self, prompt, params, request_id):
        out_key = xargs.payload_keys(params.extra_args).output
        self.store.append(out_key, {"hidden": torch.arange(3.0).reshape(3, 1)})
        tokens = []
        for i in range(4):
            tokens.append(20 + i)
            if i:  # the previous token was fed
                self.store.append(out_key, {"hidden": torch.tensor([[10.0 + i]])})
            yield SimpleNamespace(finished=False, prompt_token_ids=PROMPT,
                                  outputs=[SimpleNamespace(token_ids=list(tokens))])
            if i == 1 and self.talker_started is not None:
                await asyncio.wait_for(self.talker_started.wait(), 10)
            await asyncio.sleep(0)
        yield SimpleNamespace(finished=True, prompt_token_ids=PROMPT, outputs=[
            SimpleNamespace(token_ids=list(tokens), finish_reason="length")])


def _fed_processor(upstream, stage, request):
    """Ready for one output token per generated row (none before the first); a tensor
    given once (``once``) and the rows so far."""
    (up,) = upstream
    rows = up.payload["hidden"]
    return StageInput(prompt_token_ids=[1], payload={"rows": rows, "once": torch.ones(1)},
                      ready=None if up.finished else rows.shape[0] - len(PROMPT))


class GrowingTalker(Pool):
    """Takes its input's growth as it comes, then returns."""

    def __init__(self) -> None:
        super().__init__(1)
        self.started = asyncio.Event()
        self.grown = []

    async def run(self, task, on_rows=None):
        self.tasks.append(task)
        self.started.set()
        if self.outcome == "fail":
            raise TaskError("worker failed: boom", 500)
        if task.growth is not None:
            async for more in task.growth:
                self.grown.append(more)
        return StageRun(list(task.prompt_token_ids), [7], {"codes": torch.zeros(1, 1)})


def _fed_orchestrator(tmp_path, streamed: bool):
    pipeline = _pipeline(fan_out=False)
    pipeline.stage(1).stream_input = True
    store = PayloadStore(str(tmp_path / "run"))
    talker = GrowingTalker()
    orchestrator = Orchestrator(
        GrowingEntry(store, talker.started if streamed else None), SimpleNamespace(),
        pipeline, store, {1: talker, 2: Pool(2)}, AdmissionGate({1: 4, 2: 4}, 1.0),
        {1: _fed_processor, 2: _recording_processor([])})
    return orchestrator, talker


def test_stream_input_stage_starts_once_ready_and_gets_only_new_rows(tmp_path):
    orchestrator, talker = _fed_orchestrator(tmp_path, streamed=True)
    request = _streamed_audio()
    asyncio.run(asyncio.wait_for(_run(orchestrator, request), 30))
    assert request.result is not None and request.result.error is None
    (task,) = talker.tasks
    # started on the second output (the first made it ready for 0 tokens)
    assert task.ready == 1 and task.payload["rows"][:, 0].tolist() == [0, 1, 2, 11]
    readies = [more.ready for more in talker.grown]
    assert readies[-1] is None and readies[:-1] == sorted(set(readies[:-1]))
    assert all(r > 1 for r in readies[:-1])
    assert all("once" not in more.payload for more in talker.grown)
    rows = torch.cat([task.payload["rows"]] + [m.payload["rows"] for m in talker.grown
                                               if "rows" in m.payload])
    assert rows[:, 0].tolist() == [0, 1, 2, 11, 12, 13]
    assert orchestrator.store.keys() == [] and orchestrator.admission.in_flight == {1: 0, 2: 0}
    assert orchestrator.runs == {}


def test_request_not_streamed_gives_a_stream_input_stage_its_whole_input(tmp_path):
    orchestrator, talker = _fed_orchestrator(tmp_path, streamed=False)
    request = _audio()
    asyncio.run(asyncio.wait_for(_run(orchestrator, request), 30))
    (task,) = talker.tasks
    assert task.growth is None and task.ready is None and not talker.grown
    assert task.payload["rows"][:, 0].tolist() == [0, 1, 2, 11, 12, 13]


def test_the_entry_feed_copies_each_row_about_once(tmp_path):
    """The API server reads the entry stage's rows for the fed stage after nearly every
    token: it keeps them in buffers that double when full, so 200 chunks move the rows
    O(log 200) times (joining all rows again for each chunk was O(rows²) a request)."""
    from vllm_omni_plugin.engine.streaming import InputStream as _EntryFeed

    store = PayloadStore(str(tmp_path / "run"))
    store.create("k")
    feed = _EntryFeed(store, "k", 0)

    async def read_all():
        seen = []  # every read, kept alive so that no two storages share an address
        for i in range(200):
            store.append("k", {"hidden": torch.full((1, 2), float(i))})
            feed.update(PROMPT, list(range(i + 1)))
            seen.append((await feed.next()).payload["hidden"])
        return seen

    seen = asyncio.run(read_all())
    assert seen[-1][:, 0].tolist() == [float(i) for i in range(200)]
    assert len({t.untyped_storage().data_ptr() for t in seen}) <= 6


def test_a_fed_stage_failing_while_the_entry_runs_fails_the_request(tmp_path):
    orchestrator, talker = _fed_orchestrator(tmp_path, streamed=True)
    talker.outcome = "fail"
    request = _streamed_audio()
    asyncio.run(asyncio.wait_for(_run(orchestrator, request), 30))
    assert request.result.error == "stage 1 (talker): worker failed: boom"
    assert orchestrator.store.keys() == [] and orchestrator.admission.in_flight == {1: 0, 2: 0}
    assert orchestrator.runs == {}


class EntryReplica(Replica):
    """A replica of the entry stage: records each task and returns a scripted run (a
    ``k`` payload), or fails the tasks whose ids are in ``failing``."""

    def __init__(self, replica_id: int, failing: tuple[str, ...] = ()) -> None:
        super().__init__(0, replica_id, f"scripted:{replica_id}")
        self.queue_length = 0
        self.failing = failing
        self.ran: list[StageTask] = []

    async def run(self, task, on_rows=None):
        self.ran.append(task)
        await asyncio.sleep(0)
        if task.request_id in self.failing:
            raise TaskError("worker failed: boom", 500)
        return StageRun(list(task.prompt_token_ids), [9], {"k": torch.ones(3, 2)},
                        finish_reason="length")


def _image_orchestrator(tmp_path, replicas):
    """Stages 0 -> 1 -> 2 with an entry pool of ``replicas`` (round robin) and a
    tokenizer that spells each character's code point."""
    orchestrator, calls = _orchestrator(tmp_path)
    pool = StagePool(0, RoundRobinBalancer(), 0.3)
    for replica in replicas:
        pool.add(replica)
    orchestrator.pools[0] = orchestrator._entry_pool = pool
    orchestrator.tokenize = lambda text: [ord(c) for c in text]
    return orchestrator, calls


def test_a_request_asking_no_text_runs_its_entry_part_and_companions_on_one_replica(
        tmp_path):
    """The entry stage's part of an image request is a task of the entry stage's pool;
    its companion follows it to the same replica, the next request goes to the other
    one (round robin); the head's engine runs nothing, and vLLM's handler gets a final
    output without text."""
    replicas = [EntryReplica(0), EntryReplica(1)]
    orchestrator, calls = _image_orchestrator(tmp_path, replicas)
    seen = []

    def processor(upstream, stage, request):
        seen.append((stage.stage_id, dict(request.companions) or None))
        return StageInput(prompt_token_ids=[1, 2])

    orchestrator.processors = dict.fromkeys(orchestrator.processors, processor)
    for rid in ("img-1", "img-2"):
        request = OmniRequest(modalities=("image",), companions={"neg": "ab"})
        outputs = asyncio.run(_run(orchestrator, request, request_id=rid))
        assert request.result.error is None
        (final,) = outputs
        assert final.finished and final.outputs[0].text == ""
        assert final.outputs[0].token_ids == [9] and final.prompt_token_ids == PROMPT
    assert [[t.request_id for t in r.ran] for r in replicas] == [
        ["img-1-s0", "img-1-neg"], ["img-2-s0", "img-2-neg"]]
    assert replicas[0].ran[1].prompt_token_ids == [ord("a"), ord("b")]
    assert replicas[0].ran[0].sampling["max_tokens"] == 4
    neg = seen[0][1]["neg"]
    assert seen[0][0] == 1 and neg.stage_id == 0 and neg.prompt_token_ids == [97, 98]
    assert orchestrator.entry_generate.seen_extra_args == []
    assert orchestrator.pools[0]._affinity == {}  # nothing remembered after the request
    assert orchestrator.store.keys() == []
    # text is the head engine's
    asyncio.run(_run(orchestrator, _audio()))
    assert len(orchestrator.entry_generate.seen_extra_args) == 1
    assert sum(len(r.ran) for r in replicas) == 4


def test_a_failing_companion_fails_the_request_naming_stage_and_companion(tmp_path):
    orchestrator, _ = _image_orchestrator(tmp_path, [EntryReplica(0, failing=("img-neg",))])
    request = OmniRequest(modalities=("image",), companions={"neg": "ab"})
    asyncio.run(_run(orchestrator, request, request_id="img"))
    assert request.result.status == 500
    assert request.result.error == ("stage 0 (thinker): companion 'neg': worker failed: "
                                    "boom")
    assert not orchestrator.pools[1].tasks


class HangingEntry:
    """An entry stage that never finishes on its own: after one output it waits until
    ``abort`` (vLLM's ``AsyncLLM.abort``), then ends with finish reason ``abort`` as vLLM
    does."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self._abort = asyncio.Event()

    async def __call__(self, prompt, params, request_id):
        completion = SimpleNamespace(token_ids=[ENTRY_TOKENS[0]])
        yield SimpleNamespace(finished=False, prompt_token_ids=PROMPT, outputs=[completion])
        await self._abort.wait()
        completion = SimpleNamespace(token_ids=[ENTRY_TOKENS[0]], finish_reason="abort")
        yield SimpleNamespace(finished=True, prompt_token_ids=PROMPT, outputs=[completion])

    async def abort(self, request_id) -> None:
        self.aborted.append(request_id)
        self._abort.set()


def _timed(store, entry, entry_abort, outcomes=None):
    """An orchestrator with a 0.3 s request timeout."""
    pools = {i: Pool(i, (outcomes or {}).get(i, "ok")) for i in (1, 2)}
    return Orchestrator(entry, SimpleNamespace(), _pipeline(fan_out=False), store, pools,
                        AdmissionGate({1: 4, 2: 4}, 1.0),
                        dict.fromkeys(pools, _recording_processor([])),
                        entry_abort=entry_abort, request_timeout=0.3)


def test_a_request_past_the_request_timeout_is_stopped_everywhere_and_fails_504(tmp_path):
    """Stuck at the talker when --omni-request-timeout passes: the talker's task and the
    entry stage's request are aborted, the request fails with 504 naming the talker, and
    no payload or admission slot is left."""
    store = PayloadStore(str(tmp_path / "run"))
    entry_aborted = []

    async def entry_abort(request_id):
        entry_aborted.append(request_id)

    orchestrator = _timed(store, Entry(store), entry_abort, outcomes={1: "block"})
    request = _audio()
    outputs = asyncio.run(asyncio.wait_for(_run(orchestrator, request), 10))
    assert [o.finished for o in outputs] == [False]  # no final output after the failure
    assert request.result.status == 504
    assert request.result.error == ("stage 1 (talker): the request did not finish within "
                                    "0.3 s (--omni-request-timeout)")
    assert orchestrator.pools[1].aborted == ["req-1-s1"] and not orchestrator.pools[2].tasks
    assert entry_aborted == ["req-1"]
    assert orchestrator.store.keys() == [] and orchestrator.admission.in_flight == {1: 0, 2: 0}
    assert orchestrator.runs == {}


def test_a_text_request_past_the_request_timeout_raises_504_naming_the_entry_stage(tmp_path):
    entry = HangingEntry()
    orchestrator = _timed(PayloadStore(str(tmp_path / "run")), entry, entry.abort)
    request = OmniRequest()
    with pytest.raises(StageError) as info:
        asyncio.run(asyncio.wait_for(_run(orchestrator, request), 10))
    assert info.value.status == 504 and entry.aborted == ["req-1"]
    assert str(info.value) == ("stage 0 (thinker): the request did not finish within 0.3 s "
                               "(--omni-request-timeout)")
    assert request.result.status == 504 and orchestrator.store.keys() == []


def test_a_request_timeout_needs_the_entry_stages_abort(tmp_path):
    pipeline = _pipeline(fan_out=False)
    store = PayloadStore(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="a request timeout needs the entry stage's abort"):
        Orchestrator(Entry(store), None, pipeline, store, {1: Pool(1), 2: Pool(2)},
                     AdmissionGate({1: 1, 2: 1}, 1.0), {1: print, 2: print},
                     request_timeout=1.0)
