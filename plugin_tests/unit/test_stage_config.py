"""Pipeline config schema + loader: every error names file, stage and field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from vllm_omni_plugin.config import (
    PipelineConfig,
    StageConfigError,
    load_pipeline_config,
    parse_pipeline_config,
)
from vllm_omni_plugin.config.pipelines import builtin_pipeline
from vllm_omni_plugin.config.schema import StreamingConfig
from vllm_omni_plugin.processors import available_processors, get_plugin_manager, hookimpl

REPO = Path(__file__).resolve().parents[2]
NEEDED = ("thinker2talker", "talker2code2wav")

BASE = {"stages": [
    {"stage_id": 0, "name": "thinker", "kind": "ar",
     "final_output": True, "final_output_type": "text"},
    {"stage_id": 1, "name": "talker", "kind": "ar",
     "inputs": [0], "input_processor": "thinker2talker"},
    {"stage_id": 2, "name": "code2wav", "kind": "generation", "inputs": [1],
     "input_processor": "talker2code2wav", "final_output": True, "final_output_type": "audio"},
]}


@pytest.fixture(autouse=True)
def processors():
    """Make sure the processors the configs name exist (fakes if no built-in yet)."""
    get_plugin_manager.cache_clear()
    missing = {n: (lambda *a: None) for n in NEEDED if n not in available_processors()}
    if missing:
        class Fake:
            @hookimpl
            def omni_register_stage_input_processors(self):
                return missing

        get_plugin_manager().register(Fake(), name="test-fake-processors")
    yield
    get_plugin_manager.cache_clear()


def write(tmp_path: Path, data) -> Path:
    p = tmp_path / "pipe.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def load_error(tmp_path: Path, data) -> StageConfigError:
    p = write(tmp_path, data)
    with pytest.raises(StageConfigError) as ei:
        load_pipeline_config(p)
    assert ei.value.path == str(p)
    assert str(ei.value).startswith(f"{p}: ")
    return ei.value


def mutate(**stage_updates) -> dict:
    """BASE with ``stage_updates={index: {field: value}}`` applied (value None: delete)."""
    d = copy.deepcopy(BASE)
    for idx, upd in stage_updates.items():
        for k, v in upd.items():
            if v is None:
                d["stages"][int(idx[1:])].pop(k)
            else:
                d["stages"][int(idx[1:])][k] = v
    return d


def test_qwen3_omni_config_loads():
    cfg = load_pipeline_config(builtin_pipeline("qwen3_omni_moe"))
    assert cfg.model_type == "qwen3_omni_moe"
    assert [s.name for s in cfg.topological_order()] == ["thinker", "talker", "code2wav"]
    assert cfg.entry_stage.name == "thinker"
    assert [s.stage_id for s in cfg.downstream(0)] == [1] and cfg.downstream(2) == []
    assert [s.final_output_type for s in cfg.final_stages] == ["text", "audio"]
    talker = cfg.stage(1)
    assert talker.engine_args["hf_overrides"]["architectures"] == [
        "OmniPluginQwen3OmniTalker"]
    assert talker.default_sampling_params == {
        "temperature": 0.0, "max_tokens": 2048, "repetition_penalty": 1.05}
    assert cfg.stage(2).kind == "generation" and cfg.stage(2).runtime.num_replicas == 1
    with pytest.raises(KeyError):
        cfg.stage(9)


def test_qwen3_omni_code2wav_streams_chunks_of_the_talker():
    cfg = load_pipeline_config(builtin_pipeline("qwen3_omni_moe"))
    streaming = cfg.stage(2).streaming
    assert (streaming.chunk_size, streaming.left_context, streaming.first_chunk_size) == (
        25, 25, 5)
    assert cfg.stage(1).streaming is None
    # and the talker is fed the thinker's output while the thinker runs
    assert cfg.stage(1).stream_input and not cfg.stage(2).stream_input


def test_streamed_chunks_grow_from_the_first_chunk_size_to_chunk_size():
    config = StreamingConfig(chunk_size=25, left_context=25, first_chunk_size=5)
    assert [config.chunk_rows(previous) for previous in (0, 5, 10, 20, 40)] == [
        5, 10, 20, 25, 25]
    assert StreamingConfig(chunk_size=25).chunk_rows(0) == 25


def test_qwen3_omni_pd_config_loads():
    cfg = load_pipeline_config(builtin_pipeline("qwen3_omni_moe_pd"))
    assert cfg.entry_stage.name == "thinker" and cfg.entry_stage.pd.role == "decode"
    prefill = cfg.prefill_stage_for(0)
    assert prefill.name == "thinker_prefill" and prefill.pd.protocol == "tcp"
    assert cfg.prefill_stage_for(1) is None
    assert [s.name for s in cfg.topological_order()] == ["thinker", "talker", "code2wav"]
    # the same stages as without PD, apart from the pd blocks, the prefill stage, the
    # talker fed while the thinker runs (only without PD), the memory shares (four
    # engines on one GPU) and the thinker's prefix caching and its scheduler for spoken
    # answers' hits (on the prefill role; off on the decode role, whose prompts' KV and
    # rows come from the prefill stage)
    plain = load_pipeline_config(builtin_pipeline("qwen3_omni_moe"))
    assert plain.stage(1).stream_input and not cfg.stage(1).stream_input
    assert plain.stage(0).engine_args["enable_prefix_caching"]
    assert plain.stage(0).engine_args["scheduler_cls"].endswith(".OmniScheduler")
    assert not cfg.stage(0).engine_args["enable_prefix_caching"]
    assert prefill.engine_args["enable_prefix_caching"]
    assert prefill.engine_args["scheduler_cls"] == plain.stage(0).engine_args["scheduler_cls"]

    def unshared(stage) -> dict:
        dump = stage.model_dump(exclude={"pd", "stream_input"})
        for arg in ("gpu_memory_utilization", "enable_prefix_caching", "scheduler_cls"):
            dump["engine_args"].pop(arg, None)
        return dump

    assert [unshared(s) for s in cfg.stages if not s.is_prefill] == [
        unshared(s) for s in plain.stages]


def test_bagel_replicated_config_is_bagel_with_headless_dit_replicas():
    plain = load_pipeline_config(builtin_pipeline("bagel"))
    cfg = load_pipeline_config(builtin_pipeline("bagel_replicated"))
    assert cfg.stage(1).runtime.num_replicas == 0 and plain.stage(1).runtime.num_replicas == 1
    assert [s.model_dump(exclude={"runtime"}) for s in cfg.stages] == [
        s.model_dump(exclude={"runtime"}) for s in plain.stages]


def test_prefill_stage_takes_the_transfer_timeout_of_its_decode_stage():
    cfg = parse_pipeline_config(_pd(decode={"transfer_timeout_s": 12.5}),
                                check_processors=False)
    assert cfg.prefill_stage_for(0).pd.transfer_timeout(30.0) == 12.5
    assert cfg.entry_stage.pd.transfer_timeout(30.0) == 12.5
    default = parse_pipeline_config(_pd(), check_processors=False)
    assert default.prefill_stage_for(0).pd.transfer_timeout(30.0) == 30.0


def _pd(prefill=None, decode=None, extra=()):
    """BASE with a decode role on the thinker and a prefill stage 3."""
    d = mutate(s0={"pd": {"role": "decode", **(decode or {})},
                   "engine_args": {"enable_prefix_caching": False}})
    d["stages"].append({"stage_id": 3, "name": "thinker_prefill", "kind": "ar",
                        "pd": {"role": "prefill", "decode_stage": 0}, **(prefill or {})})
    d["stages"].extend(extra)
    return d


_PREFILL = "stage 3 ('thinker_prefill')"


def _pd_fed_talker():
    """PD on the thinker and a talker fed while the thinker runs."""
    d = _pd()
    d["stages"][1]["stream_input"] = True
    return d


@pytest.mark.parametrize("data, stage, field, fragment", [
    (_pd(prefill={"pd": {"role": "prefill"}}), _PREFILL, "pd.decode_stage", "required"),
    (_pd(prefill={"pd": {"role": "prefill", "decode_stage": 1}}), _PREFILL, "pd.decode_stage",
     "stage 1 is not a stage with pd.role 'decode'"),
    (_pd(prefill={"engine_args": {"block_size": 64}}), _PREFILL, "engine_args.block_size",
     "takes block_size from its decode stage 0"),
    (_pd(prefill={"engine_args": {"kv_transfer_config": {}}}), _PREFILL,
     "engine_args.kv_transfer_config", "set by the plugin"),
    (_pd(prefill={"final_output": True, "final_output_type": "text"}), _PREFILL,
     "final_output", "no inputs, processor"),
    (_pd(prefill={"kind": "generation"}), _PREFILL, "kind", "differs from decode stage 0"),
    (_pd(prefill={"pd": {"role": "prefill", "decode_stage": 0, "protocol": "udp"}}), _PREFILL,
     "pd.protocol", "'rdma' or 'tcp'"),
    (_pd(prefill={"pd": {"role": "prefill", "decode_stage": 0, "max_descs_per_peer": 0}}),
     _PREFILL, "pd.max_descs_per_peer", "greater than or equal to 1"),
    (_pd(decode={"transfer_timeout_s": 0}), "stage 0 ('thinker')", "pd.transfer_timeout_s",
     "greater than 0"),
    (_pd(prefill={"pd": {"role": "prefill", "decode_stage": 0, "transfer_timeout_s": 9}}),
     _PREFILL, "pd.transfer_timeout_s", "set it on decode stage 0"),
    (_pd(decode={"decode_stage": 3}), "stage 0 ('thinker')", "pd.decode_stage",
     "only a prefill stage"),
    (_pd_fed_talker(), "stage 1 ('talker')", "stream_input",
     "is a decode stage (pd); a stage is fed while it runs only without PD"),
    (mutate(s0={"pd": {"role": "decode"}, "engine_args": {"enable_prefix_caching": False}}),
     "stage 0 ('thinker')", "pd.role", "exactly one prefill stage"),
    (mutate(s0={"pd": {"role": "decode"}}), "stage 0 ('thinker')",
     "engine_args.enable_prefix_caching", "must be false on a decode stage"),
    (_pd(extra=[{"stage_id": 4, "name": "second", "kind": "ar",
                 "pd": {"role": "prefill", "decode_stage": 0}}]),
     "stage 0 ('thinker')", "pd.role", "found [3, 4]"),
    (_pd(extra=[{"stage_id": 4, "name": "reader", "kind": "ar", "inputs": [3],
                 "input_processor": "thinker2talker"}]),
     "stage 4 ('reader')", "inputs", "stage 3 is a prefill stage"),
    (mutate(s1={"pd": {"role": "decode"}, "engine_args": {"enable_prefix_caching": False}}),
     "stage 1 ('talker')", "pd.role", "only the entry stage"),
])
def test_pd_validation_errors_name_file_stage_field(tmp_path, data, stage, field, fragment):
    err = load_error(tmp_path, data)
    assert f": {stage}: field '{field}': " in str(err)
    assert fragment in str(err)


def test_topological_order_of_a_diamond(tmp_path):
    d = mutate(s2={"inputs": [1, 3]})
    d["stages"].append({"stage_id": 3, "name": "side", "kind": "ar", "inputs": [0],
                        "input_processor": "thinker2talker", "runtime": {"devices": [0, 1]}})
    cfg = load_pipeline_config(write(tmp_path, d))
    assert [s.stage_id for s in cfg.topological_order()] == [0, 1, 3, 2]
    assert [s.stage_id for s in cfg.downstream(0)] == [1, 3]
    assert cfg.stage(3).runtime.devices == "0,1"


@pytest.mark.parametrize("data, stage, field, fragment", [
    (mutate(s1={"input_processor": "thinker2talkr"}), "stage 1 ('talker')", "input_processor",
     "unknown processor 'thinker2talkr'; available: "),
    (mutate(s1={"inputs": [5]}), "stage 1 ('talker')", "inputs", "input stage 5 does not exist"),
    (mutate(s1={"inputs": [1]}), "stage 1 ('talker')", "inputs", "cannot list itself"),
    (mutate(s1={"inputs": [0, 2]}), "stage 1 ('talker')", "inputs", "cycle: 1 -> 2 -> 1"),
    (mutate(s2={"stage_id": 0}), "stage 0 ('code2wav')", "stage_id", "duplicate stage_id 0"),
    (mutate(s1={"runtime": {"num_replicas": "two"}}), "stage 1 ('talker')",
     "runtime.num_replicas", "valid integer"),
    (mutate(s1={"runtime": {"devices": "gpu0"}}), "stage 1 ('talker')", "runtime.devices",
     "device indices"),
    (mutate(s1={"runtime": {"max_inflight": 0}}), "stage 1 ('talker')", "runtime.max_inflight",
     "greater than or equal to 1"),
    (mutate(s2={"runtime": {"max_restarts": -1}}), "stage 2 ('code2wav')",
     "runtime.max_restarts", "greater than or equal to 0"),
    (mutate(s1={"inputs": ["zero"]}), "stage 1 ('talker')", "inputs[0]", "got 'zero'"),
    (mutate(s1={"kind": "llm"}), "stage 1 ('talker')", "kind", "'ar', 'generation'"),
    (mutate(s1={"inputs": None, "input_processor": None}), "stage 1 ('talker')", "inputs",
     "exactly one entry stage"),
    (mutate(s1={"input_processor": None}), "stage 1 ('talker')", "input_processor", "required"),
    (mutate(s0={"input_processor": "thinker2talker"}), "stage 0 ('thinker')",
     "input_processor", "must be unset"),
    (mutate(s2={"final_output_type": None}), "stage 2 ('code2wav')", "final_output_type",
     "required"),
    (mutate(s1={"imputs": [0]}), "stage 1 ('talker')", "imputs", "did you mean 'inputs'"),
    (mutate(s1={"stage_id": None}), "stages[1]", "stage_id", "Field required"),
    (mutate(s2={"streaming": {"chunk_size": 0}}), "stage 2 ('code2wav')",
     "streaming.chunk_size", "greater than or equal to 1"),
    (mutate(s2={"streaming": {"chunk_size": 25, "left_context": -1}}),
     "stage 2 ('code2wav')", "streaming.left_context", "greater than or equal to 0"),
    (mutate(s2={"streaming": {"chunk_size": 25, "overlap": 2}}), "stage 2 ('code2wav')",
     "streaming.overlap",
     "unknown field; allowed: chunk_size, left_context, first_chunk_size"),
    (mutate(s2={"streaming": {"chunk_size": 25, "first_chunk_size": 0}}),
     "stage 2 ('code2wav')", "streaming.first_chunk_size", "greater than or equal to 1"),
    (mutate(s1={"streaming": {"chunk_size": 25}}), "stage 1 ('talker')", "streaming",
     "only a final-output stage"),
    (mutate(s2={"inputs": [0, 1], "streaming": {"chunk_size": 25}}), "stage 2 ('code2wav')",
     "streaming", "exactly one input stage (inputs: [0, 1])"),
    (mutate(s2={"inputs": [0], "streaming": {"chunk_size": 25}}), "stage 2 ('code2wav')",
     "streaming", "its input stage 0 is the entry stage"),
    (mutate(s2={"stream_input": True}), "stage 2 ('code2wav')", "stream_input",
     "its input stage 1 is not the entry stage 0"),
    (mutate(s2={"inputs": [0, 1], "stream_input": True}), "stage 2 ('code2wav')",
     "stream_input", "exactly one input stage (inputs: [0, 1])"),
    (mutate(s1={"stream_input": "soon"}), "stage 1 ('talker')", "stream_input",
     "valid boolean"),
])
def test_validation_errors_name_file_stage_field(tmp_path, data, stage, field, fragment):
    err = load_error(tmp_path, data)
    assert f": {stage}: field '{field}': " in str(err)
    assert fragment in str(err)
    assert err.field == field


def test_no_final_output(tmp_path):
    d = mutate(s0={"final_output": False, "final_output_type": None},
               s2={"final_output": False, "final_output_type": None})
    err = load_error(tmp_path, d)
    assert err.field == "final_output" and "no stage has 'final_output: true'" in str(err)


def test_unknown_engine_arg_and_sampling_param(tmp_path):
    d = mutate(s1={"engine_args": {"max_modle_len": 4096, "enforce_eager": True},
                   "default_sampling_params": {"temprature": 0.0}})
    err = load_error(tmp_path, d)
    msgs = [str(err)] + [str(e) for e in err.more]
    assert len(msgs) == 2, msgs
    eng = next(m for m in msgs if "engine_args" in m)
    assert "stage 1 ('talker'): field 'engine_args': unknown key 'max_modle_len'" in eng
    assert "did you mean 'max_model_len'" in eng
    samp = next(m for m in msgs if "default_sampling_params" in m)
    assert "unknown key 'temprature' (did you mean 'temperature'" in samp


@pytest.mark.parametrize("text, fragment", [
    ("stages:\n  - stage_id: 0\n   name: x\n", "line 3, column 4: malformed YAML"),
    ("stages: [\n", "line 2"),
    ("stages: []\nstages: []\n", "line 2, column 1: malformed YAML: while constructing a "
     "mapping, found duplicate key 'stages'"),
    ("- 1\n", "top level must be a mapping"),
    ("", "top level must be a mapping"),
    ("stages: []\n", "field 'stages': List should have at least 1 item"),
    ("stages: []\nmodel_typ: x\n", "field 'model_typ': unknown field (did you mean 'model_type'"),
])
def test_file_level_errors(tmp_path, text, fragment):
    assert fragment in str(load_error(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(StageConfigError, match="nope.yaml: file not found"):
        load_pipeline_config(tmp_path / "nope.yaml")


def test_direct_construction_and_no_processor_check():
    with pytest.raises(ValidationError, match="cycle: 1 -> 2 -> 1"):
        PipelineConfig.model_validate(mutate(s1={"inputs": [0, 2]}))
    cfg = parse_pipeline_config(mutate(s1={"input_processor": "later"}), check_processors=False)
    with pytest.raises(StageConfigError, match="x.yaml: stage 1 .*: unknown processor 'later'"):
        cfg.check_processors(["a"], path="x.yaml")
