"""Where the head's stage engines run and how much of their device each takes, planned
and checked before the entry engine starts.

Devices. A stage's ``runtime.devices`` are device indices: on vLLM's CPU build the CPU
cores its workers run on, on a GPU platform indices into the devices this process sees
(``CUDA_VISIBLE_DEVICES`` order). Stages without them are placed by ``--omni-placement``:

* ``auto`` (default), on ``N`` GPUs: the entry stage on devices ``0 .. r-1`` (``r``: its
  tensor x pipeline parallel size); each other stage (a prefill stage first) on the next
  ``r`` devices the entry stage leaves, cycling over them; with no device left, on the
  entry stage's first ones.
* ``auto`` on vLLM's CPU build, with ``N >= 3`` cores this process may run on and no
  ``VLLM_CPU_OMP_THREADS_BIND`` in the environment (a binding there is kept): the last
  core is left to the processes that are not workers (API server, each engine's
  scheduler loop), as vLLM's own binding reserves one; the entry stage's workers run on
  the first half of the others (rounded up), the other stages' on the rest, each on an
  equal slice of its own when there are as many cores as stages, else all of them.
  With 2 cores vLLM's binding stays (workers on core 0, the rest on core 1): the
  thinker's worker on core 0 and the others' on core 1 was measured at 0.74x its audio
  chat requests/s on the tiny checkpoint at concurrency 8 (``benchmarks/
  placement_bench.py``, medians of 3 trials), core 1 then shared with the API server and
  the schedulers.
* ``none``: vLLM's own default, every engine on device 0 (CPU: vLLM's binding).

Memory. Every engine takes a share of its device, and the shares of the engines on one
device must not exceed it (:func:`check_shares`):

* GPU: ``engine_args.gpu_memory_utilization``, vLLM's fraction of the *whole* device
  per engine (vLLM's default 0.92 when unset). The entry stage's YAML value yields to an
  explicit ``--gpu-memory-utilization``.
* vLLM's CPU build, one device (host memory; NUMA nodes are not told apart): the
  engine's KV cache size, ``runtime.cpu_kv_cache_gib`` (or ``VLLM_CPU_KVCACHE_SPACE``,
  which vLLM applies over it, or ``engine_args.kv_cache_memory_bytes``); without one,
  its ``gpu_memory_utilization`` of host memory, which vLLM's CPU worker then sizes its
  KV cache from.

Starts. Engines that share a GPU start one after another (:func:`start_lanes`): each
engine's memory profile asserts that free memory did not grow while it ran, which a
neighbour finishing its own profile breaks (``vllm/v1/worker/gpu_worker.py``, 0.32).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_omni_plugin.config.schema import PipelineConfig, StageConfig, StageConfigError
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: vLLM's CPU build's worker binding (``VLLM_CPU_OMP_THREADS_BIND`` syntax: cores per
#: local rank, ranks split by ``|``)
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
#: vLLM's CPU build's KV cache size per engine, GiB (vLLM applies it over every engine's
#: ``kv_cache_memory_bytes``: ``vllm/platforms/cpu.py``, 0.30-0.32)
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
GIB = 1 << 30
#: The executors that place an engine (:mod:`vllm_omni_plugin.worker.placement`), named as
#: vLLM's ``distributed_executor_backend`` takes a class: by qualified name (config/ does
#: not import the worker)
EXECUTOR_QUALNAME = "vllm_omni_plugin.worker.placement.OmniPlacedExecutor"
UNIPROC_EXECUTOR_QUALNAME = "vllm_omni_plugin.worker.placement.OmniPlacedUniProcExecutor"
#: ``--omni-placement`` values
PLACEMENT_MODES = ("auto", "none")


@dataclasses.dataclass(frozen=True)
class Host:
    """The devices this process may place engines on.

    Attributes:
        kind: ``"cpu"`` (vLLM's CPU build) or ``"gpu"`` (any other platform).
        devices: CPU: the cores this process may run on; GPU: ``0 .. N-1``.
        env_var: the platform's placement variable: ``VLLM_CPU_OMP_THREADS_BIND`` on the
            CPU build, else ``current_platform.device_control_env_var``.
        memory_bytes: CPU: host memory (bytes); GPU: the smallest device's total memory
            (bytes) where it was read (``current(device_memory=True)``), else 0 (shares
            are fractions there).
    """

    kind: str
    devices: tuple[int, ...]
    env_var: str
    memory_bytes: int = 0

    @property
    def is_cpu(self) -> bool:
        """Whether this is vLLM's CPU build (``kind == "cpu"``)."""
        return self.kind == "cpu"

    @classmethod
    def current(cls, device_memory: bool = False) -> Host:
        """This process's host as vLLM's current platform sees it; on a GPU platform it
        counts the visible devices without initialising the device, and with
        ``device_memory`` reads their total memory as vLLM's own engine arguments do in
        this process (``current_platform.get_device_total_memory``: NVML on CUDA)."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            import psutil

            return cls("cpu", tuple(sorted(os.sched_getaffinity(0))), CPU_BIND_ENV,
                       psutil.virtual_memory().total)
        devices = tuple(range(current_platform.device_count()))
        memory = min((current_platform.get_device_total_memory(d) for d in devices),
                     default=0) if device_memory else 0
        return cls("gpu", devices, current_platform.device_control_env_var, memory)

    def visible(self, environ=os.environ) -> list[str]:
        """The devices this process's placement variable lists (``CUDA_VISIBLE_DEVICES``
        order), empty when it is unset."""
        return [d.strip() for d in environ.get(self.env_var, "").split(",") if d.strip()]

    def name(self, device: int, environ=os.environ) -> str:
        """How errors and logs name ``device``: ``GPU 3`` (its physical index when the
        placement variable maps it), ``host memory``."""
        if self.is_cpu:
            return f"host memory ({self.memory_bytes / GIB:.0f} GiB)"
        visible = self.visible(environ)
        physical = visible[device] if device < len(visible) else str(device)
        return f"GPU {physical}"


def ranks(engine_args: Any) -> int:
    """Tensor x pipeline parallel size of an engine (``EngineArgs`` or a YAML
    ``engine_args`` dict)."""
    get = _field_getter(engine_args)
    return (get("tensor_parallel_size") or 1) * (get("pipeline_parallel_size") or 1)


def _field_getter(engine_args: Any):
    """``name -> value or None`` over an ``EngineArgs`` or a YAML ``engine_args`` dict."""
    if isinstance(engine_args, dict):
        return engine_args.get
    return lambda name: getattr(engine_args, name, None)


def in_process_engines() -> bool:
    """vLLM runs engines in the API server's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    there is no EngineCore process to place."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def placement_env(devices: str, n_ranks: int, host: Host,
                  environ=os.environ) -> dict[str, str]:
    """The environment an engine of ``n_ranks`` ranks on ``devices`` (``"0,1"``) runs its
    workers in.

    CPU: ``{VLLM_CPU_OMP_THREADS_BIND: "0|1"}``, the cores split evenly over the ranks.
    GPU: ``{CUDA_VISIBLE_DEVICES: "2,3"}`` (the platform's variable), one device per rank,
    indices mapped through this process's own value of the variable.

    Raises:
        ValueError: a device this host lacks, or a device count the ranks do not fit.
    """
    wanted = [int(d) for d in devices.split(",")]
    if missing := [d for d in wanted if d not in host.devices]:
        what = ("cores", "this process's CPUs") if host.is_cpu else \
            ("devices", f"the {len(host.devices)} visible GPUs (indices from 0)")
        raise ValueError(f"{what[0]} {missing} are not among {what[1]} "
                         f"{list(host.devices)}")
    if host.is_cpu:
        if len(wanted) % n_ranks:
            raise ValueError(f"{len(wanted)} cores do not split evenly over the engine's "
                             f"{n_ranks} ranks (tensor x pipeline parallel size)")
        per_rank = len(wanted) // n_ranks
        return {host.env_var: "|".join(",".join(map(str, wanted[i:i + per_rank]))
                                       for i in range(0, len(wanted), per_rank))}
    if len(wanted) != n_ranks:
        raise ValueError(f"{len(wanted)} devices for an engine of {n_ranks} ranks (tensor x "
                         "pipeline parallel size): give one device per rank")
    visible = host.visible(environ)
    return {host.env_var: ",".join(visible[d] if visible else str(d) for d in wanted)}


def placed_executor(n_ranks: int, host: Host, chosen: str | None) -> str:
    """The qualified name of the executor that places an engine of ``n_ranks`` ranks
    (tensor x pipeline parallel size) on ``host``, ``chosen`` its
    ``distributed_executor_backend`` so far (:mod:`vllm_omni_plugin.worker.placement`):
    vLLM's uniprocess executor placed (``OmniPlacedUniProcExecutor``) for one rank on a
    GPU, as vLLM runs one rank unplaced, unless ``mp`` was chosen; else its
    multiprocessing executor placed (``OmniPlacedExecutor``): several ranks, ``mp``, and
    vLLM's CPU build (which needs worker processes for its OpenMP binding).

    Raises:
        ValueError: ``chosen`` is an executor that cannot be placed (``ray``, a class).
    """
    if chosen not in (None, "mp", "uni", EXECUTOR_QUALNAME, UNIPROC_EXECUTOR_QUALNAME):
        raise ValueError("placing a stage needs vLLM's multiprocessing or uniprocess "
                         f"executor; distributed_executor_backend is {chosen!r}")
    if host.is_cpu or n_ranks > 1 or chosen in ("mp", EXECUTOR_QUALNAME):
        return EXECUTOR_QUALNAME
    return UNIPROC_EXECUTOR_QUALNAME


def place_engine(stage: StageConfig, engine_args: Any, devices: str | None, host: Host,
                 path: str | None) -> dict[str, str] | None:
    """Point ``engine_args`` (``EngineArgs``) of ``stage`` at the plugin's placing
    executor (:func:`placed_executor`) and return the environment its workers run in
    (:func:`placement_env`); None, and ``engine_args`` untouched, when nothing is placed
    (no devices, or engines in-process).

    Raises:
        StageConfigError: (naming ``path``, the stage and ``runtime.devices``) a device
            this host lacks, a count the ranks do not fit, or a
            ``distributed_executor_backend`` already chosen that cannot be placed.
    """
    if not devices or in_process_engines():
        return None
    try:
        n_ranks = ranks(engine_args)
        env = placement_env(devices, n_ranks, host)
        executor = placed_executor(n_ranks, host, engine_args.distributed_executor_backend)
    except ValueError as exc:
        raise StageConfigError(str(exc), path=path, stage_id=stage.stage_id,
                               stage_name=stage.name, field="runtime.devices") from exc
    engine_args.distributed_executor_backend = executor
    return env


def local_stages(pipeline: PipelineConfig) -> list[StageConfig]:
    """The stages whose engines the head runs itself: the entry stage first, then a
    prefill stage, then the others in data-flow order (stages left to headless
    replicas, ``num_replicas: 0``, excluded)."""
    entry = pipeline.entry_stage
    prefill = pipeline.prefill_stage_for(entry.stage_id)
    rest = [s for s in pipeline.topological_order() if s.stage_id != entry.stage_id]
    return [entry, *([prefill] if prefill is not None else []),
            *(s for s in rest if s.runtime.num_replicas > 0)]


def default_devices(stages: Sequence[tuple[int, int]], host: Host,
                    environ=os.environ) -> dict[int, str]:
    """``--omni-placement auto``: devices for ``stages`` (``(stage_id, ranks)``, the entry
    stage first), as the module docstring says; stages it cannot place are left out."""
    if not stages:
        return {}
    (entry_id, entry_ranks), others = stages[0], stages[1:]
    devices = list(host.devices)
    if host.is_cpu:
        devices = devices[:-1]  # left to the API server and the schedulers
        if len(devices) < 2 or environ.get(CPU_BIND_ENV):
            return {}
        first = len(devices) - len(devices) // 2
        first -= first % entry_ranks
        placed = {entry_id: devices[:first]} if first else {}
        rest = devices[first:] if first else devices
        per = len(rest) // len(others) if others and len(rest) >= len(others) else 0
        for i, (sid, n) in enumerate(others):
            mine = rest[i * per:(i + 1) * per] if per else rest
            mine = mine[:len(mine) - len(mine) % n]
            if mine:
                placed[sid] = mine
    else:
        if len(devices) < entry_ranks:
            return {}
        placed = {entry_id: devices[:entry_ranks]}
        free, nxt = devices[entry_ranks:], 0
        for sid, n in others:
            if len(free) >= n:
                placed[sid] = [free[(nxt + j) % len(free)] for j in range(n)]
                nxt = (nxt + n) % len(free)
            elif len(devices) >= n:
                placed[sid] = devices[:n]
    return {sid: ",".join(map(str, d)) for sid, d in placed.items()}


def plan_devices(pipeline: PipelineConfig, entry_ranks: int, host: Host, mode: str,
                 environ=os.environ) -> dict[int, str]:
    """Devices of every stage the head runs: its ``runtime.devices``, or ``mode``'s
    default (:func:`default_devices`) for those without; a stage absent from the result
    is left to vLLM's default."""
    stages = local_stages(pipeline)
    sizes = [(s.stage_id, entry_ranks if i == 0 else ranks(s.engine_args))
             for i, s in enumerate(stages)]
    auto = default_devices(sizes, host, environ) if mode == "auto" else {}
    planned = {s.stage_id: s.runtime.devices or auto.get(s.stage_id) for s in stages}
    return {sid: d for sid, d in planned.items() if d}


@dataclasses.dataclass(frozen=True)
class EngineShare:
    """One engine's share of each of its devices, for :func:`check_shares`.

    Attributes:
        stage: the engine's stage.
        devices: indices of the devices it runs on (GPU), ``(0,)`` for host memory.
        share: fraction of each device.
        source: where the share was set, for the error (``--gpu-memory-utilization``).
        count: engines like it (the stage's local replicas).
    """

    stage: StageConfig
    devices: tuple[int, ...]
    share: float
    source: str
    count: int = 1


def engine_share(stage: StageConfig, engine_args: Any, devices: str | None, host: Host,
                 count: int = 1, environ=os.environ) -> EngineShare:
    """The share of its device(s) an engine of ``stage`` takes (module docstring):
    ``engine_args`` is the entry engine's ``EngineArgs`` or a YAML ``engine_args`` dict,
    ``count`` the engines like it."""
    from vllm.engine.arg_utils import EngineArgs

    cli = not isinstance(engine_args, dict)
    get = _field_getter(engine_args)
    util = get("gpu_memory_utilization")
    util = float(EngineArgs.gpu_memory_utilization if util is None else util)
    util_source = "--gpu-memory-utilization" if cli else "engine_args.gpu_memory_utilization"
    if not host.is_cpu:
        used = tuple(int(d) for d in devices.split(",")) if devices else \
            tuple(range(ranks(engine_args)))
        return EngineShare(stage, used, util, util_source, count)
    if environ.get(CPU_KV_CACHE_ENV):
        kv, source = float(environ[CPU_KV_CACHE_ENV]) * GIB, CPU_KV_CACHE_ENV
    elif get("kv_cache_memory_bytes"):
        kv, source = float(get("kv_cache_memory_bytes")), "kv_cache_memory_bytes"
    elif stage.runtime.cpu_kv_cache_gib:
        kv, source = stage.runtime.cpu_kv_cache_gib * GIB, "runtime.cpu_kv_cache_gib"
    else:
        return EngineShare(stage, (0,), util, util_source, count)
    return EngineShare(stage, (0,), kv / host.memory_bytes, source, count)


def plan_head(pipeline: PipelineConfig, entry_args: Any, mode: str, path: str | None,
              host: Host | None = None, environ=os.environ) -> dict[int, str]:
    """The devices of every stage the head runs (:func:`plan_devices`), once the shares
    of every device are checked (:func:`check_shares`); ``entry_args`` is the entry
    engine's ``EngineArgs`` after the YAML's.

    Raises:
        StageConfigError: a device is over-committed (names it, the stages and the fix).
    """
    host = host or Host.current()
    entry = pipeline.entry_stage
    devices = plan_devices(pipeline, ranks(entry_args), host, mode, environ)
    shares = [engine_share(entry, entry_args, devices.get(entry.stage_id), host,
                           environ=environ)]
    for stage in local_stages(pipeline)[1:]:
        args = stage.engine_args if not stage.is_prefill else \
            {**stage.engine_args, "tensor_parallel_size": ranks(entry_args)}
        shares.append(engine_share(stage, args, devices.get(stage.stage_id), host,
                                   stage.runtime.num_replicas, environ))
    totals = check_shares(shares, host, path, environ)
    unit = "cores" if host.is_cpu else "GPUs"
    logger.info("placement: %s; memory shares: %s", "; ".join(
        f"stage {s.stage_id} ({s.name}) on "
        f"{unit + ' ' + devices[s.stage_id] if s.stage_id in devices else 'vLLM default'}"
        for s in local_stages(pipeline)), ", ".join(
        f"{host.name(d, environ)} {t:.2f}" for d, t in sorted(totals.items())))
    return devices


def check_shares(engines: Iterable[EngineShare], host: Host, path: str | None,
                 environ=os.environ) -> dict[int, float]:
    """The shares of each device, summed over ``engines``.

    Raises:
        StageConfigError: (naming ``path``) the shares on a device exceed it; the message
            names the device, each stage on it with its share and where it was set.
    """
    on: dict[int, list[EngineShare]] = {}
    for e in engines:
        for d in e.devices:
            on.setdefault(d, []).append(e)
    totals = {d: sum(e.share * e.count for e in es) for d, es in on.items()}
    for d, es in sorted(on.items()):
        if totals[d] > 1.0 + 1e-9:
            parts = ", ".join(
                f"stage {e.stage.stage_id} ({e.stage.name}) "
                f"{f'{e.count} x ' if e.count > 1 else ''}{e.share:.3g} ({e.source})"
                for e in es)
            fix = ("lower the KV cache sizes (runtime.cpu_kv_cache_gib per stage, or "
                   f"{CPU_KV_CACHE_ENV})" if host.is_cpu else
                   "lower the shares (the entry stage's: --gpu-memory-utilization; the "
                   "others': engine_args.gpu_memory_utilization, a fraction of the whole "
                   "device per engine) or place stages on other devices (runtime.devices, "
                   "--omni-placement auto)")
            raise StageConfigError(
                f"{host.name(d, environ)} is over-committed: {parts} take "
                f"{totals[d]:.3g} of it; {fix}", path=path, field="memory")
    return totals


def start_lanes(plan: Sequence[tuple[StageConfig, int]], devices: dict[int, str],
                host: Host) -> list[list[tuple[StageConfig, int]]]:
    """``plan`` (``(stage, replica_id)`` to start) split into lanes that may start side by
    side, each started in order: on a GPU, engines that share a device are in one lane;
    on vLLM's CPU build (no memory profile race) every engine is a lane of its own."""
    if host.is_cpu:
        return [[item] for item in plan]
    lanes: list[tuple[set[int], list]] = []
    for stage, rid in plan:
        used = {int(d) for d in devices[stage.stage_id].split(",")} \
            if devices.get(stage.stage_id) else set(range(ranks(stage.engine_args)))
        joined = [lane for lane in lanes if lane[0] & used]
        merged = (used.union(*(lane[0] for lane in joined)),
                  [item for lane in joined for item in lane[1]] + [(stage, rid)])
        lanes = [lane for lane in lanes if lane not in joined] + [merged]
    return [items for _, items in lanes]


def apply_cpu_kv_cache(stage: StageConfig, engine_args: Any, host: Host,
                       environ=os.environ) -> None:
    """On vLLM's CPU build, ``runtime.cpu_kv_cache_gib`` as the engine's
    ``kv_cache_memory_bytes`` (unless that is set; ``VLLM_CPU_KVCACHE_SPACE`` still wins,
    vLLM applies it over both)."""
    gib = stage.runtime.cpu_kv_cache_gib
    if host.is_cpu and gib and engine_args.kv_cache_memory_bytes is None \
            and not environ.get(CPU_KV_CACHE_ENV):
        engine_args.kv_cache_memory_bytes = int(gib * GIB)
