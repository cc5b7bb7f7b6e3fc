"""Pydantic models of a multi-stage pipeline config (``stage_configs/*.yaml``).

Stages form a DAG: ``inputs`` lists the stage ids whose outputs feed a stage.
Per-stage checks run in :class:`StageConfig`; cross-stage checks (ids, graph)
in :class:`PipelineConfig`. Both raise :class:`StageConfigError` (wrapped in a
pydantic ``ValidationError`` when models are built directly; the loader
unwraps it). vLLM is imported only when ``engine_args`` or
``default_sampling_params`` are non-empty.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import heapq
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StageConfigError(ValueError):
    """Invalid pipeline config.

    ``str(err)`` is ``"<path>: stage <id> ('<name>'): field '<field>': <message>"``,
    omitting parts that are unknown.

    Attributes:
        path: config file (``str``) or ``None``.
        stage_id: offending stage's id, or ``None``.
        stage_name: offending stage's name, or ``None``.
        stage_index: position in ``stages`` when the id is unknown, or ``None``.
        field: dotted field path (e.g. ``"runtime.num_replicas"``) or ``None``.
        message: the bare problem description.
        more: further errors found in the same pass (``list[StageConfigError]``).
    """

    def __init__(self, message: str, *, path: str | None = None, stage_id: int | None = None,
                 stage_name: str | None = None, stage_index: int | None = None,
                 field: str | None = None):
        super().__init__(message)
        self.message, self.path, self.field = message, path, field
        self.stage_id, self.stage_name, self.stage_index = stage_id, stage_name, stage_index
        self.more: list[StageConfigError] = []

    def __str__(self) -> str:
        parts = [] if self.path is None else [str(self.path)]
        if self.stage_id is not None:
            name = f" ({self.stage_name!r})" if self.stage_name else ""
            parts.append(f"stage {self.stage_id}{name}")
        elif self.stage_index is not None:
            parts.append(f"stages[{self.stage_index}]")
        if self.field:
            parts.append(f"field {self.field!r}")
        return ": ".join([*parts, self.message]) + "".join(f"\n{e}" for e in self.more)


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for close matches of ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=3)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


@functools.cache
def engine_arg_names() -> frozenset[str]:
    """Field names of ``vllm.engine.arg_utils.EngineArgs`` (imports vLLM)."""
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


@functools.cache
def sampling_param_names() -> frozenset[str]:
    """Public field names of ``vllm.SamplingParams`` (imports vLLM)."""
    from vllm_omni_plugin.compat.internals import sampling_param_fields

    return frozenset(n for n in sampling_param_fields() if not n.startswith("_"))


def _check_keys(d: dict[str, Any], allowed: frozenset[str], what: str) -> dict[str, Any]:
    bad = [f"unknown key {k!r}{suggest(k, allowed)}" for k in d if k not in allowed]
    if bad:
        raise ValueError(f"{'; '.join(bad)}; keys must be {what} fields")
    return d


class RuntimeConfig(BaseModel):
    """Placement of a stage's engine.

    ``devices``: comma-separated device indices (``"0"``, ``"0,1"``); a YAML
    int or list of ints is accepted. On vLLM's CPU build they are the CPU cores the
    stage's workers run on; on a GPU, indices into the devices the head sees, one per
    rank (:mod:`vllm_omni_plugin.config.placement`). Unset: ``--omni-placement``
    decides. ``cpu_kv_cache_gib``: on vLLM's CPU build, the KV cache size (GiB) of each
    engine of the stage (``kv_cache_memory_bytes``; ``VLLM_CPU_KVCACHE_SPACE`` wins);
    ignored on GPUs, where ``engine_args.gpu_memory_utilization`` is the share.
    ``num_replicas``: engine copies the head
    runs for this stage; ``0`` (not for the entry stage) leaves the stage to
    headless replicas (``vllm serve --headless --stage-id N``).
    ``max_inflight``: pipeline requests allowed in flight at this downstream
    stage before new ones wait for admission (then HTTP 429); default: the
    stage engine's ``max_num_seqs`` times ``num_replicas`` (at least one).
    ``max_restarts``: restart attempts for a local replica whose engine
    died, counted until it has been up for a minute, before it is given up
    (``down``); ``0`` disables restarts.
    ``stall_timeout``: seconds this stage's engines may leave a liveness probe
    unanswered before they count as stalled (``0`` disables the probe; default 120;
    ``--omni-stall-timeout`` overrides it): set it above the stage's longest engine step.
    """

    model_config = ConfigDict(extra="forbid")
    devices: str | None = None
    cpu_kv_cache_gib: float | None = Field(default=None, gt=0)
    num_replicas: int = Field(default=1, ge=0)
    max_inflight: int | None = Field(default=None, ge=1)
    max_restarts: int = Field(default=5, ge=0)
    stall_timeout: float | None = Field(default=None, ge=0)

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, v: Any) -> Any:
        if isinstance(v, list) and all(isinstance(x, int) for x in v):
            v = ",".join(map(str, v))
        elif isinstance(v, int) and not isinstance(v, bool):
            v = str(v)
        if isinstance(v, str) and not all(p.strip().isdigit() for p in v.split(",")):
            raise ValueError(f"expected comma-separated device indices like '0,1', got {v!r}")
        return v


#: ``EngineArgs`` fields a prefill stage takes from its decode stage: they fix the KV cache
#: layout both engines must share (the prefill stage's YAML may not set them).
PD_SHARED_FIELDS = ("model", "tokenizer", "hf_overrides", "dtype", "kv_cache_dtype",
                    "quantization", "block_size", "max_model_len", "tensor_parallel_size",
                    "pipeline_parallel_size", "worker_cls")


class PDConfig(BaseModel):
    """Prefill/decode disaggregation of a stage (the plugin's ``OmniMooncakeConnector``).

    ``role``: ``decode`` (the stage that generates; only the entry stage) or ``prefill``
    (computes the prompt's KV cache for ``decode_stage``, which pulls it). ``protocol``:
    Mooncake's transport, ``rdma`` (hosts with RDMA NICs; ``device_name`` lists them, e.g.
    ``mlx5_0``) or ``tcp``. ``max_descs_per_peer``: transfer descriptors per write to one
    peer (Mooncake fails above about 2048). ``transfer_timeout_s``: seconds after which a
    decode engine fails a request whose KV cache has not arrived (a prefill engine holds a
    finished request's KV cache half that long); None: the coordinator's heartbeat timeout
    (``--omni-heartbeat-timeout``); set on the decode stage, its prefill stage takes it.
    The plugin builds each engine's ``kv_transfer_config`` from this block, with a new
    engine id for every engine start and a free bootstrap port per prefill engine.
    """

    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    decode_stage: int | None = None
    protocol: Literal["rdma", "tcp"] = "rdma"
    device_name: str = ""
    max_descs_per_peer: int = Field(default=1024, ge=1)
    transfer_timeout_s: float | None = Field(default=None, gt=0)

    def transfer_timeout(self, heartbeat_timeout: float) -> float:
        """The transfer timeout in seconds: ``transfer_timeout_s``, else
        ``heartbeat_timeout``."""
        return self.transfer_timeout_s or heartbeat_timeout


class StreamingConfig(BaseModel):
    """Stage-to-stage streaming into a stage: for a request the client streams, the stage
    runs on chunks of its input stage's output while that stage still generates, and each
    chunk's output goes to the client as it is ready.

    Chunks are rows of the input stage's payload (dim 0 of its tensors, which must all
    have one row per output position: the talker's ``codes``, codec frames at 12.5 per
    second of speech), each preceded by up to ``left_context`` earlier rows the stage sees
    as context only (its model drops their output; the processor is told through
    ``UpstreamOutput.context_rows``). The first chunk is ``first_chunk_size`` rows
    (default ``chunk_size``): a small one gets the first output to the client sooner.
    Each later chunk waits for twice the rows of the one before, at most ``chunk_size``
    (or for the input stage's end), so that it is due no later than the output already
    sent runs out (when the input stage is at least twice as fast as real time), and
    takes every row there is then: rows that came while the previous chunk ran share one
    left context. Requests not streamed run the stage once on the whole output.
    """

    model_config = ConfigDict(extra="forbid")
    chunk_size: int = Field(ge=1)
    left_context: int = Field(default=0, ge=0)
    first_chunk_size: int | None = Field(default=None, ge=1)

    def chunk_rows(self, previous: int) -> int:
        """Rows a chunk waits for after a chunk of ``previous`` rows (0: the first)."""
        if previous == 0:
            return self.first_chunk_size or self.chunk_size
        return min(2 * previous, self.chunk_size)


class StageConfig(BaseModel):
    """One stage: an engine plus how its input is built from upstream outputs."""

    model_config = ConfigDict(extra="forbid")
    stage_id: int = Field(ge=0)
    name: str = Field(min_length=1)
    kind: Literal["ar", "generation", "diffusion"]
    engine_args: dict[str, Any] = Field(default_factory=dict)
    inputs: list[int] = Field(default_factory=list)
    input_processor: str | None = None
    final_output: bool = False
    final_output_type: Literal["text", "audio", "image", "latent"] | None = None
    default_sampling_params: dict[str, Any] = Field(default_factory=dict)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    pd: PDConfig | None = None
    streaming: StreamingConfig | None = None
    #: For a request the client streams, start the stage on the entry stage's output so
    #: far, as soon as its input processor says it is enough (``StageInput.ready``), and
    #: feed it the rest as the entry stage generates (one resumable vLLM request).
    stream_input: bool = False

    @property
    def is_prefill(self) -> bool:
        """A prefill stage: outside the data flow, run for its decode stage's requests."""
        return self.pd is not None and self.pd.role == "prefill"

    @field_validator("engine_args")
    @classmethod
    def _engine_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_keys(v, engine_arg_names(), "vllm EngineArgs") if v else v

    @field_validator("default_sampling_params")
    @classmethod
    def _sampling(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_keys(v, sampling_param_names(), "vllm SamplingParams") if v else v

    @field_validator("inputs")
    @classmethod
    def _unique_inputs(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate stage ids in {v}")
        return v

    def _error(self, field: str, message: str) -> StageConfigError:
        return StageConfigError(message, stage_id=self.stage_id, stage_name=self.name, field=field)

    @model_validator(mode="after")
    def _consistency(self) -> StageConfig:
        if self.stage_id in self.inputs:
            raise self._error("inputs", "a stage cannot list itself as an input")
        if self.inputs and not self.input_processor:
            raise self._error("input_processor", "required when 'inputs' is non-empty")
        if not self.inputs and self.input_processor:
            raise self._error("input_processor", "must be unset when 'inputs' is empty")
        if self.final_output and self.final_output_type is None:
            raise self._error("final_output_type", "required when 'final_output' is true")
        if not self.final_output and self.final_output_type is not None:
            raise self._error("final_output_type", "set but 'final_output' is false")
        if self.pd is not None:
            self._check_pd()
        if self.streaming is not None:
            if len(self.inputs) != 1:
                raise self._error("streaming", "a streamed stage reads exactly one input "
                                  f"stage (inputs: {self.inputs})")
            if not self.final_output:
                raise self._error("streaming", "only a final-output stage can be streamed "
                                  "(its chunks go to the client)")
        if self.stream_input and len(self.inputs) != 1:
            raise self._error("stream_input", "a stage fed while its input stage runs reads "
                              f"exactly one input stage (inputs: {self.inputs})")
        return self

    def _check_pd(self) -> None:
        pd = self.pd
        if "kv_transfer_config" in self.engine_args:
            raise self._error("engine_args.kv_transfer_config",
                              "set by the plugin from 'pd'; remove it")
        if self.engine_args.get("enable_prefix_caching", True) is not False \
                and pd.role == "decode":
            raise self._error("engine_args.enable_prefix_caching",
                              "must be false on a decode stage (vLLM's Mooncake connector "
                              "does not combine remote prefill with prefix caching)")
        if pd.role == "decode" and pd.decode_stage is not None:
            raise self._error("pd.decode_stage", "only a prefill stage names a decode stage")
        if pd.role == "prefill":
            if pd.decode_stage is None:
                raise self._error("pd.decode_stage", "required for role 'prefill'")
            shared = [k for k in PD_SHARED_FIELDS if k in self.engine_args]
            if shared:
                raise self._error(f"engine_args.{shared[0]}",
                                  f"a prefill stage takes {', '.join(shared)} from its decode "
                                  f"stage {pd.decode_stage}; set it there")
            for name in ("inputs", "input_processor", "final_output",
                         "default_sampling_params"):
                if getattr(self, name):
                    raise self._error(name, "a prefill stage takes its decode stage's "
                                      "requests; it has no inputs, processor, sampling "
                                      "defaults or final output")


class PipelineConfig(BaseModel):
    """A validated stage DAG with exactly one entry stage and >= 1 final-output stage."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model_type: str | None = None  # informational
    stages: list[StageConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_graph(self) -> PipelineConfig:
        by_id: dict[int, StageConfig] = {}
        names: dict[str, StageConfig] = {}
        for s in self.stages:
            if (o := by_id.get(s.stage_id)) is not None:
                raise s._error("stage_id", f"duplicate stage_id {s.stage_id} (also {o.name!r})")
            if (o := names.get(s.name)) is not None:
                raise s._error("name", f"duplicate name {s.name!r} (also stage {o.stage_id})")
            by_id[s.stage_id], names[s.name] = s, s
        for s in self.stages:
            for src in s.inputs:
                if src not in by_id:
                    ids = ", ".join(map(str, sorted(by_id)))
                    raise s._error("inputs", f"input stage {src} does not exist; stage ids: {ids}")
        if cycle := _find_cycle(self.stages):
            raise by_id[cycle[0]]._error(
                "inputs", "inputs form a cycle: " + " -> ".join(map(str, cycle)))
        _check_pd_pairs(self.stages, by_id)
        for s in self.stages:
            if s.streaming is not None and not by_id[s.inputs[0]].inputs:
                raise s._error("streaming", f"its input stage {s.inputs[0]} is the entry "
                               "stage, whose output is not streamed to other stages")
        entries = [s for s in self.stages if not s.inputs and not s.is_prefill]
        if len(entries) != 1:
            listed = ", ".join(f"{s.stage_id} ({s.name!r})" for s in entries)
            raise entries[-1]._error(
                "inputs", f"exactly one entry stage (empty 'inputs') is allowed; found {listed}")
        for s in self.stages:
            if not s.stream_input:
                continue
            if s.inputs[0] != entries[0].stage_id:
                raise s._error("stream_input", f"its input stage {s.inputs[0]} is not the "
                               f"entry stage {entries[0].stage_id}, the only stage whose "
                               "output is fed to another while it runs")
            if any(p.is_prefill and p.pd.decode_stage == s.inputs[0] for p in self.stages):
                raise s._error("stream_input", f"its input stage {s.inputs[0]} is a decode "
                               "stage (pd); a stage is fed while it runs only without PD")
        if entries[0].runtime.num_replicas != 1:
            raise entries[0]._error(
                "runtime.num_replicas", "the entry stage runs once in the head (got "
                f"{entries[0].runtime.num_replicas}); scale it with vLLM's --data-parallel-size, "
                f"and with headless replicas (--headless --stage-id "
                f"{entries[0].stage_id}) for requests that ask for no text")
        if not any(s.final_output for s in self.stages):
            raise StageConfigError("no stage has 'final_output: true'", field="final_output")
        return self

    def stage(self, stage_id: int) -> StageConfig:
        """Return the stage with ``stage_id``; raises ``KeyError`` if none."""
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise KeyError(f"no stage with stage_id {stage_id}")

    @property
    def entry_stage(self) -> StageConfig:
        """The only stage with empty ``inputs`` that is not a prefill stage (receives
        client requests)."""
        return next(s for s in self.stages if not s.inputs and not s.is_prefill)

    def prefill_stage_for(self, stage_id: int) -> StageConfig | None:
        """The prefill stage of decode stage ``stage_id``, or None."""
        return next((s for s in self.stages
                     if s.is_prefill and s.pd.decode_stage == stage_id), None)

    @property
    def final_stages(self) -> list[StageConfig]:
        """Stages with ``final_output: true``, by stage id."""
        return sorted((s for s in self.stages if s.final_output), key=lambda s: s.stage_id)

    def downstream(self, stage_id: int) -> list[StageConfig]:
        """Stages that list ``stage_id`` in ``inputs``, by id; ``KeyError`` if unknown."""
        self.stage(stage_id)
        return sorted((s for s in self.stages if stage_id in s.inputs), key=lambda s: s.stage_id)

    def topological_order(self) -> list[StageConfig]:
        """The stages of the data flow (all but prefill stages), every stage after its
        inputs; ties broken by smaller id."""
        pending = {s.stage_id: len(s.inputs) for s in self.stages if not s.is_prefill}
        ready = [i for i, n in pending.items() if n == 0]
        heapq.heapify(ready)
        order: list[StageConfig] = []
        while ready:
            order.append(self.stage(heapq.heappop(ready)))
            for d in self.downstream(order[-1].stage_id):
                pending[d.stage_id] -= 1
                if pending[d.stage_id] == 0:
                    heapq.heappush(ready, d.stage_id)
        return order

    def check_processors(self, available: Iterable[str], path: str | None = None) -> None:
        """Check every ``input_processor`` is one of ``available``.

        Args:
            available: known processor names (the loader passes the registry's).
            path: config file named in errors.
        Raises:
            StageConfigError: unknown name (message lists the available ones).
        """
        names = list(available)
        for s in self.stages:
            if s.input_processor and s.input_processor not in names:
                err = s._error("input_processor", f"unknown processor {s.input_processor!r}; "
                               f"available: {', '.join(names) or '(none)'}")
                err.path = path
                raise err


def _check_pd_pairs(stages: list[StageConfig], by_id: dict[int, StageConfig]) -> None:
    """Each prefill stage names a decode stage of the same kind; each decode stage is the
    entry stage with exactly one prefill stage; no stage reads a prefill stage."""
    for s in stages:
        if s.is_prefill:
            decode = by_id.get(s.pd.decode_stage)
            if decode is None or decode.pd is None or decode.pd.role != "decode":
                raise s._error("pd.decode_stage", f"stage {s.pd.decode_stage} is not a stage "
                               "with pd.role 'decode'")
            if decode.kind != s.kind:
                raise s._error("kind", f"{s.kind!r} differs from decode stage "
                               f"{decode.stage_id}'s {decode.kind!r}")
            # The prefill side's hold time is derived from the decode side's timeout
            # (kv_transfer/mooncake.py): one value for the pair, set on the decode stage.
            if s.pd.transfer_timeout_s not in (None, decode.pd.transfer_timeout_s):
                raise s._error("pd.transfer_timeout_s", "set it on decode stage "
                               f"{decode.stage_id}; its prefill stage takes it from there")
            s.pd.transfer_timeout_s = decode.pd.transfer_timeout_s
    for s in stages:
        if s.pd is not None and not s.is_prefill:
            if s.inputs:
                raise s._error("pd.role", "only the entry stage can be a decode stage")
            prefills = [p.stage_id for p in stages
                        if p.is_prefill and p.pd.decode_stage == s.stage_id]
            if len(prefills) != 1:
                raise s._error("pd.role", f"a decode stage needs exactly one prefill stage "
                               f"(pd: {{role: prefill, decode_stage: {s.stage_id}}}); found "
                               f"{prefills or 'none'} (scale it with runtime.num_replicas)")
        for src in s.inputs:
            if src in by_id and by_id[src].is_prefill:
                raise s._error("inputs", f"stage {src} is a prefill stage, which feeds no "
                               f"stage; list its decode stage {by_id[src].pd.decode_stage}")


def _find_cycle(stages: list[StageConfig]) -> list[int] | None:
    """Return a data-flow cycle as ``[a, b, ..., a]`` (``a`` feeds ``b``), or ``None``."""
    consumers = {s.stage_id: sorted(c.stage_id for c in stages if s.stage_id in c.inputs)
                 for s in stages}
    state: dict[int, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[int] = []

    def visit(n: int) -> list[int] | None:
        state[n] = 1
        stack.append(n)
        for m in consumers[n]:
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for sid in sorted(consumers):
        if sid not in state and (found := visit(sid)):
            return found
    return None
