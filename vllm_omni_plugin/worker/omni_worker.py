"""``OmniWorker``: the platform's own vLLM worker, plus the stage payload channel.

Selected per stage through vLLM's ``worker_cls`` extension point
(``engine_args.worker_cls: vllm_omni_plugin.worker.omni_worker.OmniWorker`` in the stage
YAML). The class is built when vLLM resolves that name, in the worker process, as a
subclass of the worker the current platform uses (``CPUWorker`` on vLLM's CPU build,
``Worker`` on CUDA/ROCm), so one class serves both: vLLM's model runner does batching,
chunked prefill, the paged KV cache and sampling. The subclass only

* hands a stage model that declares ``uses_stage_step = True`` the step being executed
  (:class:`~vllm_omni_plugin.worker.stage_io.StageStep`: which rows belong to which
  request, each request's input payload and sampling params),
* publishes, after each forward, the stage outputs of requests that carry an output
  payload key (:class:`~vllm_omni_plugin.worker.stage_io.StageIO`), and
* makes a request that failed in the plugin's code emit its stop token.

Requests without payload keys (plain text chat) pass through untouched.
"""

from __future__ import annotations

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from vllm_omni_plugin.compat.model_runner import batch_req_ids
from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import PayloadStore
from vllm_omni_plugin.worker.stage_io import StageIO, StageStep

logger = init_logger(__name__)

QUALNAME = "vllm_omni_plugin.worker.omni_worker.OmniWorker"


class OmniWorkerMixin:
    """Methods layered over the platform worker (see the module docstring)."""

    #: the platform's worker class this one extends (set when the class is built)
    platform_worker: type

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        settings = OmniSettings.from_vllm_config(self.vllm_config)
        store = PayloadStore(settings.payload_dir) if settings and settings.payload_dir \
            else None
        self.omni_io = StageIO(settings.stage_id if settings else 0, store)
        logger.info("stage %d: %s (vLLM's %s with the stage payload channel)",
                    self.omni_io.stage_id, type(self).__name__, self.platform_worker.__name__)

    def execute_model(self, scheduler_output):
        model = _unwrapped(self.model_runner.get_model())
        stepwise = getattr(model, "uses_stage_step", False)
        publishing = self.omni_io.begin_step(scheduler_output, always=stepwise)
        if stepwise:
            model.stage_step = StageStep(self.omni_io, self.model_runner, scheduler_output)
        try:
            output = super().execute_model(scheduler_output)
        finally:
            if stepwise:
                model.stage_step = None
        if publishing and scheduler_output.total_num_scheduled_tokens:
            self.omni_io.publish(model, batch_req_ids(self.model_runner), scheduler_output)
        return self._fix_failed(output)

    def sample_tokens(self, grammar_output):
        return self._fix_failed(super().sample_tokens(grammar_output))

    def _fix_failed(self, output):
        if isinstance(output, ModelRunnerOutput):
            self.omni_io.override_failed(output)
        elif isinstance(output, AsyncModelRunnerOutput):
            return _FixedAsyncOutput(output, self.omni_io)
        return output


def _unwrapped(model):
    """The model itself under vLLM's CUDA-graph wrapper (which has ``unwrap()``)."""
    unwrap = getattr(type(model), "unwrap", None)
    return unwrap(model) if unwrap is not None else model


def _platform_worker_cls() -> type:
    """The worker class vLLM's current platform selects for ``worker_cls="auto"``."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    if current_platform.is_xpu():
        from vllm.v1.worker.xpu_worker import XPUWorker

        return XPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


class _FixedAsyncOutput(AsyncModelRunnerOutput):
    """An async runner output whose failed requests emit their stop token."""

    def __init__(self, inner: AsyncModelRunnerOutput, io: StageIO):
        self._inner, self._io = inner, io

    def get_output(self) -> ModelRunnerOutput:
        output = self._inner.get_output()
        self._io.override_failed(output)
        return output


def __getattr__(name: str):
    # vLLM resolves worker_cls by qualified name in the worker process, after the
    # platform is known; build the subclass then.
    if name == "OmniWorker":
        base = _platform_worker_cls()
        cls = type("OmniWorker", (OmniWorkerMixin, base), {
            "__module__": __name__,
            "__doc__": f"{base.__name__} with the stage payload channel (OmniWorkerMixin).",
            "platform_worker": base,
        })
        globals()[name] = cls
        return cls
    raise AttributeError(name)
