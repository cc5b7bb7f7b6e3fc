"""Stage placement inside a stage's EngineCore: the devices its workers run on.

A placed engine (its stage's ``runtime.devices``, or the head's default placement, see
:mod:`vllm_omni_plugin.config.placement`) runs :class:`OmniPlacedExecutor`, named
through vLLM's ``distributed_executor_backend`` extension point (a qualified name):
vLLM's own ``MultiprocExecutor``, which first sets the platform's placement variable in
its EngineCore process. The workers it then spawns inherit it:

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

from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

QUALNAME = "vllm_omni_plugin.worker.placement.OmniPlacedExecutor"


class OmniPlacedExecutor(MultiprocExecutor):
    """vLLM's ``MultiprocExecutor`` whose workers run on the stage's devices
    (``OmniSettings.placement_env``, set in this EngineCore process before they spawn)."""

    def _init_executor(self) -> None:
        settings = OmniSettings.from_vllm_config(self.vllm_config)
        if settings is not None and settings.placement_env:
            os.environ.update(settings.placement_env)  # this EngineCore process only
            logger.info("stage %d: workers placed with %s", settings.stage_id,
                        " ".join(f"{k}={v}" for k, v in settings.placement_env.items()))
        super()._init_executor()
