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
* makes a request that failed in the plugin's code emit its stop token, and
* builds the process groups of a single-rank worker on one gloo device
  (:meth:`OmniWorkerMixin.init_device`), and
* sets ``stage_profiling`` on a stage model that declares it while vLLM profiles the
  engine's memory (:meth:`OmniWorkerMixin.determine_available_memory`): such a model
  answers forwards outside a step with zeros, so it runs its largest workload then, and
  the KV cache vLLM sizes from the profile leaves room for that workload's peak; and
* runs that profile itself for a stage model without a KV cache (code2wav, BAGEL's DiT),
  which vLLM never profiles (:meth:`OmniWorkerMixin.compile_or_warm_up_model`), and
  refuses to start when its peak exceeds the engine's share of the device.

Requests without payload keys (plain text chat) pass through untouched.

CUDA graphs replay kernels without running a model's Python, so the worker refuses, at
engine start-up, a graph mode a stage model cannot run under (:func:`check_graph_mode`):
a model that reads its step from Python (``uses_stage_step``) needs no graphs
(``enforce_eager: true``); one that publishes per-position rows needs either no FULL
graphs or rows kept in buffers a replay rewrites (``stage_outputs_graph_safe``, as the
Qwen3-Omni thinker does).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import NamedTuple

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from vllm_omni_plugin.compat.gloo_device import shared_gloo_device
from vllm_omni_plugin.compat.internals import model_runner_of, profile_device_memory
from vllm_omni_plugin.compat.model_runner import batch_req_ids, watch_step
from vllm_omni_plugin.config.placement import GIB
from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import PayloadStore
from vllm_omni_plugin.worker.row_cache import RowBlockIndex, RowCache, row_cache_blocks
from vllm_omni_plugin.worker.stage_io import StageIO, StageStep

logger = init_logger(__name__)


class StageMemoryProfile(NamedTuple):
    """The memory profile the worker ran at start-up for a stage model without a KV
    cache (:meth:`OmniWorkerMixin.compile_or_warm_up_model`).

    Attributes:
        stage_id: the engine's stage.
        model: the stage model's class name.
        peak_bytes: the device memory the engine took at the profile's peak (weights,
            activations, non-torch memory), as vLLM measures its own profiling forward
            (:func:`~vllm_omni_plugin.compat.internals.profile_device_memory`); None
            where the platform has no device memory to measure (vLLM's CPU build).
        share_bytes: the device memory the engine may take (``gpu_memory_utilization``
            of the device), None with ``peak_bytes``.
        seconds: how long the profile ran (wall clock).
    """

    stage_id: int
    model: str
    peak_bytes: int | None
    share_bytes: int | None
    seconds: float


class OmniWorkerMixin:
    """Methods layered over the platform worker (see the module docstring)."""

    #: the platform's worker class this one extends (set when the class is built)
    platform_worker: type
    #: whether this worker publishes the stage outputs (set when the model is loaded)
    omni_publishes = True
    #: whether vLLM ran its memory profile (:meth:`determine_available_memory`)
    omni_vllm_profiled = False
    #: the profile the worker ran itself at start-up (:meth:`compile_or_warm_up_model`)
    omni_memory_profile: StageMemoryProfile | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        settings = OmniSettings.from_vllm_config(self.vllm_config)
        store = PayloadStore(settings.payload_dir) if settings and settings.payload_dir \
            else None
        self.omni_io = StageIO(settings.stage_id if settings else 0, store)
        logger.info("stage %d: %s (vLLM's %s with the stage payload channel)",
                    self.omni_io.stage_id, type(self).__name__, self.platform_worker.__name__)

    def init_device(self, *args, **kwargs):
        """vLLM's device and distributed set-up; a worker of world size 1 builds its gloo
        process groups on one device (:func:`~vllm_omni_plugin.compat.gloo_device.
        shared_gloo_device`): one gloo loop thread instead of 15, so an idle stage worker
        takes no CPU from the stages serving beside it."""
        parallel = self.vllm_config.parallel_config
        with shared_gloo_device(parallel.world_size * parallel.data_parallel_size == 1):
            return super().init_device(*args, **kwargs)

    def load_model(self, *args, **kwargs):
        """vLLM's model loading, then the check that the model's stage outputs survive the
        engine's CUDA graph mode, the choice of the one publishing worker (TP rank 0
        of the last PP rank; :attr:`omni_publishes`), and, for a model that reads its step,
        the tracking of requests without payload keys (:attr:`StageIO.track_plain`), and,
        for a model that publishes rows where its requests may read the prefix cache, the
        row cache (:mod:`~vllm_omni_plugin.worker.row_cache`).

        Raises:
            ValueError: see :func:`check_graph_mode`.
        """
        from vllm.distributed import get_pp_group, get_tp_group

        super().load_model(*args, **kwargs)
        model = _unwrapped(model_runner_of(self).get_model())
        check_graph_mode(model, self.vllm_config.compilation_config.cudagraph_mode,
                         self.omni_io.stage_id)
        # a model that reads its step may fail any of its requests (StageStep.fail)
        self.omni_io.track_plain = getattr(model, "uses_stage_step", False)
        # Every tensor-parallel rank computes the same rows (its outputs are all-reduced)
        # and only the last pipeline-parallel rank computes them at all: one worker
        # publishes, as one returns the step's output to the engine.
        tp, pp = get_tp_group(), get_pp_group()
        self.omni_publishes = tp.rank_in_group == 0 and pp.is_last_rank
        blocks = row_cache_blocks(self.vllm_config) if self.omni_publishes else 0
        if blocks and hasattr(model, "stage_output_rows"):
            # the same index as the scheduler's (OmniScheduler), from the same steps
            self.omni_io.rows = RowCache(RowBlockIndex(
                self.vllm_config.cache_config.block_size, blocks))
        if not self.omni_publishes:
            logger.info("stage %d: worker of TP rank %d, PP rank %d publishes no stage "
                        "outputs (TP rank 0 of the last PP rank does)", self.omni_io.stage_id,
                        tp.rank_in_group, pp.rank_in_group)

    def omni_row_cache_stats(self) -> dict[str, int] | None:
        """The row cache's counts (:meth:`~vllm_omni_plugin.worker.row_cache.RowCache.
        stats`), None on a worker without one; what the head's ``/metrics`` reads, through
        vLLM's ``collective_rpc``."""
        rows = self.omni_io.rows
        return rows.stats() if rows is not None else None

    def determine_available_memory(self):
        """vLLM's memory profile (its profiling forward: ``profile_run``), with
        ``stage_profiling`` set on a stage model that has it (see the module docstring).

        vLLM's EngineCore calls it only for a model with a KV cache
        (``EngineCore._initialize_kv_caches``); :meth:`compile_or_warm_up_model` profiles
        the others."""
        self.omni_vllm_profiled = True
        with stage_profiling(_unwrapped(model_runner_of(self).get_model())):
            return super().determine_available_memory()

    def compile_or_warm_up_model(self):
        """vLLM's warm-up, after the memory profile of a stage model that declares
        ``stage_profiling`` when vLLM ran none (:meth:`determine_available_memory` not
        called: the model has no KV cache, as code2wav and BAGEL's DiT).

        vLLM's EngineCore calls this for every engine at start-up, after allocating the
        KV caches (``EngineCore._initialize_kv_caches``). The profile is vLLM's profiling
        forward (the model runner's ``profile_run``) with ``stage_profiling`` set, so the
        model runs its largest workload, measured as vLLM measures its own profile
        (:func:`~vllm_omni_plugin.compat.internals.profile_device_memory`); the result is
        logged and kept in :attr:`omni_memory_profile`.

        Raises:
            ValueError: the measured peak exceeds the engine's share of its device
                (:func:`check_profile_fits`): start-up fails naming the stage.
        """
        model = _unwrapped(model_runner_of(self).get_model())
        if hasattr(model, "stage_profiling") and not self.omni_vllm_profiled:
            self.omni_memory_profile = self._profile_stage_memory(model)
        return super().compile_or_warm_up_model()

    def _profile_stage_memory(self, model) -> StageMemoryProfile:
        from vllm.config import set_current_vllm_config

        runner = model_runner_of(self)
        name, stage_id = type(model).__name__, self.omni_io.stage_id
        start = time.perf_counter()
        with stage_profiling(model), set_current_vllm_config(self.vllm_config):
            measured = profile_device_memory(self, runner.profile_run)
        peak, share = measured if measured is not None else (None, None)
        profile = StageMemoryProfile(stage_id, name, peak, share, time.perf_counter() - start)
        if peak is None:
            logger.info("stage %d: memory profile of %s (no KV cache, so vLLM runs none) "
                        "ran its largest workload in %.1f s; device memory is not measured "
                        "on this platform", stage_id, name, profile.seconds)
        else:
            logger.info("stage %d: memory profile of %s (no KV cache, so vLLM runs none): "
                        "peak %.2f GiB of the engine's %.2f GiB share, %.1f s", stage_id,
                        name, peak / GIB, share / GIB, profile.seconds)
            check_profile_fits(profile, self.vllm_config.cache_config.gpu_memory_utilization)
        return profile

    def execute_model(self, scheduler_output):
        """vLLM's step, with the plugin's bookkeeping around it: tracks the step's requests
        (:meth:`StageIO.begin_step`), binds a :class:`StageStep` to a model that declares
        ``uses_stage_step`` during the forward, publishes the stage outputs after it (on
        the publishing worker), and makes failed requests emit their stop token."""
        runner = model_runner_of(self)
        model = _unwrapped(runner.get_model())
        stepwise = getattr(model, "uses_stage_step", False)
        publishing = self.omni_io.begin_step(scheduler_output, always=stepwise)
        if stepwise:
            watch_step(runner)
            model.stage_step = StageStep(self.omni_io, runner, scheduler_output)
        try:
            output = super().execute_model(scheduler_output)
        finally:
            if stepwise:
                model.stage_step = None
        if publishing and self.omni_publishes and scheduler_output.total_num_scheduled_tokens:
            self.omni_io.publish(model, batch_req_ids(runner), scheduler_output)
        return self._fix_failed(output)

    def sample_tokens(self, grammar_output):
        """vLLM's sampling, with failed requests' tokens replaced by their stop token."""
        return self._fix_failed(super().sample_tokens(grammar_output))

    def _fix_failed(self, output):
        if isinstance(output, ModelRunnerOutput):
            self.omni_io.override_failed(output)
        elif isinstance(output, AsyncModelRunnerOutput):
            return _FixedAsyncOutput(output, self.omni_io)
        return output


@contextmanager
def stage_profiling(model):
    """``model.stage_profiling`` True meanwhile, when the model has that attribute."""
    if not hasattr(model, "stage_profiling"):
        yield
        return
    model.stage_profiling = True
    try:
        yield
    finally:
        model.stage_profiling = False


def check_profile_fits(profile: StageMemoryProfile, utilization: float) -> None:
    """Refuse a stage whose largest workload does not fit its share of the device.

    Args:
        profile: a measured profile (``peak_bytes`` and ``share_bytes`` set).
        utilization: the engine's ``gpu_memory_utilization``, for the message.

    Raises:
        ValueError: ``peak_bytes > share_bytes``, naming the stage, the model, both
            figures and what to change.
    """
    if profile.peak_bytes <= profile.share_bytes:
        return
    raise ValueError(
        f"stage {profile.stage_id}: {profile.model}'s largest workload (its memory "
        f"profile) peaks at {profile.peak_bytes / GIB:.2f} GiB on its device, more than "
        f"the engine's share, gpu_memory_utilization {utilization:g} = "
        f"{profile.share_bytes / GIB:.2f} GiB: raise this stage's "
        "engine_args.gpu_memory_utilization (python -m vllm_omni_plugin.tools.plan "
        "computes shares that fit), or give it a device with more free memory")


def check_graph_mode(model, cudagraph_mode, stage_id: int) -> None:
    """Refuse a CUDA graph mode under which ``model``'s stage outputs would be wrong.

    Args:
        model: the stage model (unwrapped).
        cudagraph_mode: the engine's ``compilation_config.cudagraph_mode``
            (vLLM's ``CUDAGraphMode``; NONE on vLLM's CPU build and with
            ``enforce_eager``).
        stage_id: for the message.

    Raises:
        ValueError: a model with ``uses_stage_step`` under any graphs, or one with
            ``stage_output_rows`` but not ``stage_outputs_graph_safe`` under FULL graphs
            (a replay would leave the rows of an earlier forward).
    """
    name = type(model).__name__
    if cudagraph_mode is None:  # not resolved: vLLM runs no graphs
        return
    graphs = cudagraph_mode.has_full_cudagraphs() or cudagraph_mode.has_piecewise_cudagraphs()
    if getattr(model, "uses_stage_step", False) and graphs:
        raise ValueError(
            f"stage {stage_id}: {name} reads its inputs from Python in every forward, which "
            f"CUDA graph replay skips (cudagraph_mode {cudagraph_mode.name}): set "
            "enforce_eager: true in this stage's engine_args")
    if (hasattr(model, "stage_output_rows") and cudagraph_mode.has_full_cudagraphs()
            and not getattr(model, "stage_outputs_graph_safe", False)):
        raise ValueError(
            f"stage {stage_id}: {name} keeps its per-position outputs in Python, which FULL "
            f"CUDA graph replay skips (cudagraph_mode {cudagraph_mode.name}): set "
            "compilation_config: {cudagraph_mode: PIECEWISE} or enforce_eager: true in "
            "this stage's engine_args")


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

    def get_kv_connector_output(self):
        """The wrapped output's KV connector output (abstract in vLLM >= 0.33, which reads
        it when ``get_output`` failed); None where the wrapped output has no such method."""
        method = getattr(self._inner, "get_kv_connector_output", None)
        return method() if method is not None else None


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
