"""Placement and memory shares (``config/placement.py``): the environment a placed
engine's workers get, ``--omni-placement auto``'s default devices, the over-commit check
and its error, the start lanes, and every shipped pipeline fitting one GPU and the CPU
build.

GPU hosts are described by a :class:`Host` value (kind, device indices, variable): no GPU
can be had here, and the functions read nothing else of the platform. That the CPU
binding reaches a real engine's worker is checked by ``e2e/test_e2e_serve.py``: the
placed talker's worker's CPU affinity."""

from __future__ import annotations

import pytest
from vllm.engine.arg_utils import EngineArgs

from plugin_tests.conftest import BAGEL_YAML, QWEN3_OMNI_PD_YAML, QWEN3_OMNI_YAML
from vllm_omni_plugin.config.loader import load_pipeline_config
from vllm_omni_plugin.config.pipelines import builtin_pipeline, builtin_pipelines
from vllm_omni_plugin.config.placement import (
    CPU_BIND_ENV,
    CPU_KV_CACHE_ENV,
    EXECUTOR_QUALNAME,
    GIB,
    UNIPROC_EXECUTOR_QUALNAME,
    Host,
    apply_cpu_kv_cache,
    default_devices,
    place_engine,
    placed_executor,
    placement_env,
    plan_head,
    start_lanes,
)
from vllm_omni_plugin.config.schema import StageConfig, StageConfigError
from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.worker.placement import (
    OmniPlacedExecutor,
    OmniPlacedUniProcExecutor,
    apply_placement,
)

CUDA = "CUDA_VISIBLE_DEVICES"


def cpu(n: int, gib: int = 24) -> Host:
    return Host("cpu", tuple(range(n)), CPU_BIND_ENV, gib * GIB)


def gpu(n: int) -> Host:
    return Host("gpu", tuple(range(n)), CUDA)


def _stage(devices=None, **runtime) -> StageConfig:
    return StageConfig.model_validate({"stage_id": 1, "name": "talker", "kind": "ar",
                                       "runtime": {"devices": devices, **runtime}})


def _entry_args(pipeline) -> EngineArgs:
    """The entry engine's arguments after the YAML's, as ``apply_omni_args`` has them."""
    args = EngineArgs(model="m")
    for key, value in pipeline.entry_stage.engine_args.items():
        setattr(args, key, value)
    return args


def test_cpu_cores_split_over_the_ranks():
    assert placement_env("0", 1, cpu(2)) == {CPU_BIND_ENV: "0"}
    assert placement_env("0,1", 1, cpu(2)) == {CPU_BIND_ENV: "0,1"}
    assert placement_env("0,1", 2, cpu(2)) == {CPU_BIND_ENV: "0|1"}


def test_gpu_devices_map_through_the_heads_visible_devices():
    assert placement_env("1", 1, gpu(4), environ={}) == {CUDA: "1"}
    assert placement_env("1", 1, gpu(4), environ={CUDA: "4,5,6,7"}) == {CUDA: "5"}
    assert placement_env("2,3", 2, gpu(4), environ={CUDA: "4, 5,6,7"}) == {CUDA: "6,7"}


@pytest.mark.parametrize("devices, n_ranks, host, message", [
    ("2", 1, cpu(2), "cores [2] are not among this process's CPUs [0, 1]"),
    ("0", 2, cpu(2), "1 cores do not split evenly over the engine's 2 ranks"),
    ("4", 1, gpu(2), "devices [4] are not among the 2 visible GPUs"),
    ("0,1", 1, gpu(2), "2 devices for an engine of 1 ranks"),
], ids=["foreign-core", "uneven-split", "absent-gpu", "gpus-not-one-per-rank"])
def test_bad_devices_are_named(devices, n_ranks, host, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        placement_env(devices, n_ranks, host, environ={})


def test_a_placed_engine_runs_the_plugins_executor_and_errors_name_the_field(monkeypatch):
    args = EngineArgs(model="m")
    assert place_engine(_stage("1"), args, "1", gpu(2), "p.yaml") == {CUDA: "1"}
    assert args.distributed_executor_backend == UNIPROC_EXECUTOR_QUALNAME  # one rank on a GPU
    tp2 = EngineArgs(model="m", tensor_parallel_size=2)
    assert place_engine(_stage("0,1"), tp2, "0,1", gpu(2), "p.yaml") == {CUDA: "0,1"}
    assert tp2.distributed_executor_backend == EXECUTOR_QUALNAME
    untouched = EngineArgs(model="m")
    assert place_engine(_stage(), untouched, None, gpu(2), "p.yaml") is None
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert place_engine(_stage("1"), untouched, "1", gpu(2), "p.yaml") is None
    assert untouched.distributed_executor_backend is None
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    with pytest.raises(StageConfigError) as err:
        place_engine(_stage("0"), EngineArgs(model="m", distributed_executor_backend="ray"),
                     "0", gpu(2), "p.yaml")
    assert str(err.value).startswith("p.yaml: stage 1 ('talker'): field 'runtime.devices': ")
    assert "distributed_executor_backend is 'ray'" in str(err.value)


@pytest.mark.parametrize("n_ranks, host, chosen, expected", [
    (1, gpu(2), None, UNIPROC_EXECUTOR_QUALNAME),  # as vLLM runs one rank unplaced
    (1, gpu(2), "uni", UNIPROC_EXECUTOR_QUALNAME),
    (1, gpu(2), "mp", EXECUTOR_QUALNAME),  # asked for: a worker process of its own
    (2, gpu(2), None, EXECUTOR_QUALNAME),  # tensor parallel: one worker process per rank
    (2, gpu(2), "uni", EXECUTOR_QUALNAME),  # vLLM itself turns uni into mp for several ranks
    (1, cpu(4), None, EXECUTOR_QUALNAME),  # vLLM's CPU build binds OpenMP in worker processes
    (1, cpu(4), "uni", EXECUTOR_QUALNAME),
], ids=["gpu-tp1", "gpu-tp1-uni", "gpu-tp1-mp", "gpu-tp2", "gpu-tp2-uni", "cpu", "cpu-uni"])
def test_the_placing_executor_is_vllms_uniprocess_one_for_one_rank_on_a_gpu(
        n_ranks, host, chosen, expected):
    assert placed_executor(n_ranks, host, chosen) == expected
    executor = {EXECUTOR_QUALNAME: OmniPlacedExecutor,
                UNIPROC_EXECUTOR_QUALNAME: OmniPlacedUniProcExecutor}
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    # the qualified name vLLM resolves is the class, a subclass of vLLM's own executor
    vllm_class = {EXECUTOR_QUALNAME: MultiprocExecutor,
                  UNIPROC_EXECUTOR_QUALNAME: UniProcExecutor}[expected]
    assert issubclass(executor[expected], vllm_class)
    assert executor[expected].supports_async_scheduling()
    assert Executor.get_class(_executor_config(expected)) is executor[expected]


def _executor_config(backend: str):
    """A real ``VllmConfig`` with ``distributed_executor_backend`` set, as vLLM has it
    when it picks the executor class."""
    from vllm.config import ParallelConfig, VllmConfig

    return VllmConfig(parallel_config=ParallelConfig(distributed_executor_backend=backend))


def test_the_placing_executors_set_the_variable_in_the_enginecore_process(monkeypatch):
    from vllm.config import VllmConfig

    settings = OmniSettings(stage_configs_path="/p.yaml").for_stage(1, placement_env={CUDA: "1"})
    config = VllmConfig(additional_config=settings.additional_config())
    environ: dict[str, str] = {}
    assert apply_placement(config, in_process=True, environ=environ) == {CUDA: "1"}
    assert environ == {CUDA: "1"}
    assert apply_placement(VllmConfig(), in_process=True, environ=environ) == {}
    # CUDA initialised before the worker (a fake: there is no CUDA here) would ignore the
    # variable: the uniprocess executor refuses, naming the way out
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="stage 1: cannot place its engine with "
                                           "CUDA_VISIBLE_DEVICES=1: CUDA is already "
                                           r"initialised .* engine_args\."
                                           "distributed_executor_backend: mp"):
        apply_placement(config, in_process=True, environ={})
    assert apply_placement(config, environ=environ) == {CUDA: "1"}  # workers: own processes


def test_the_placement_travels_in_the_stage_settings():
    settings = OmniSettings(stage_configs_path="/p.yaml", devices={1: "1"}).for_stage(
        1, placement_env={CUDA: "1"})
    vllm_config = type("Config", (), {"additional_config": settings.additional_config()})
    restored = OmniSettings.from_vllm_config(vllm_config)
    assert restored.placement_env == {CUDA: "1"} and restored.devices == {1: "1"}


QWEN = [(0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize("stages, host, environ, expected", [
    (QWEN, gpu(1), {}, {0: "0", 1: "0", 2: "0"}),
    (QWEN, gpu(2), {}, {0: "0", 1: "1", 2: "1"}),
    (QWEN, gpu(4), {}, {0: "0", 1: "1", 2: "2"}),
    ([(0, 2), (1, 1), (2, 1)], gpu(2), {}, {0: "0,1", 1: "0", 2: "0"}),
    ([(0, 1), (3, 1), (1, 1), (2, 1)], gpu(2), {}, {0: "0", 3: "1", 1: "1", 2: "1"}),
    (QWEN, cpu(2), {}, {}),
    (QWEN, cpu(3), {}, {0: "0", 1: "1", 2: "1"}),
    (QWEN, cpu(4), {}, {0: "0,1", 1: "2", 2: "2"}),
    (QWEN, cpu(16), {}, {0: "0,1,2,3,4,5,6,7", 1: "8,9,10", 2: "11,12,13"}),
    ([(0, 2), (1, 1)], cpu(5), {}, {0: "0,1", 1: "2,3"}),
    (QWEN, cpu(3), {CPU_BIND_ENV: "0"}, {}),
], ids=["1gpu", "2gpu", "4gpu", "tp2-2gpu", "pd-2gpu", "2cores", "3cores", "4cores",
        "16cores", "tp2-5cores", "cpu-binding-kept"])
def test_auto_placement(stages, host, environ, expected):
    assert default_devices(stages, host, environ) == expected


@pytest.mark.parametrize("name", builtin_pipelines())
@pytest.mark.parametrize("host", [gpu(1), gpu(2), cpu(4)], ids=["1gpu", "2gpu", "cpu"])
def test_every_shipped_pipeline_fits_by_default(name, host):
    """No memory flag: the YAML's shares fit one GPU (and spread over two); on the CPU
    build every stage has a KV cache size (vLLM's default share would be 0.92 each)."""
    pipeline = load_pipeline_config(builtin_pipeline(name))
    devices = plan_head(pipeline, _entry_args(pipeline), "auto", name, host, environ={})
    for stage in pipeline.stages:
        assert stage.engine_args.get("gpu_memory_utilization"), stage.name
        assert stage.runtime.cpu_kv_cache_gib, stage.name
    if host.kind == "gpu" and len(host.devices) == 2:
        assert devices[pipeline.entry_stage.stage_id] == "0"
        assert {d for s, d in devices.items() if s != pipeline.entry_stage.stage_id} <= {"1"}


def test_over_committed_gpu_is_refused_naming_device_stages_and_fix():
    pipeline = load_pipeline_config(QWEN3_OMNI_YAML)
    with pytest.raises(StageConfigError) as err:
        plan_head(pipeline, _with(pipeline, gpu_memory_utilization=0.9), "auto", "q.yaml",
                  gpu(1), environ={CUDA: "3"})
    text = str(err.value)
    assert text.startswith("q.yaml: field 'memory': GPU 3 is over-committed: ")
    for part in ("stage 0 (thinker) 0.9 (--gpu-memory-utilization)",
                 "stage 1 (talker) 0.12 (engine_args.gpu_memory_utilization)",
                 "stage 2 (code2wav) 0.06", "take 1.08 of it", "--omni-placement auto"):
        assert part in text, text
    # the same shares on two GPUs: the thinker alone on the first
    assert plan_head(pipeline, _with(pipeline, gpu_memory_utilization=0.9), "auto", "q.yaml",
                     gpu(2), environ={}) == {0: "0", 1: "1", 2: "1"}
    with pytest.raises(StageConfigError, match="GPU 0 is over-committed"):
        plan_head(pipeline, _with(pipeline, gpu_memory_utilization=0.9), "none", "q.yaml",
                  gpu(2), environ={})


def test_over_committed_host_memory_names_the_kv_cache_sizes():
    pipeline = load_pipeline_config(QWEN3_OMNI_PD_YAML)
    with pytest.raises(StageConfigError) as err:
        plan_head(pipeline, _entry_args(pipeline), "auto", "pd.yaml", cpu(2, gib=24),
                  environ={CPU_KV_CACHE_ENV: "8"})
    text = str(err.value)
    assert "host memory (24 GiB) is over-committed" in text
    assert "stage 3 (thinker_prefill) 0.333 (VLLM_CPU_KVCACHE_SPACE)" in text
    assert "take 1.33 of it" in text and "runtime.cpu_kv_cache_gib" in text


def _with(pipeline, **cli) -> EngineArgs:
    """The entry engine's arguments with ``cli`` set after the YAML's (an explicit flag
    wins over the entry stage's YAML value in ``apply_omni_args``)."""
    args = _entry_args(pipeline)
    for key, value in cli.items():
        setattr(args, key, value)
    return args


def test_replicas_count_once_each():
    pipeline = load_pipeline_config(BAGEL_YAML)
    pipeline.stage(1).runtime.num_replicas = 2
    with pytest.raises(StageConfigError, match=r"stage 1 \(dit\) 2 x 0.5"):
        plan_head(pipeline, _entry_args(pipeline), "none", "b.yaml", gpu(1), environ={})


def test_engines_sharing_a_gpu_start_in_one_lane():
    pipeline = load_pipeline_config(QWEN3_OMNI_YAML)
    plan = [(pipeline.stage(1), 0), (pipeline.stage(2), 0), (pipeline.stage(2), 1)]
    ids = lambda lanes: [[(s.stage_id, r) for s, r in lane] for lane in lanes]  # noqa: E731
    assert ids(start_lanes(plan, {}, gpu(1))) == [[(1, 0), (2, 0), (2, 1)]]
    assert ids(start_lanes(plan, {1: "1", 2: "2"}, gpu(4))) == [[(1, 0)], [(2, 0), (2, 1)]]
    assert ids(start_lanes(plan, {1: "1", 2: "1"}, cpu(2))) == [[(1, 0)], [(2, 0)], [(2, 1)]]


def test_cpu_kv_cache_size_applies_on_the_cpu_build_only():
    args = EngineArgs(model="m")
    apply_cpu_kv_cache(_stage(cpu_kv_cache_gib=1.5), args, gpu(1), environ={})
    assert args.kv_cache_memory_bytes is None
    apply_cpu_kv_cache(_stage(cpu_kv_cache_gib=1.5), args, cpu(2), environ={CPU_KV_CACHE_ENV: "2"})
    assert args.kv_cache_memory_bytes is None  # vLLM applies the variable itself
    apply_cpu_kv_cache(_stage(cpu_kv_cache_gib=1.5), args, cpu(2), environ={})
    assert args.kv_cache_memory_bytes == int(1.5 * GIB)
