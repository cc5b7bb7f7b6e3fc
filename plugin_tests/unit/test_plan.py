"""The memory plan tool (``python -m vllm_omni_plugin.tools.plan``): its arithmetic, its
errors, and the plans shipped as built-in pipelines, which are its output for the
released checkpoints (regenerated here from their vendored configs)."""

from __future__ import annotations

import json
import math
import subprocess
from collections import Counter

import pytest

from plugin_tests.conftest import PYTHON, REPO
from plugin_tests.shipped_plans import SHIPPED
from vllm_omni_plugin.config.auto_plan import ShippedPlan
from vllm_omni_plugin.config.loader import load_pipeline_config
from vllm_omni_plugin.config.pipelines import builtin_pipeline
from vllm_omni_plugin.config.schema import StageConfigError
from vllm_omni_plugin.tools.plan import GIB, Devices, Plan, StagePlan, _allocate, make_plan


def _stage(stage_id: int, weights_gib: float, kv_kib: int, max_len: int = 1000,
           seqs: int = 8, devices=(0,), replicas: int = 1) -> StagePlan:
    return StagePlan(stage_id, f"s{stage_id}", devices, replicas, int(weights_gib * GIB),
                     kv_kib * 1024, max_len, seqs, peak=0, overhead=0)


def _plan(gib: float, *stages: StagePlan, count: int = 1) -> Plan:
    plan = Plan("p.yaml", "m", Devices(count, gib), 0.05, list(stages), {})
    return _allocate(plan)


@pytest.mark.parametrize(("text", "devices"), [
    ("2x80", Devices(2, 80.0)), ("1x79.6", Devices(1, 79.6)), ("cpu:4", Devices(1, 4.0, True)),
])
def test_devices_are_count_x_gib_or_host_memory(text, devices):
    assert Devices.parse(text) == devices


@pytest.mark.parametrize("text", ["80", "2x", "0x80", "gpu:4", "cpu:0"])
def test_a_bad_devices_value_is_named(text):
    with pytest.raises(ValueError, match=f"--devices '{text}': expected COUNTxGIB"):
        Devices.parse(text)


def test_room_goes_to_the_kv_caches_in_proportion_up_to_what_they_can_use():
    # 10 GiB: minima 4 + 1 KiB x 1000 (thinker-like) and 1 + 3 KiB x 1000; room 4.5 GiB
    a, b = _stage(0, 4, kv_kib=1), _stage(1, 1, kv_kib=3, seqs=2)
    plan = _plan(10, a, b)
    assert plan.fits
    # b is capped at 2 sequences of 1000 tokens; a takes the rest of the room
    assert b.kv_bytes == b.kv_max == 2 * 3 * 1024 * 1000
    assert a.kv_bytes == a.kv_max  # 8 sequences: still below the room
    assert plan.minimum[0] == pytest.approx((5 * GIB + 4 * 1024 * 1000) / (10 * GIB))
    # each share is its engine's bytes over the device's, rounded down to 0.01
    assert a.share == math.floor((a.fixed + a.kv_bytes) / (10 * GIB) * 100) / 100
    assert a.share + b.share <= 0.95


def test_the_room_is_shared_when_no_cache_is_capped():
    a, b = _stage(0, 1, kv_kib=1, seqs=10**6), _stage(1, 1, kv_kib=1, seqs=10**6)
    _plan(10, a, b)
    assert a.kv_bytes == b.kv_bytes  # equal minima, equal grants
    assert a.kv_bytes + b.kv_bytes + 2 * GIB == pytest.approx(9.5 * GIB, rel=1e-6)


def test_a_plan_that_does_not_fit_says_so_counting_replicas():
    a = _stage(0, 5, kv_kib=1, replicas=2)  # two engines of 5 GiB on a 10 GiB device
    plan = _plan(10, a)
    assert not plan.fits and plan.minimum[0] > 1.0
    b, c = _stage(0, 5, kv_kib=1), _stage(1, 5, kv_kib=1, devices=(1,))
    assert _plan(10, b, c, count=2).fits  # one on each of two devices


def test_an_unknown_stage_to_quantize_is_named():
    with pytest.raises(StageConfigError, match=r"--quantization names no stage of the "
                                               r"pipeline: \['thinkr'\]"):
        make_plan("unused", "qwen3_omni_moe", Devices(1, 80), quantization={"thinkr": "fp8"})


@pytest.fixture(scope="module")
def shipped() -> dict:
    """The plan tool's output for each shipped plan, regenerated (a child process:
    building models needs vLLM's process-global distributed state)."""
    done = subprocess.run([PYTHON, "-m", "plugin_tests.shipped_plans"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1])


def test_the_shipped_plans_are_the_plan_tools_output_and_fit(shipped):
    """Each built-in plan is what the tool writes today for its released checkpoint
    (``python -m plugin_tests.shipped_plans --write`` rewrites them), it fits its
    devices, and it is a valid pipeline."""
    assert set(shipped) == set(SHIPPED)
    for name, result in shipped.items():
        with open(builtin_pipeline(name)) as f:
            assert f.read() == result["yaml"], f"{name}: rerun plugin_tests.shipped_plans --write"
        assert result["fits"], name
        pipeline = load_pipeline_config(builtin_pipeline(name))
        shares = Counter()
        for stage in pipeline.stages:
            shares[stage.runtime.devices or "0"] += stage.engine_args["gpu_memory_utilization"]
        assert max(shares.values()) <= 0.95 + 1e-9, (name, shares)


def test_planned_weights_are_the_released_checkpoints_bytes(shipped):
    """The weights the tool counts (each stage's model built on the meta device) are the
    released Qwen3-Omni's bf16 bytes of that stage's keys, from the vendored listing,
    within 1 % (vLLM's buffers); online FP8 halves the thinker's decoder layers."""
    from plugin_tests.released_checkpoints import qwen3_omni_tensors

    listed = Counter()
    for key, tensor in qwen3_omni_tensors().items():
        listed[key.split(".")[0]] += 2 * math.prod(tensor.shape)
    bf16 = {s["name"]: s for s in shipped["qwen3_omni_moe_1xh200"]["stages"]}
    for name in ("thinker", "talker", "code2wav"):
        assert bf16[name]["weights"] == pytest.approx(listed[name], rel=0.01), name
    fp8 = {s["name"]: s for s in shipped["qwen3_omni_moe_fp8_1xh100"]["stages"]}
    assert fp8["thinker"]["quantization"] == "fp8"
    assert 0.45 < fp8["thinker"]["weights"] / bf16["thinker"]["weights"] < 0.55
    assert fp8["talker"]["weights"] == bf16["talker"]["weights"]
    # 96 KiB of KV cache per thinker token: 48 layers x 2 x 4 KV heads x 128 x 2 bytes
    assert bf16["thinker"]["kv_per_token"] == 48 * 2 * 4 * 128 * 2
    assert bf16["code2wav"]["kv_per_token"] == 0


def test_gpu_plans_use_vllms_gpu_scheduler_defaults_and_write_them(shipped):
    """The plans are computed on vLLM's CPU build, whose scheduler defaults (2,048 tokens /
    128 sequences a step) are not a GPU's: each stage is planned with its YAML's
    ``max_num_seqs`` and ``max_num_batched_tokens``, else vLLM's GPU defaults for the
    device (8,192 / 1,024 on an 80 or 140 GiB GPU), and the plan writes both, so the
    engines run with them."""
    import yaml

    for name, result in shipped.items():
        written = {s["name"]: s["engine_args"] for s in yaml.safe_load(result["yaml"])["stages"]}
        planned = ShippedPlan.read(name, builtin_pipeline(name)).pipeline  # --pipeline
        source = {s.name: s.engine_args
                  for s in load_pipeline_config(builtin_pipeline(planned)).stages}
        for stage in result["stages"]:
            yaml_tokens = source[stage["name"]].get("max_num_batched_tokens")
            assert stage["max_num_batched_tokens"] == (yaml_tokens or 8192), (name, stage)
            yaml_seqs = source[stage["name"]].get("max_num_seqs")
            assert stage["max_num_seqs"] == (yaml_seqs or 1024), (name, stage)
            assert written[stage["name"]]["max_num_batched_tokens"] == \
                stage["max_num_batched_tokens"]
            assert written[stage["name"]]["max_num_seqs"] == stage["max_num_seqs"]


def test_vllms_gpu_batch_defaults_are_read_for_the_planned_device():
    """``EngineArgs.get_batch_defaults`` answered for a GPU of the planned size from vLLM's
    CPU build; vLLM's own answer here (the CPU build's) is untouched."""
    from vllm.engine import arg_utils

    from vllm_omni_plugin.compat.internals import gpu_batch_defaults

    platform = arg_utils.current_platform
    assert gpu_batch_defaults(int(79.6 * GIB)) == (8192, 1024)   # H100 80GB
    assert gpu_batch_defaults(int(140 * GIB), world_size=2) == (8192, 1024)
    assert gpu_batch_defaults(int(44.9 * GIB)) == (2048, 256)    # below 70 GiB
    assert gpu_batch_defaults(80 * GIB, device_name="NVIDIA A100-SXM4-80GB") == (2048, 256)
    assert gpu_batch_defaults(180 * GIB) == (16384, 1024)
    assert arg_utils.current_platform is platform and platform.is_cpu()
    from vllm.usage.usage_lib import UsageContext

    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(1)
    assert (tokens[UsageContext.OPENAI_API_SERVER], seqs[UsageContext.OPENAI_API_SERVER]) \
        == (2048, 128)
