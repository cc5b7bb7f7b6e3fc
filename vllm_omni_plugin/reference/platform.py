"""``ReferencePlatform``: vLLM's CPU platform, minus its kernels, plus our worker.

Registered through vLLM's ``vllm.platform_plugins`` entry point. vLLM's PyPI
wheel has no CPU kernels, so on a machine without a usable accelerator vLLM
would otherwise resolve ``UnspecifiedPlatform`` and fail. The plugin's
platform activates when

* ``VLLM_OMNI_PLUGIN_BACKEND=reference`` (explicit choice, even on a GPU host), or
* it is ``auto`` (the default), no accelerator is usable (no CUDA device) and
  the command line asks for omni mode (``--stage-configs-path``), the same way
  vLLM itself inspects ``sys.argv`` for ``--omni``.

When it activates it exports ``VLLM_OMNI_PLUGIN_BACKEND=reference`` so engine
and worker processes resolve the same platform, and logs one line. Plain
``vllm serve`` without omni flags is left exactly as vLLM has it.
"""

from __future__ import annotations

import os
import sys

from vllm_omni_plugin import envs

QUALNAME = "vllm_omni_plugin.reference.platform.ReferencePlatform"
WORKER_QUALNAME = "vllm_omni_plugin.reference.worker.ReferenceWorker"


def _accelerator_usable() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken torch install is not an accelerator
        return False


def _omni_requested(argv: list[str]) -> bool:
    return any(a == "--stage-configs-path" or a.startswith("--stage-configs-path=") for a in argv)


def omni_backend() -> str:
    """The backend stage models get in omni mode: ``"reference"`` or
    ``"accelerator"``, from ``VLLM_OMNI_PLUGIN_BACKEND`` and whether an
    accelerator is usable. Raises ``ValueError`` on an unknown setting."""
    backend = envs.backend()
    if backend == "auto":
        return "accelerator" if _accelerator_usable() else "reference"
    return backend


def activate() -> str | None:
    """vLLM platform-plugin hook: the platform qualname, or None to stay out."""
    try:
        if envs.backend() == "auto" and not _omni_requested(sys.argv):
            return None
        if omni_backend() != "reference":
            return None
        from vllm_omni_plugin.compat.version import plugin_enabled

        if not plugin_enabled():  # register() says why, once
            return None
    except Exception:  # unknown backend value, or no vLLM metadata: stay out
        return None
    if os.environ.get(envs.BACKEND) != "reference":
        # Chosen automatically here: export it so child processes agree, and
        # announce it once vLLM's logging is configured (see _announce).
        os.environ[envs.BACKEND] = "reference"
        global _announce_pending
        _announce_pending = True
    return QUALNAME


_announce_pending = False


def _announce() -> None:
    """Log the automatic choice once, in the process that made it.

    Platform plugins are resolved before vLLM attaches its log handlers, so
    the line is emitted from the platform's config hook instead.
    """
    global _announce_pending
    if _announce_pending:
        _announce_pending = False
        from vllm_omni_plugin.logger import init_logger

        init_logger(__name__).info(
            "No accelerator usable: stages run on the vllm-omni-plugin reference backend "
            "(CPU, eager PyTorch). Set %s=accelerator to disable.", envs.BACKEND
        )


def _make_platform():
    from vllm.platforms.cpu import CpuPlatform

    class ReferencePlatform(CpuPlatform):
        """CPU platform whose engines run :class:`ReferenceWorker` in-process."""

        device_name = "cpu"

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            from vllm.config import CompilationMode

            _announce()
            parallel = vllm_config.parallel_config
            if parallel.worker_cls == "auto":
                parallel.worker_cls = WORKER_QUALNAME
            if parallel.world_size > 1:
                raise ValueError(
                    "the reference backend runs one worker per engine; "
                    f"got world size {parallel.world_size} (tensor/pipeline parallel)"
                )
            parallel.distributed_executor_backend = "uni"
            cache = vllm_config.cache_config
            if not cache.user_specified_block_size:
                cache.block_size = 16
            vllm_config.scheduler_config.async_scheduling = False
            compilation = vllm_config.compilation_config
            compilation.mode = CompilationMode.NONE
            compilation.cudagraph_capture_sizes = []
            if vllm_config.model_config is not None:
                vllm_config.model_config.enforce_eager = True

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            import psutil

            return psutil.virtual_memory().total

    return ReferencePlatform


def __getattr__(name: str):
    # vLLM imports the class by qualname; build it lazily so importing this
    # module (in activate()) does not import vLLM's CPU platform.
    if name == "ReferencePlatform":
        cls = _make_platform()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
