"""``--stage-configs-path auto`` on GPUs (``config/auto_plan.py``): for the released
checkpoints the shipped plan that fits the detected devices, or a refusal naming the plan
tool command for them; the default pipeline for the tiny checkpoints and on the CPU
build; and the batch limits (``max_num_seqs``) every shipped pipeline sets per stage.

GPU hosts are :class:`Host` values (kind, device indices, variable, the smallest device's
total memory as NVML reports it): no GPU can be had here. The released checkpoints are
their derived ``config.json`` (:mod:`plugin_tests.released_checkpoints`) with the weights'
size where vLLM's loader finds it: Qwen3-Omni's ``model.safetensors.index.json``
(``metadata.total_size``, the listing's bf16 bytes), BAGEL's two weight files (sparse files
of the listed bytes)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter

import pytest

from plugin_tests.conftest import BAGEL_YAML, QWEN3_OMNI_PD_YAML, QWEN3_OMNI_YAML
from plugin_tests.released_checkpoints import (
    bagel_tensors,
    qwen3_omni_tensors,
    write_released_config,
)
from vllm_omni_plugin.config.auto_plan import Devices, ShippedPlan, choose, shipped_plans
from vllm_omni_plugin.config.loader import load_pipeline_config
from vllm_omni_plugin.config.pipelines import builtin_pipeline, builtin_pipelines
from vllm_omni_plugin.config.placement import CPU_BIND_ENV, GIB, Host
from vllm_omni_plugin.config.schema import StageConfigError

MIB = 1 << 20
#: total memory as NVML (nvidia-smi) reports it: an H100 80GB, an H200 (141 GB), an L40S
H100, H200, L40S = 81_559 * MIB, 143_771 * MIB, 46_068 * MIB
QWEN = "qwen3_omni_moe"


def gpus(count: int, total: int) -> Host:
    return Host("gpu", tuple(range(count)), "CUDA_VISIBLE_DEVICES", total)


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> dict[str, str]:
    """The released checkpoints' configs, with their weights' sizes where vLLM finds
    them (module docstring)."""
    root = tmp_path_factory.mktemp("released")
    qwen = write_released_config("qwen3_omni", str(root / "qwen3_omni"))
    total = sum(2 * math.prod(t.shape) for t in qwen3_omni_tensors().values())
    with open(os.path.join(qwen, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {}}, f)
    bagel = write_released_config("bagel", str(root / "bagel"))
    sizes = Counter()
    for tensor in bagel_tensors().values():
        sizes[tensor.file] += 2 * math.prod(tensor.shape)
    for name, size in sizes.items():
        with open(os.path.join(bagel, name), "wb") as f:
            f.truncate(size)  # sparse: the size without the bytes
    return {"qwen3_omni": qwen, "bagel": bagel}


def _auto(model: str, host: Host, name: str = QWEN, max_model_len: int | None = None,
          auto: bool = True) -> str:
    """The built-in name served for ``auto`` (``auto=False``: the pipeline named)."""
    path = choose(name, builtin_pipeline(name), model, None, host, max_model_len, auto)
    return os.path.basename(path).removesuffix(".yaml")


def test_the_shipped_plans_are_read_from_their_first_line():
    plans = {p.name: p for p in shipped_plans(QWEN)}
    assert set(plans) == {"qwen3_omni_moe_1xh200", "qwen3_omni_moe_2xh100",
                          "qwen3_omni_moe_fp8_1xh100"}
    assert plans["qwen3_omni_moe_2xh100"] == ShippedPlan(
        "qwen3_omni_moe_2xh100", builtin_pipeline("qwen3_omni_moe_2xh100"), QWEN,
        Devices(2, 79.6), 32768, ())
    assert plans["qwen3_omni_moe_fp8_1xh100"].quantization == ("thinker=fp8",)
    assert [p.name for p in shipped_plans("bagel")] == ["bagel_1xh100"]
    assert shipped_plans("qwen3_omni_moe_pd") == []
    assert Devices.of(gpus(2, H100)) == Devices(2, 79.6)
    assert Devices.of(gpus(1, H200)) == Devices(1, 140.4)


@pytest.mark.parametrize("host, expected", [
    (gpus(1, H100), "qwen3_omni_moe_fp8_1xh100"),  # the only plan that fits one 80 GB GPU
    (gpus(1, H200), "qwen3_omni_moe_1xh200"),
    (gpus(2, H100), "qwen3_omni_moe_2xh100"),      # bf16 before the FP8 plan
    (gpus(8, H100), "qwen3_omni_moe_2xh100"),
    (gpus(2, H200), "qwen3_omni_moe_2xh100"),      # planned for the most memory
], ids=["1xh100", "1xh200", "2xh100", "8xh100", "2xh200"])
def test_auto_serves_the_released_qwen3_omni_with_the_plan_that_fits(released, host, expected):
    assert _auto(released["qwen3_omni"], host) == expected
    plan = load_pipeline_config(builtin_pipeline(expected))
    assert plan.entry_stage.engine_args["max_model_len"] == 32768  # what the plan was for


def test_an_fp8_plan_is_served_with_a_warning(released, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_omni_plugin.config.auto_plan"):
        _auto(released["qwen3_omni"], gpus(1, H100))
    assert "serving the plan qwen3_omni_moe_fp8_1xh100" in caplog.text
    assert "quantized online: thinker=fp8" in caplog.text


def test_auto_refuses_devices_no_plan_fits_naming_the_plan_command(released):
    model = released["qwen3_omni"]
    with pytest.raises(StageConfigError) as err:
        _auto(model, gpus(1, L40S))
    text = str(err.value)
    assert f"the qwen3_omni_moe pipeline cannot hold {model}'s 65.7 GiB of weights on " \
           "1 x 44.9 GiB" in text
    assert f"python -m vllm_omni_plugin.tools.plan {model} --pipeline qwen3_omni_moe " \
           "--devices 1x44.9 --write plan.yaml" in text
    assert "qwen3_omni_moe_1xh200 (1 x 140 GiB)" in text and "--stage-configs-path plan.yaml" \
        in text
    # a context longer than any plan's: refused, the command asking for it
    with pytest.raises(StageConfigError, match=r"--devices 1x140.4 --max-model-len 65536 "):
        _auto(model, gpus(1, H200), max_model_len=65536)
    assert _auto(model, gpus(1, H200), max_model_len=16384) == "qwen3_omni_moe_1xh200"


def test_bagel_keeps_its_pipeline_where_its_shares_hold_the_weights(released):
    # 27.4 GiB of weights: within the AR's 0.35 of an H100 (27.9 GiB) and the DiT's 0.5
    assert _auto(released["bagel"], gpus(1, H100), "bagel") == "bagel"
    with pytest.raises(StageConfigError, match="--pipeline bagel --devices 1x44.9 --write"):
        _auto(released["bagel"], gpus(1, L40S), "bagel")


def test_the_tiny_checkpoints_and_the_cpu_build_keep_the_pipeline(
        released, tiny_qwen3_omni, tiny_bagel):
    assert _auto(tiny_qwen3_omni, gpus(1, H100)) == QWEN
    assert _auto(tiny_bagel, gpus(1, L40S), "bagel") == "bagel"
    cpu = Host("cpu", (0, 1), CPU_BIND_ENV, 24 * GIB)
    assert _auto(released["qwen3_omni"], cpu) == QWEN
    assert _auto(tiny_qwen3_omni, cpu) == QWEN
    assert _auto(released["qwen3_omni"], gpus(1, 0)) == QWEN  # memory not reported


def test_the_pipeline_named_outright_stays_with_a_warning(released, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_omni_plugin.config.auto_plan"):
        assert _auto(released["qwen3_omni"], gpus(1, H100), auto=False) == QWEN
    assert "--stage-configs-path qwen3_omni_moe_fp8_1xh100 (or auto)" in caplog.text


def test_vllm_serve_auto_resolves_to_the_plan(released, monkeypatch):
    """``validate_omni_args`` as ``vllm serve --stage-configs-path auto`` runs it; the
    detected host is replaced by one H200 (a fake: no GPU here)."""
    import argparse

    from vllm_omni_plugin.config import cli

    monkeypatch.setattr(cli.Host, "current", classmethod(
        lambda cls, device_memory=False: gpus(1, H200 if device_memory else 0)))
    args = argparse.Namespace(stage_configs_path="auto", model=released["qwen3_omni"],
                              revision=None, max_model_len=None)
    cli.validate_omni_args(args)
    assert args.stage_configs_path == builtin_pipeline("qwen3_omni_moe_1xh200")
    cli.validate_omni_args(args)  # a plan resolves to itself
    assert args.stage_configs_path == builtin_pipeline("qwen3_omni_moe_1xh200")


# -- batch limits ---------------------------------------------------------------------------
#: stage name -> max_num_seqs in the shipped Qwen3-Omni pipelines (their YAML says why)
QWEN_SEQS = {"thinker": 256, "talker": 128, "code2wav": 128, "thinker_prefill": 256}


@pytest.mark.parametrize("path", [QWEN3_OMNI_YAML, QWEN3_OMNI_PD_YAML, BAGEL_YAML,
                                  builtin_pipeline("bagel_replicated")],
                         ids=["qwen3_omni_moe", "qwen3_omni_moe_pd", "bagel", "bagel_replicated"])
def test_every_stage_sets_max_num_seqs_and_admission_follows_it(path):
    """vLLM's GPU default (1,024 from 70 GiB) would size V2's pinned per-request rows and
    the head's admission bound; each stage sets its own, and a downstream stage's
    admission bound is it (no local replica yet: the YAML's)."""
    from vllm_omni_plugin.engine.bootstrap import admission_bound

    pipeline = load_pipeline_config(path)
    for stage in pipeline.stages:
        if stage.kind == "diffusion":
            continue  # the DiT's: the images one of its steps renders, tested with the DiT
        seqs = stage.engine_args.get("max_num_seqs")
        assert seqs, f"{path}: stage {stage.name} sets no max_num_seqs"
        assert seqs == {**QWEN_SEQS, "ar": 256}[stage.name], stage.name
        if stage.inputs:
            assert admission_bound(stage, [], None) == seqs  # max_inflight unset
    for name, path in builtin_pipelines().items():  # the plans write every stage's
        if ShippedPlan.read(name, path) is None:
            continue
        for stage in load_pipeline_config(path).stages:
            assert stage.engine_args.get("max_num_seqs"), (name, stage.name)


def test_explicit_batch_and_length_flags_win_over_the_entry_stages_yaml(tiny_qwen3_omni):
    """``vllm serve`` parsing: the entry stage's YAML ``max_num_seqs`` (and a plan's
    ``max_model_len``) apply unless the command line gives its own."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_omni_plugin

    vllm_omni_plugin.register()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())

    def served(*flags: str):
        args = parser.parse_args(["--model", tiny_qwen3_omni, "--stage-configs-path",
                                  "qwen3_omni_moe_1xh200", *flags])
        engine_args = AsyncEngineArgs.from_cli_args(args)
        return (engine_args.max_num_seqs, engine_args.max_num_batched_tokens,
                engine_args.max_model_len)

    assert served() == (QWEN_SEQS["thinker"], 8192, 32768)  # the plan's
    assert served("--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
                  "--max-model-len", "1024") == (64, 4096, 1024)
