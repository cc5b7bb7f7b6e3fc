r"""Memory plan of a pipeline on given devices: what each stage's engine needs, the share
of its device to set, and whether it fits.

    python -m vllm_omni_plugin.tools.plan MODEL --pipeline qwen3_omni_moe --devices 2x80 \
        [--max-model-len 32768] [--quantization thinker=fp8] [--write plan.yaml]

``MODEL`` is what ``vllm serve`` takes (a checkpoint directory or a Hugging Face Hub id):
only its ``config.json`` (and, for BAGEL's DiT, its tokenizer) is read, no weights.
``--devices`` is ``COUNTxGIB`` (GPUs, GiB each) or ``cpu:GIB`` (vLLM's CPU build: host
memory for the pipeline).

Per stage (every stage the head runs; replicas counted):

* **weights**: each stage's model as its engine builds it (the shipped pipeline's
  ``engine_args`` and ``hf_overrides``, vLLM's layers), built on the meta device with
  no memory: the bytes of its parameters and buffers at the engine's dtype. Online FP8
  (``--quantization STAGE=fp8``) stores the weights of the layers it quantizes in one
  byte each (vLLM's ``Fp8*OnlineLinearMethod`` / ``MoEMethod``), the others unchanged.
  Tensor parallelism divides them by its size.
* **KV cache per token**: ``2 x num_kv_heads x head_size x dtype bytes`` summed over
  the model's attention layers (vLLM's ``Attention`` modules; 0 for a stage with none),
  and for ``max_model_len`` tokens: vLLM refuses to start an engine whose KV cache
  cannot hold one sequence of that length.
* **batch limits**: ``max_num_batched_tokens`` and ``max_num_seqs``, the pipeline's
  ``engine_args`` where it sets them, else what ``vllm serve`` gives an engine on the
  planned devices: on GPUs vLLM's GPU defaults for a device of that size
  (:func:`~vllm_omni_plugin.compat.internals.gpu_batch_defaults`: 8,192 / 1,024 on an
  80 or 141 GiB GPU; a stage without chunked prefill takes at least ``max_model_len``
  tokens, as vLLM does), whichever platform the tool runs on; on the CPU build its own
  defaults. The plan writes both into every stage's ``engine_args``, so the engines run
  with the limits they were planned for.
* **activation peak**: an estimate of what vLLM's memory profile adds to the weights:
  ``max_num_batched_tokens x (8 x hidden + 2 x ffn) x dtype bytes`` (residual stream,
  norms, q/k/v, attention output; the MLP's gate and up, ``ffn`` the dense intermediate
  size or ``experts per token x moe_intermediate_size``) plus the sampler's float32
  logits and probabilities for ``max_num_seqs`` rows. A stage model whose profile runs
  something else (BAGEL's DiT: a CFG denoising step and the FLUX decoder at the largest
  image) says what (``plan_profile``: tokens in one forward, bytes beyond).
* **overhead**: :data:`ENGINE_OVERHEAD_GIB` per engine for what vLLM counts outside
  the profile (CUDA context, CUDA graph pool, NCCL buffers): an allowance, not a
  measurement; on the CPU build none.

The share of a GPU (``gpu_memory_utilization``, a fraction of the whole device per
engine) is ``(weights + peak + overhead + KV) / device``, where each engine's KV gets at
least ``max_model_len`` tokens and the device's room left after ``--headroom`` goes to
the KV caches in proportion to those minima, each up to ``max_num_seqs`` sequences of
that length (more is never used at once). It fits when the minima of every device
stay within ``1 - headroom``. On the CPU build the KV caches are written as
``runtime.cpu_kv_cache_gib`` instead.

``--write`` writes the pipeline YAML with those shares, the batch limits, the placement
on several GPUs
(``runtime.devices`` as ``--omni-placement auto`` would place the stages on that many)
and the quantization; serve it with ``--stage-configs-path``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from vllm_omni_plugin.compat.internals import (
    attention_kv_shape,
    gpu_batch_defaults,
    quant_method_name,
)
from vllm_omni_plugin.config.auto_plan import PLAN_COMMAND, WRITTEN_BY, Devices
from vllm_omni_plugin.config.placement import GIB

#: per-engine allowance for what vLLM's profile does not count: CUDA context (~0.5 GiB),
#: CUDA graph pool (vLLM logs it after capture, 0.1-1 GiB for these models), NCCL
ENGINE_OVERHEAD_GIB = 1.0
#: share of each device kept free by default (other processes, fragmentation)
HEADROOM = 0.05
#: hidden-size-wide activations per token in the profile estimate (module docstring)
HIDDEN_COPIES = 8


@dataclasses.dataclass
class StagePlan:
    """One stage's engine in the plan (bytes unless named otherwise)."""

    stage_id: int
    name: str
    devices: tuple[int, ...]
    replicas: int
    weights: int
    kv_per_token: int
    max_model_len: int
    max_num_seqs: int
    peak: int
    overhead: int
    quantization: str | None = None
    share: float = 0.0
    kv_bytes: int = 0
    max_num_batched_tokens: int = 0

    @property
    def kv_min(self) -> int:
        """One sequence of ``max_model_len``: less and vLLM refuses to start."""
        return self.kv_per_token * self.max_model_len

    @property
    def kv_max(self) -> int:
        """``max_num_seqs`` sequences of ``max_model_len``: more is never used at once."""
        return self.kv_min * self.max_num_seqs

    @property
    def fixed(self) -> int:
        """What the engine needs besides its KV cache: weights, activation peak and
        overhead."""
        return self.weights + self.peak + self.overhead

    @property
    def kv_tokens(self) -> int:
        """The tokens the planned KV cache (``kv_bytes``) holds; 0 for a stage without
        attention."""
        return self.kv_bytes // self.kv_per_token if self.kv_per_token else 0


@dataclasses.dataclass
class Plan:
    """The memory plan of a pipeline on ``devices``: ``pipeline`` the path of its YAML,
    ``model`` the checkpoint, ``headroom`` the share of each device kept free, and one
    :class:`StagePlan` per stage the head runs."""

    pipeline: str
    model: str
    devices: Devices
    headroom: float
    stages: list[StagePlan]
    #: device index -> fraction its engines' minima take
    minimum: dict[int, float]
    #: the entry stage's ``max_model_len`` asked for (None: the model's)
    max_model_len: int | None = None

    @property
    def fits(self) -> bool:
        """Whether every device's minimum share stays within ``1 - headroom``."""
        return all(m <= 1 - self.headroom + 1e-9 for m in self.minimum.values())


def single_rank(vllm_config) -> None:
    """vLLM's distributed state for one process of one rank (gloo), which building a
    model needs (nothing when it is there already)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.utils.network_utils import get_open_port

    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{get_open_port()}", 0, "gloo")
        initialize_model_parallel(1, 1)


def build_on_meta(vllm_config):
    """The engine's model (the class vLLM's loader would pick), on the meta device at
    the engine's dtype: shapes and dtypes, no memory."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = vllm_config.model_config
    cls, _ = get_model_architecture(model_config)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), \
            torch.device("meta"):
        return cls(vllm_config=vllm_config)


def batch_limits(engine_args: dict, vllm_config, devices: Devices) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` of an engine configured by
    ``vllm_config`` (built on this platform) from a stage's YAML ``engine_args``, when
    it runs on ``devices`` (module docstring): the YAML's values, else vLLM's defaults
    for a GPU of ``devices.gib`` and the engine's world size (at least ``max_model_len``
    tokens without chunked prefill, as ``EngineArgs`` sets them), or, for host memory,
    the configuration's own."""
    scheduler = vllm_config.scheduler_config
    if devices.cpu:
        return scheduler.max_num_batched_tokens, scheduler.max_num_seqs
    tokens, seqs = gpu_batch_defaults(devices.bytes, vllm_config.parallel_config.world_size)
    if not scheduler.enable_chunked_prefill:
        tokens = max(tokens, vllm_config.model_config.max_model_len)
    return (int(engine_args.get("max_num_batched_tokens") or tokens),
            int(engine_args.get("max_num_seqs") or seqs))


def measure_stage(vllm_config, tokens: int | None = None,
                  seqs: int | None = None) -> tuple[int, int, int]:
    """``(weights, kv_per_token, peak)`` bytes of one engine configured by
    ``vllm_config``, its model built on the meta device (module docstring), running up
    to ``tokens`` tokens and ``seqs`` sequences a step (default: the configuration's
    ``max_num_batched_tokens`` and ``max_num_seqs``)."""
    model = build_on_meta(vllm_config)
    model_config = vllm_config.model_config
    weights = 0
    for module in model.modules():
        method = quant_method_name(module) or ""
        for name, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
            one_byte = method.startswith("Fp8") and "Online" in method and \
                name.endswith("weight")
            weights += tensor.numel() * (1 if one_byte else tensor.element_size())
    kv_dtype = model_config.dtype.itemsize
    shapes = [shape for m in model.modules() if (shape := attention_kv_shape(m)) is not None]
    kv_per_token = sum(2 * heads * size * kv_dtype for heads, size in shapes)
    profile = getattr(type(model), "plan_profile", None)
    forward, extra = profile(vllm_config) if profile else (None, 0)
    peak = activation_peak(vllm_config, forward or tokens, seqs) + extra
    tp = vllm_config.parallel_config.tensor_parallel_size
    return weights // tp, kv_per_token // tp, peak


def activation_peak(vllm_config, tokens: int | None = None, seqs: int | None = None) -> int:
    """The module docstring's estimate of an engine's profile peak, bytes, for
    ``tokens`` in one forward and ``seqs`` sampled rows (default: the configuration's
    ``max_num_batched_tokens`` and ``max_num_seqs``)."""
    model_config, scheduler = vllm_config.model_config, vllm_config.scheduler_config
    text = model_config.hf_text_config

    def field(name: str) -> int:
        return int(getattr(text, name, 0) or 0)

    ffn = max(field("intermediate_size"),
              field("num_experts_per_tok") * field("moe_intermediate_size"))
    hidden = model_config.get_hidden_size()
    return ((tokens or scheduler.max_num_batched_tokens) * (HIDDEN_COPIES * hidden + 2 * ffn)
            * model_config.dtype.itemsize
            + (seqs or scheduler.max_num_seqs) * model_config.get_vocab_size() * 4 * 2)


def engine_configs(pipeline, path: str, base: dict, stages=None):
    """``(stage, VllmConfig)`` of ``stages`` (default: every stage the head runs) of
    ``pipeline`` (loaded from ``path``), as ``vllm serve`` configures their engines
    over ``base`` (``EngineArgs`` fields: ``model``, ``dtype``; ``max_model_len`` only
    for the entry stage)."""
    from vllm_omni_plugin.config.placement import local_stages
    from vllm_omni_plugin.config.settings import OmniSettings
    from vllm_omni_plugin.replicas.engines import stage_engine_config

    settings = OmniSettings(stage_configs_path=path)
    entry = pipeline.entry_stage.stage_id
    for stage in stages or local_stages(pipeline):
        args = {k: v for k, v in base.items() if k != "max_model_len" or
                stage.stage_id == entry}
        yield stage, stage_engine_config(stage, args, settings)


def make_plan(model: str, pipeline_name: str, devices: Devices, *,
              max_model_len: int | None = None, dtype: str = "bfloat16",
              quantization: dict[str, str] | None = None,
              headroom: float = HEADROOM) -> Plan:
    """The plan of ``pipeline_name`` (a built-in name or a YAML path) serving ``model``
    on ``devices``.

    Raises:
        StageConfigError: the pipeline is invalid, or a stage of ``quantization`` is
            not in it.
        RuntimeError: vLLM refused a stage's configuration (names the stage).
    """
    from vllm_omni_plugin.config.loader import load_pipeline_config
    from vllm_omni_plugin.config.pipelines import resolve_stage_configs
    from vllm_omni_plugin.config.placement import plan_devices, ranks
    from vllm_omni_plugin.config.schema import StageConfigError

    path = resolve_stage_configs(pipeline_name, model)
    pipeline = load_pipeline_config(path)
    quantization = quantization or {}
    unknown = set(quantization) - {s.name for s in pipeline.stages}
    if unknown:
        raise StageConfigError(f"--quantization names no stage of the pipeline: "
                               f"{sorted(unknown)}", path=path, field="quantization")
    for stage in pipeline.stages:
        if stage.name in quantization:
            stage.engine_args["quantization"] = quantization[stage.name]
    host = devices.host()
    placed = {} if devices.cpu else plan_devices(
        pipeline, ranks(pipeline.entry_stage.engine_args), host, "auto", environ={})
    base = {"model": model, "dtype": dtype,
            **({"max_model_len": max_model_len} if max_model_len else {})}
    stages: list[StagePlan] = []
    for stage, vllm_config in engine_configs(pipeline, path, base):
        single_rank(vllm_config)
        tokens, seqs = batch_limits(stage.engine_args, vllm_config, devices)
        weights, kv_per_token, peak = measure_stage(vllm_config, tokens, seqs)
        used = tuple(int(d) for d in placed[stage.stage_id].split(",")) \
            if stage.stage_id in placed else (0,)
        stages.append(StagePlan(
            stage.stage_id, stage.name, used, max(1, stage.runtime.num_replicas), weights,
            kv_per_token, vllm_config.model_config.max_model_len, seqs, peak,
            0 if devices.cpu else int(ENGINE_OVERHEAD_GIB * GIB),
            vllm_config.model_config.quantization, max_num_batched_tokens=tokens))
    return _allocate(Plan(path, model, devices, headroom, stages, {}, max_model_len))


def _allocate(plan: Plan) -> Plan:
    """Each engine's KV cache and share (module docstring), per device."""
    size = plan.devices.bytes
    for device in sorted({d for s in plan.stages for d in s.devices}):
        on = [s for s in plan.stages if device in s.devices]
        need = sum((s.fixed + s.kv_min) * s.replicas for s in on)
        plan.minimum[device] = need / size
        room = max(0.0, (1 - plan.headroom) * size - need)
        open_ = [s for s in on if s.kv_per_token]
        for s in on:
            s.kv_bytes = s.kv_min
        while open_ and room > 0:  # in proportion to the minima, each up to its most
            total = sum(s.kv_min * s.replicas for s in open_)
            grants = {id(s): min(room * s.kv_min / total, s.kv_max - s.kv_bytes)
                      for s in open_}
            for s in open_:
                s.kv_bytes += int(grants[id(s)])
            room -= sum(grants[id(s)] * s.replicas for s in open_)
            still = [s for s in open_ if s.kv_bytes < s.kv_max - s.kv_per_token]
            if len(still) == len(open_):
                break
            open_ = still
        for s in on:
            s.share = math.floor((s.fixed + s.kv_bytes) / size * 100) / 100
    return plan


def plan_yaml(plan: Plan, command: str) -> str:
    """The pipeline YAML of ``plan.pipeline`` with the plan's shares (GPU) or KV cache
    sizes (CPU), batch limits, devices and quantization, headed by ``command``."""
    import yaml

    with open(plan.pipeline) as f:
        data = yaml.safe_load(f)
    by_id = {s.stage_id: s for s in plan.stages}
    for stage in data["stages"]:
        s = by_id.get(stage["stage_id"])
        if s is None:
            continue
        engine_args = stage.setdefault("engine_args", {})
        runtime = stage.setdefault("runtime", {})
        engine_args["max_num_seqs"] = s.max_num_seqs
        engine_args["max_num_batched_tokens"] = s.max_num_batched_tokens
        if plan.devices.cpu:
            if s.kv_per_token:  # a stage without attention keeps the pipeline's value
                runtime["cpu_kv_cache_gib"] = round(s.kv_bytes / GIB, 2)
        else:
            engine_args["gpu_memory_utilization"] = s.share
            if plan.devices.count > 1:  # on one GPU every stage is on it anyway
                runtime["devices"] = ",".join(map(str, s.devices))
        if s.quantization:
            engine_args["quantization"] = s.quantization
        if plan.max_model_len and s is plan.stages[0]:  # the entry stage
            engine_args["max_model_len"] = plan.max_model_len
    head = (f"{WRITTEN_BY}{command}\n# {summary_line(plan)}\n"
            "# Serve it: vllm serve MODEL --stage-configs-path THIS_FILE (the entry stage's "
            f"max_model_len: {plan.stages[0].max_model_len})\n")
    return head + yaml.safe_dump(data, sort_keys=False)


def summary_line(plan: Plan) -> str:
    """One line saying whether ``plan`` fits, on what, with each device's minimum share
    and the headroom."""
    where = f"host memory {plan.devices.gib:g} GiB" if plan.devices.cpu else \
        f"{plan.devices.count} x {plan.devices.gib:g} GiB"
    used = ", ".join(f"device {d}: {m:.2f}" for d, m in sorted(plan.minimum.items()))
    return (f"{'fits' if plan.fits else 'does NOT fit'} on {where} (minimum share "
            f"{used}; headroom {plan.headroom:g})")


def render(plan: Plan) -> str:
    """The plan as a table, one row per stage, then whether it fits."""
    def gib(n: int) -> str:
        return f"{n / GIB:.2f}"

    rows = [("stage", "devices", "tokens/seqs", "weights GiB", "KV/token KiB",
             "KV@max_len GiB", "peak GiB", "overhead GiB", "KV planned GiB", "KV tokens",
             "share")]
    for s in plan.stages:
        name = f"{s.stage_id} {s.name}" + (f" x{s.replicas}" if s.replicas > 1 else "") + \
            (f" ({s.quantization})" if s.quantization else "")
        rows.append((name, "host" if plan.devices.cpu else ",".join(map(str, s.devices)),
                     f"{s.max_num_batched_tokens}/{s.max_num_seqs}", gib(s.weights),
                     f"{s.kv_per_token / 1024:.1f}", gib(s.kv_min),
                     gib(s.peak), gib(s.overhead), gib(s.kv_bytes), str(s.kv_tokens),
                     "-" if plan.devices.cpu else f"{s.share:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([f"pipeline {plan.pipeline}, model {plan.model}, max_model_len "
                      f"{plan.stages[0].max_model_len}", *lines, summary_line(plan)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PLAN_COMMAND,
        description="Memory plan of an omni pipeline: per stage weights, KV cache, "
                    "activation peak, the share of its device to set, and whether it fits. "
                    "Reads only the checkpoint's config.json; builds no weights.")
    parser.add_argument("model", help="checkpoint directory or Hugging Face Hub id "
                                      "(what vllm serve takes)")
    parser.add_argument("--pipeline", default="auto",
                        help="built-in pipeline name or YAML path (--stage-configs-path); "
                             "default: the one of the checkpoint's model_type")
    parser.add_argument("--devices", required=True, type=Devices.parse,
                        help="COUNTxGIB GPUs (2x80, 1x141) or cpu:GIB (vLLM's CPU build)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the entry stage's --max-model-len (default: the model's)")
    parser.add_argument("--dtype", default="bfloat16", help="the engines' dtype")
    parser.add_argument("--quantization", action="append", default=[], metavar="STAGE=METHOD",
                        help="quantize a stage's weights with vLLM's METHOD (fp8: online "
                             "FP8 of a bf16 checkpoint); repeatable")
    parser.add_argument("--headroom", type=float, default=HEADROOM,
                        help="fraction of each device left free (default %(default)s)")
    parser.add_argument("--write", metavar="PATH", help="write the planned pipeline YAML")
    return parser


def plan_from_args(argv: list[str]) -> tuple[Plan, str]:
    """The plan the command line ``argv`` asks for and its pipeline YAML (headed by the
    command, the model left out: ``MODEL``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    quantization = {}
    for item in args.quantization:
        stage, sep, method = item.partition("=")
        if not sep or not stage or not method:
            parser.error(f"--quantization {item!r}: expected STAGE=METHOD (thinker=fp8)")
        quantization[stage] = method
    import vllm_omni_plugin

    vllm_omni_plugin.register()
    plan = make_plan(args.model, args.pipeline, args.devices,
                        max_model_len=args.max_model_len, dtype=args.dtype,
                        quantization=quantization, headroom=args.headroom)
    rest, skip = [], False
    for arg in argv:
        if skip or arg == args.model or arg.startswith("--write="):
            skip = False
        elif arg == "--write":
            skip = True
        else:
            rest.append(arg)
    return plan, plan_yaml(plan, " ".join([f"{PLAN_COMMAND} MODEL", *rest]))


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``): print the plan's table
    and, with ``--write PATH``, write its pipeline YAML there.

    Returns:
        The exit status: 0 when the plan fits, 1 otherwise.
    """
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    plan, text = plan_from_args(argv)
    print(render(plan))
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
        print(f"wrote {args.write}")
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
