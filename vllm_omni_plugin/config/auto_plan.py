"""``--stage-configs-path auto`` on GPUs for checkpoints the default pipeline cannot
hold: the shipped memory plan that fits the devices this host sees, or a refusal at
start-up naming the plan tool command that computes one for them.

The shipped plans (``stage_configs/*_1xh200.yaml`` and the like) are
``python -m vllm_omni_plugin.tools.plan`` output for the released checkpoints; each one's
first line is the command that wrote it (:data:`WRITTEN_BY`), read here for the pipeline
it plans (``--pipeline``), its devices (``--devices``), the entry stage's
``--max-model-len`` and the stages it quantizes (``--quantization``).

The decision (:func:`choose`), for ``auto`` resolved to a built-in pipeline:

* vLLM's CPU build, a pipeline no shipped plan was written for, or GPUs whose memory
  the platform does not report: the pipeline.
* The default pipeline holds the checkpoint when every stage the head runs could hold
  all of its weights in its share of the smallest GPU (``gpu_memory_utilization`` x the
  device's total memory; the weights: the checkpoint's safetensors index ``total_size``,
  else its weight files' sizes): the pipeline (the tiny test checkpoints). A checkpoint
  whose size cannot be read keeps the pipeline too, with a warning naming the plans.
* Else the shipped plans of the pipeline whose devices this host has (as many GPUs, each
  at least as large) and whose ``--max-model-len`` covers the one asked for: those that
  quantize no stage first, then the one planned for the most memory (count x size), then
  for fewer GPUs. A plan sets the entry stage's ``max_model_len`` it was computed for
  (an explicit ``--max-model-len`` wins).
* None fits: :class:`~vllm_omni_plugin.config.schema.StageConfigError` naming the
  devices, the shipped plans and the plan tool command for this host's devices.

The pipeline named outright (``--stage-configs-path qwen3_omni_moe``) is kept; where it
cannot hold the checkpoint and a plan fits, a warning names the plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex

from vllm_omni_plugin.config.placement import CPU_BIND_ENV, GIB, Host, local_stages
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: how the plan tool is run (its ``prog``, and the start of every plan's first line)
PLAN_COMMAND = "python -m vllm_omni_plugin.tools.plan"
#: what a plan's first line starts with, followed by the command that wrote it
WRITTEN_BY = "# Written by: "
#: weight files whose sizes count when a checkpoint has no safetensors index
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class Devices:
    """What a plan is for: ``count`` GPUs of ``gib`` GiB, or host memory (``cpu``)."""

    count: int
    gib: float
    cpu: bool = False

    @classmethod
    def parse(cls, text: str) -> Devices:
        """``2x80`` (two GPUs of 80 GiB), ``1x141``, ``cpu:16``.

        Raises:
            ValueError: neither form, or a count or size not above 0.
        """
        try:
            if text.startswith("cpu:"):
                devices = cls(1, float(text[4:]), cpu=True)
            else:
                count, _, gib = text.lower().partition("x")
                devices = cls(int(count), float(gib))
        except ValueError:
            devices = None
        if devices is None or devices.count < 1 or devices.gib <= 0:
            raise ValueError(f"--devices {text!r}: expected COUNTxGIB (2x80) or cpu:GIB")
        return devices

    @classmethod
    def of(cls, host: Host) -> Devices:
        """``host``'s GPUs as the plan tool's ``--devices`` names them: their count and
        the smallest one's size, rounded down to 0.1 GiB."""
        return cls(len(host.devices), math.floor(host.memory_bytes / GIB * 10) / 10)

    @property
    def bytes(self) -> int:
        """The size of one device (or of the host memory), bytes."""
        return int(self.gib * GIB)

    @property
    def text(self) -> str:
        """The ``--devices`` value: ``2x79.6``, ``cpu:16``."""
        return f"cpu:{self.gib:g}" if self.cpu else f"{self.count}x{self.gib:g}"

    def host(self) -> Host:
        """The devices as the head's placement sees a host of them."""
        if self.cpu:
            return Host("cpu", (0,), CPU_BIND_ENV, self.bytes)
        return Host("gpu", tuple(range(self.count)), "CUDA_VISIBLE_DEVICES", self.bytes)

    def holds(self, other: Devices) -> bool:
        """Whether these GPUs have ``other``'s: at least as many, each as large."""
        return not self.cpu and not other.cpu and self.count >= other.count \
            and self.gib >= other.gib


@dataclasses.dataclass(frozen=True)
class ShippedPlan:
    """A built-in pipeline written by the plan tool, as its first line says.

    Attributes:
        name: its built-in name (``qwen3_omni_moe_1xh200``).
        path: its YAML.
        pipeline: the pipeline it plans (``--pipeline``).
        devices: what it was planned for (``--devices``).
        max_model_len: the entry stage's ``--max-model-len`` (None: the model's).
        quantization: the ``--quantization`` values (``thinker=fp8``).
    """

    name: str
    path: str
    pipeline: str
    devices: Devices
    max_model_len: int | None
    quantization: tuple[str, ...]

    @classmethod
    def read(cls, name: str, path: str) -> ShippedPlan | None:
        """The plan at ``path``; None when its first line is not the plan tool's
        (:data:`WRITTEN_BY`) or names no ``--pipeline`` / GPU ``--devices``."""
        with open(path) as f:
            first = f.readline()
        if not first.startswith(WRITTEN_BY + PLAN_COMMAND):
            return None
        words = shlex.split(first[len(WRITTEN_BY + PLAN_COMMAND):])
        flags: dict[str, list[str]] = {}
        for flag, value in zip(words, words[1:], strict=False):
            if flag.startswith("--"):
                flags.setdefault(flag, []).append(value)
        if "--pipeline" not in flags or "--devices" not in flags:
            return None
        devices = Devices.parse(flags["--devices"][-1])
        if devices.cpu:
            return None
        max_len = flags.get("--max-model-len")
        return cls(name, path, flags["--pipeline"][-1], devices,
                   int(max_len[-1]) if max_len else None,
                   tuple(flags.get("--quantization", ())))


def shipped_plans(pipeline: str) -> list[ShippedPlan]:
    """The shipped plans of the built-in pipeline ``pipeline``, by name."""
    from vllm_omni_plugin.config.pipelines import builtin_pipelines

    plans = (ShippedPlan.read(name, path) for name, path in builtin_pipelines().items())
    return [p for p in plans if p is not None and p.pipeline == pipeline]


def checkpoint_bytes(model: str, revision: str | None = None) -> int | None:
    """The bytes of ``model``'s weights (a checkpoint directory or a Hugging Face Hub
    id): its safetensors index's ``metadata.total_size``, else, for a directory, the
    sizes of its weight files (:data:`WEIGHT_SUFFIXES`); None when neither is there."""
    index = None
    if os.path.isdir(model):
        path = os.path.join(model, SAFETENSORS_INDEX)
        if os.path.isfile(path):
            with open(path) as f:
                index = json.load(f)
    else:
        from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

        try:
            index = get_hf_file_to_dict(SAFETENSORS_INDEX, model, revision or "main")
        except Exception as exc:  # no index, offline, or no such repository
            logger.debug("no %s for %s: %s", SAFETENSORS_INDEX, model, exc)
    total = ((index or {}).get("metadata") or {}).get("total_size")
    if total:
        return int(total)
    if os.path.isdir(model):
        sizes = [entry.stat().st_size for entry in os.scandir(model)
                 if entry.is_file() and entry.name.endswith(WEIGHT_SUFFIXES)]
        return sum(sizes) if sizes else None
    return None


def default_holds(path: str, weights: int, host: Host) -> bool:
    """Whether every stage the head runs of the pipeline at ``path`` could hold
    ``weights`` bytes in its share of ``host``'s smallest GPU (``gpu_memory_utilization``,
    vLLM's default where unset)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_omni_plugin.config.loader import load_pipeline_config

    shares = [float(s.engine_args.get("gpu_memory_utilization")
                    or EngineArgs.gpu_memory_utilization)
              for s in local_stages(load_pipeline_config(path))]
    return weights <= min(shares) * host.memory_bytes


def choose(name: str, path: str, model: str, revision: str | None, host: Host,
           max_model_len: int | None, auto: bool) -> str:
    """The pipeline YAML to serve for the built-in pipeline ``name`` (at ``path``) and checkpoint
    ``model``: the module docstring's decision; ``auto`` when the flag said ``auto``
    (else the named pipeline stays, at most with a warning), ``host`` with the smallest
    GPU's total memory, ``max_model_len`` the one asked for (None: the model's).

    Raises:
        StageConfigError: ``auto``, the pipeline cannot hold the checkpoint and no
            shipped plan fits the devices (names them, the plans and the plan tool
            command).
    """
    plans = shipped_plans(name)
    if host.is_cpu or not plans or not host.devices:
        return path
    if not host.memory_bytes:
        logger.warning("%s: the GPUs' memory is unknown; serving %s as it is", name, name)
        return path
    weights = checkpoint_bytes(model, revision)
    names = ", ".join(f"{p.name} ({p.devices.count} x {p.devices.gib:g} GiB)" for p in plans)
    if weights is None:
        logger.warning("%s: the size of %s's weights is unknown; serving %s as it is "
                       "(plans for the released checkpoints: %s)", name, model, name, names)
        return path
    if default_holds(path, weights, host):
        return path
    mine = Devices.of(host)
    fitting = [p for p in plans if mine.holds(p.devices) and (
        max_model_len is None or p.max_model_len is None or max_model_len <= p.max_model_len)]
    fitting.sort(key=lambda p: (bool(p.quantization), -p.devices.count * p.devices.gib,
                                p.devices.count))
    where = f"{mine.count} x {mine.gib:g} GiB"
    if not auto:
        if fitting:
            logger.warning("%s: its memory shares cannot hold %s's %.1f GiB of weights on "
                           "%s; serve the plan for them: --stage-configs-path %s (or %s)",
                           name, model, weights / GIB, where, fitting[0].name, "auto")
        return path
    if not fitting:
        from vllm_omni_plugin.config.schema import StageConfigError

        command = " ".join([PLAN_COMMAND, shlex.quote(model), "--pipeline", name,
                            "--devices", mine.text,
                            *(["--max-model-len", str(max_model_len)] if max_model_len
                              else []), "--write", "plan.yaml"])
        raise StageConfigError(
            f"auto: the {name} pipeline cannot hold {model}'s {weights / GIB:.1f} GiB of "
            f"weights on {where}, and no plan shipped for it fits them"
            f"{f' with --max-model-len {max_model_len}' if max_model_len else ''} "
            f"(shipped: {names}). Compute one for these devices: {command} (it says "
            "whether it fits; --quantization STAGE=fp8 quantizes a stage's weights "
            "online), then serve it with --stage-configs-path plan.yaml",
            field="--stage-configs-path")
    plan = fitting[0]
    log = logger.warning if plan.quantization else logger.info
    log("auto: %s's %.1f GiB of weights on %s: serving the plan %s (for %d x %g GiB%s%s)",
        model, weights / GIB, where, plan.name, plan.devices.count, plan.devices.gib,
        f", max_model_len {plan.max_model_len}" if plan.max_model_len else "",
        f"; quantized online: {', '.join(plan.quantization)}" if plan.quantization else "")
    return plan.path
