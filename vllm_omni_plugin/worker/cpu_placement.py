"""Stage placement on vLLM's CPU build: a stage's ``runtime.devices`` are the CPU cores
its workers' OpenMP threads run on.

vLLM's CPU build binds each worker's OpenMP threads itself, from
``VLLM_CPU_OMP_THREADS_BIND`` as read in the EngineCore process when its
``MultiprocExecutor`` spawns the workers (``vllm/utils/ompmultiprocessing.py``,
0.30-0.32): ``auto`` (the default) gives every engine's rank 0 the first core of the
first NUMA node, so the stage engines of one pipeline all compete for one core while
the others idle; ``nobind`` was measured 3-4x slower. The variable is per process, and
the stages of a head start side by side from one process, so it cannot be set around
their starts. Instead each placed stage's engine runs :class:`OmniCPUExecutor`
(vLLM's ``distributed_executor_backend`` extension point, a qualified name): vLLM's own
``MultiprocExecutor`` with the variable set, in its own EngineCore process, to the
stage's cores before the workers are spawned.

On other platforms ``runtime.devices`` is not applied yet (GPU placement is a
deployment matter), and where vLLM runs the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) vLLM binds nothing, so neither does this.
"""

from __future__ import annotations

import os

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from vllm_omni_plugin.config.schema import StageConfigError
from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

QUALNAME = "vllm_omni_plugin.worker.cpu_placement.OmniCPUExecutor"
#: vLLM's variable: OpenMP cores per local rank, ``"0,1|2,3"`` (ranks split by ``|``)
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


class OmniCPUExecutor(MultiprocExecutor):
    """vLLM's ``MultiprocExecutor`` whose workers' OpenMP threads run on the stage's cores
    (``OmniSettings.cpu_cores``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` syntax)."""

    def _init_executor(self) -> None:
        settings = OmniSettings.from_vllm_config(self.vllm_config)
        if settings is not None and settings.cpu_cores:
            os.environ[BIND_ENV] = settings.cpu_cores  # this EngineCore process only
            logger.info("stage %d: workers' OpenMP threads on cores %s", settings.stage_id,
                        settings.cpu_cores)
        super()._init_executor()


def cpu_placement(stage, engine_args, path: str | None) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value for ``stage`` (a ``StageConfig``) placed on
    its ``runtime.devices``, pointing ``engine_args`` at :class:`OmniCPUExecutor`; None
    (and ``engine_args`` untouched) when nothing is to be placed: no devices, not vLLM's
    CPU build, or engines in-process.

    The cores are split evenly over the engine's ranks (tensor times pipeline
    parallel size): ``"0,1"`` with TP 2 is ``"0|1"``.

    Raises:
        StageConfigError: (naming ``path``, the stage and ``runtime.devices``) a core this
            process may not run on, a core count that the ranks do not divide, or another
            ``distributed_executor_backend`` already chosen.
    """
    try:
        return _bind_value(stage.runtime.devices, engine_args)
    except ValueError as exc:
        raise StageConfigError(str(exc), path=path, stage_id=stage.stage_id,
                               stage_name=stage.name, field="runtime.devices") from exc


def _bind_value(devices: str | None, engine_args) -> str | None:
    from vllm.platforms import current_platform

    if not devices or not current_platform.is_cpu() \
            or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        return None
    cores = [int(c) for c in devices.split(",")]
    allowed = sorted(os.sched_getaffinity(0))
    if missing := [c for c in cores if c not in allowed]:
        raise ValueError(f"cores {missing} are not among this process's CPUs {allowed} "
                         "(on vLLM's CPU build, runtime.devices are CPU cores)")
    ranks = (engine_args.tensor_parallel_size or 1) * (engine_args.pipeline_parallel_size or 1)
    if len(cores) % ranks:
        raise ValueError(f"{len(cores)} cores do not split evenly over the engine's "
                         f"{ranks} ranks (tensor x pipeline parallel size)")
    if engine_args.distributed_executor_backend not in (None, "mp", QUALNAME):
        raise ValueError("placing a stage on CPU cores needs vLLM's multiprocessing "
                         "executor; distributed_executor_backend is "
                         f"{engine_args.distributed_executor_backend!r}")
    engine_args.distributed_executor_backend = QUALNAME
    per_rank = len(cores) // ranks
    return "|".join(",".join(map(str, cores[i:i + per_rank]))
                    for i in range(0, len(cores), per_rank))
