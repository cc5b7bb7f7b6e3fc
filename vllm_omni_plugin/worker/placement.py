"""Stage placement inside a stage's EngineCore: the devices its workers run on.

A placed engine (its stage's ``runtime.devices``, or the head's default placement, see
:mod:`vllm_omni_plugin.config.placement`) runs one of two executors, named through
vLLM's ``distributed_executor_backend`` extension point (a qualified name), each of which
first sets the platform's placement variable in its EngineCore process:

* :class:`OmniPlacedExecutor`, vLLM's own ``MultiprocExecutor``: the worker processes it
  then spawns inherit the variable. Engines of several ranks, and every engine on vLLM's
  CPU build (its OpenMP binding needs worker processes: vLLM turns ``uni`` into ``mp``
  there, ``vllm/platforms/cpu.py``, 0.30-0.32).
* :class:`OmniPlacedUniProcExecutor`, vLLM's own ``UniProcExecutor``: one rank on a GPU,
  its worker in the EngineCore process itself, as vLLM runs such an engine unplaced (no
  worker process, no shared-memory queues). The variable is set before the worker
  initialises the device; CUDA reads it when it initialises in a process, so the
  executor refuses to start where something in the EngineCore process initialised CUDA
  first (the variable would be ignored and the engine would run on the wrong device).

The variable:

* vLLM's CPU build: ``VLLM_CPU_OMP_THREADS_BIND`` (ranks split by ``|``), read when the
  workers start (``vllm/utils/ompmultiprocessing.py``, 0.30-0.32). Its default, ``auto``,
  gives every engine's rank 0 the first core of the first NUMA node, so the stages of
  one pipeline compete for one core while others idle; ``nobind`` was measured 3-4x
  slower.
* a GPU platform: its device-control variable (``current_platform.device_control_env_var``,
  ``CUDA_VISIBLE_DEVICES`` on CUDA): rank ``i`` of the engine sees only the stage's
  ``i``-th device as its device 0 ... n-1 (vLLM's workers take ``cuda:<local rank>``).

The variables are per process, and the head starts its stages side by side from one
process, so they cannot be set around the starts; the EngineCore process, which has not
touched the device, is the place. Where vLLM runs the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) nothing is placed.
"""

from __future__ import annotations

import os

from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


def apply_placement(vllm_config, in_process: bool = False, environ=os.environ) -> dict:
    """Set the stage's placement variables (``OmniSettings.placement_env`` of
    ``vllm_config``) in ``environ``, this EngineCore process's environment, and return
    them (empty when the engine is not placed).

    Args:
        vllm_config: the engine's ``VllmConfig`` (the plugin's settings in its
            ``additional_config``).
        in_process: the worker runs in this process (``UniProcExecutor``): the device
            must not be initialised here yet.
        environ: the environment to set them in (default: this process's).

    Raises:
        RuntimeError: ``in_process`` and CUDA is already initialised in this process; the
            message names the stage and the fix (``distributed_executor_backend: mp``).
    """
    settings = OmniSettings.from_vllm_config(vllm_config)
    if settings is None or not settings.placement_env:
        return {}
    if in_process:
        import torch

        if torch.cuda.is_initialized():
            raise RuntimeError(
                f"stage {settings.stage_id}: cannot place its engine with "
                f"{' '.join(f'{k}={v}' for k, v in settings.placement_env.items())}: CUDA is "
                "already initialised in its EngineCore process, so the variable would be "
                "ignored. Set engine_args.distributed_executor_backend: mp on the stage "
                "(its worker then starts in a process of its own)")
    environ.update(settings.placement_env)  # this EngineCore process only
    logger.info("stage %d: worker%s placed with %s", settings.stage_id,
                "" if in_process else "s",
                " ".join(f"{k}={v}" for k, v in settings.placement_env.items()))
    return settings.placement_env


class OmniPlacedExecutor(MultiprocExecutor):
    """vLLM's ``MultiprocExecutor`` whose workers run on the stage's devices
    (``OmniSettings.placement_env``, set in this EngineCore process before they spawn)."""

    def _init_executor(self) -> None:
        apply_placement(self.vllm_config)
        super()._init_executor()


class OmniPlacedUniProcExecutor(UniProcExecutor):
    """vLLM's ``UniProcExecutor`` (one rank, its worker in the EngineCore process) on the
    stage's device (``OmniSettings.placement_env``, set before the worker initialises
    it; see the module docstring)."""

    def _init_executor(self) -> None:
        apply_placement(self.vllm_config, in_process=True)
        super()._init_executor()
