"""``runtime.devices`` on vLLM's CPU build: the value a placed stage's EngineCore sets
``VLLM_CPU_OMP_THREADS_BIND`` to, the executor it is pointed at, and the errors that name
the stage and field. That the binding reaches a real engine's worker is checked by
``e2e/test_e2e_serve.py`` (the talker's worker process runs on its core)."""

from __future__ import annotations

import os

import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform

from vllm_omni_plugin.config.schema import StageConfig, StageConfigError
from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.worker.cpu_placement import QUALNAME, cpu_placement

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(),
                                reason="runtime.devices are CPU cores on vLLM's CPU build only")

CORES = sorted(os.sched_getaffinity(0))


def _stage(devices) -> StageConfig:
    return StageConfig.model_validate({"stage_id": 1, "name": "talker", "kind": "ar",
                                       "runtime": {"devices": devices}})


def test_cores_split_over_the_ranks_and_the_executor_is_the_plugins():
    args = EngineArgs(model="m")
    assert cpu_placement(_stage(CORES[:1]), args, "p.yaml") == str(CORES[0])
    assert args.distributed_executor_backend == QUALNAME
    if len(CORES) >= 2:
        two = ",".join(map(str, CORES[:2]))
        assert cpu_placement(_stage(two), EngineArgs(model="m"), "p.yaml") == two
        assert cpu_placement(_stage(two), EngineArgs(model="m", tensor_parallel_size=2),
                             "p.yaml") == f"{CORES[0]}|{CORES[1]}"


def test_nothing_placed_without_devices_or_with_engines_in_process(monkeypatch):
    args = EngineArgs(model="m")
    assert cpu_placement(_stage(None), args, "p.yaml") is None
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert cpu_placement(_stage(CORES[0]), args, "p.yaml") is None
    assert args.distributed_executor_backend is None  # untouched


@pytest.mark.parametrize("devices, engine_args, message", [
    (max(CORES) + 1, {}, f"cores [{max(CORES) + 1}] are not among this process's CPUs"),
    (CORES[0], {"tensor_parallel_size": 2}, "1 cores do not split evenly over the engine's 2"),
    (CORES[0], {"distributed_executor_backend": "ray"}, "distributed_executor_backend is 'ray'"),
], ids=["foreign-core", "uneven-split", "other-executor"])
def test_bad_placement_names_file_stage_and_field(devices, engine_args, message):
    with pytest.raises(StageConfigError) as err:
        cpu_placement(_stage(devices), EngineArgs(model="m", **engine_args), "p.yaml")
    assert str(err.value).startswith("p.yaml: stage 1 ('talker'): field 'runtime.devices': ")
    assert message in str(err.value)


def test_the_cores_travel_in_the_stage_settings():
    settings = OmniSettings(stage_configs_path="/p.yaml").for_stage(1, cpu_cores="1")
    vllm_config = type("Config", (), {"additional_config": settings.additional_config()})
    assert OmniSettings.from_vllm_config(vllm_config).cpu_cores == "1"
