"""Per-request bookkeeping of a stage's payloads, independent of any model runner.

A request sent by the orchestrator names payload keys in its
``SamplingParams.extra_args`` (:func:`vllm_omni_plugin.extra_args.payload_keys`).

* **Input.** A request with an input key gets its input payload loaded when it is first
  scheduled; one whose input grows (``input_grows``: a resumable request the orchestrator
  feeds in chunks) also gets the chunks appended since, whenever it is scheduled. A stage
  model that declares ``uses_stage_step = True`` reads it, and
  the step's row-to-request map, through the :class:`StageStep` the worker hands it for
  each engine step.
* **Output.** For a request with an output key, every engine step appends to the payload
  store the rows of the positions it fed (``[n, ...]`` per tensor, the model's
  :meth:`stage_output_rows`; the first chunk also carries the model's per-request
  :meth:`stage_output_once` tensors) and whatever the model produced for that request in
  the step (its :meth:`stage_output_requests`). With tensor or pipeline parallelism only
  one worker publishes (TP rank 0 of the last PP rank), after the forward: these methods
  run on that rank alone and must not call a collective (a TP layer's forward, say),
  which would wait for ranks that never join it.

A request whose keys are malformed, whose input cannot be read, or whose publishing (or
model code) fails, is *failed*: the failure is recorded under its failure key (the
orchestrator fails that request with an error naming the stage) and the worker makes it
emit its stop token, so the engine keeps serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.compat.model_runner import batch_req_ids
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import GrowingPayload, PayloadStore
from vllm_omni_plugin.worker.row_cache import RowCache

logger = init_logger(__name__)


@dataclass
class _Tracked:
    out_key: str | None
    failure_key: str | None
    stop_token: int
    failed: bool = False
    #: positions whose rows were published (a recompute after preemption
    #: must not publish them again)
    published: int = 0
    num_prompt_tokens: int = 0
    params: Any = None
    #: the input payload (tensors from the orchestrator), empty when none
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    #: for an input that grows: its key, the chunks of it read so far, and their rows
    growing_key: str | None = None
    input_chunks: int = 0
    growing: GrowingPayload = field(default_factory=GrowingPayload)
    #: the rows of the positions a prefix-cache hit skipped, published with its first rows
    cached: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's rows in a step's forward.

    Attributes:
        req_id: vLLM's request id.
        start: index of its first row in the flattened batch.
        num_tokens: its rows (consecutive).
        num_computed: tokens of the request already in the KV cache: the position of its
            first row.
        num_prompt_tokens: length of its prompt (0 for a request the plugin does not track).
    """

    req_id: str
    start: int
    num_tokens: int
    num_computed: int
    num_prompt_tokens: int


class StageStep:
    """The engine step being executed, as a stage model sees it from inside its forward.

    The worker binds one to the model (``model.stage_step``) around the model runner's
    ``execute_model`` and unbinds it after, so a forward outside a step (vLLM's dummy and
    profiling runs) sees None.

    Attributes:
        finished: requests finished since the previous step (drop their state).
    """

    def __init__(self, io: StageIO, model_runner, scheduler_output):
        self._io, self._runner, self._out = io, model_runner, scheduler_output
        self.finished = frozenset(scheduler_output.finished_req_ids)
        self._rows: list[ScheduledRequest] | None = None

    def requests(self) -> list[ScheduledRequest]:
        """The step's requests in the forward's row order (valid inside the forward; the
        order is final once the forward runs, so it is read once per step)."""
        if self._rows is None:
            counts, computed = self._out.num_scheduled_tokens, self._io.computed
            rows, start = [], 0
            for req_id in batch_req_ids(self._runner):
                tracked = self._io.tracked(req_id)
                n = counts[req_id]
                rows.append(ScheduledRequest(req_id, start, n, computed[req_id],
                                             tracked.num_prompt_tokens if tracked else 0))
                start += n
            self._rows = rows
        return self._rows

    def inputs(self, req_id: str) -> dict[str, torch.Tensor]:
        """The request's input payload (``{}`` when it has none): ``{name: [rows, ...]}``
        CPU tensors in the shapes and dtypes the orchestrator published (any); for an
        input that grows, the rows read so far."""
        tracked = self._io.tracked(req_id)
        return tracked.inputs if tracked is not None else {}

    def grows(self, req_id: str) -> bool:
        """Whether the request's input grows while it runs (a resumable request the
        orchestrator feeds in chunks: :meth:`inputs` gains rows on dim 0)."""
        tracked = self._io.tracked(req_id)
        return tracked is not None and tracked.growing_key is not None

    def params(self, req_id: str):
        """The request's ``SamplingParams`` (None for a request the plugin does not track)."""
        tracked = self._io.tracked(req_id)
        return tracked.params if tracked is not None else None

    def failed(self, req_id: str) -> bool:
        """Whether the request has failed (False for a request the plugin does not
        track)."""
        tracked = self._io.tracked(req_id)
        return tracked is not None and tracked.failed

    def fail(self, req_id: str, exc: Exception) -> None:
        """Fail one request (its error is reported, it emits its stop token); the rest of
        the batch goes on."""
        tracked = self._io.tracked(req_id)
        if tracked is None:
            raise exc
        if not tracked.failed:
            self._io.fail(req_id, tracked, exc)


def keep_rows(buffers: dict[str, torch.Tensor], **rows: torch.Tensor) -> None:
    """Copy a forward's per-position outputs into a model's persistent ``buffers``
    (``[max_rows, ...]`` each, allocated once with the model), rows from 0: the
    graph-safe way to keep :meth:`stage_output_rows`. Under a FULL CUDA graph the copies
    are captured and replayed with the step's data, and the buffers never move.

    Args:
        buffers: name -> ``[max_rows, *shape]`` tensor.
        rows: name -> ``[n, *shape]`` tensor of the forward (same dtype, device, shape).

    Raises:
        ValueError: a forward fed more rows than a buffer holds.
    """
    for name, t in rows.items():
        buffer = buffers[name]
        if t.shape[0] > buffer.shape[0]:
            raise ValueError(f"a forward of {t.shape[0]} rows exceeds the {buffer.shape[0]} "
                             f"rows kept for {name!r} (max_num_batched_tokens)")
        buffer[:t.shape[0]].copy_(t)


def _rows_on_host(rows: dict[str, torch.Tensor], spans: list[tuple[int, int]]
                  ) -> dict[str, torch.Tensor]:
    """The rows ``[begin, end)`` of each span, in order, of every tensor in ``rows``, on
    the host: one gather and one device-to-host copy per tensor for the whole step (a
    copy per request and tensor each waited for the device)."""
    if not rows or all(begin == end for begin, end in spans):
        return {}
    if len(spans) == 1:
        ((begin, end),) = spans
        return {name: t[begin:end].to("cpu") for name, t in rows.items()}
    device = next(iter(rows.values())).device
    index = torch.cat([torch.arange(begin, end) for begin, end in spans]).to(device)
    return {name: t.index_select(0, index).to("cpu") for name, t in rows.items()}


def request_payload_keys(req_id: str, params: Any, store: PayloadStore | None
                         ) -> tuple[xargs.PayloadKeys, Exception | None]:
    """The payload keys a request carries, and the problem that fails it (else None):
    malformed keys (not from the orchestrator), or keys outside omni mode."""
    try:
        keys = xargs.payload_keys(params.extra_args if params is not None else None)
    except ValueError as exc:  # not from the orchestrator: fail this request only
        return xargs.PayloadKeys(), exc
    if keys.failure_key and store is None:
        return xargs.PayloadKeys(), RuntimeError(
            f"request {req_id} carries payload keys but no payload store is configured "
            "(not in omni mode?)")
    return keys, None


def stop_token_of(params: Any) -> int:
    """The token a failed request emits: its first stop token, so the scheduler
    finishes it (at the latest at ``max_tokens``); 0 when it has none."""
    stop = list(params.all_stop_token_ids or ()) if params is not None else []
    return int(stop[0]) if stop else 0


class StageIO:
    """Output payloads of one stage engine's requests.

    Args:
        stage_id: the stage, for log lines and error messages.
        store: the run's payload store, or None outside omni mode (then every
            request carrying payload keys fails).
    """

    def __init__(self, stage_id: int, store: PayloadStore | None):
        self.stage_id = stage_id
        self.store = store
        self._requests: dict[str, _Tracked] = {}
        #: whether requests without payload keys are tracked too (set by the worker for a
        #: model that reads its step, which may fail any request: such a request that fails
        #: is logged and emits its stop token, as there is no failure key to report it)
        self.track_plain = False
        #: req id -> first position fed this step (set by :meth:`begin_step`)
        self._computed: dict[str, int] = {}
        #: the rows of prefix-cached blocks (set by the worker where requests that publish
        #: rows may read the prefix cache; :mod:`~vllm_omni_plugin.worker.row_cache`)
        self.rows: RowCache | None = None

    # -- scheduling ---------------------------------------------------------------
    def begin_step(self, scheduler_output, *, always: bool = False) -> bool:
        """Track the step's new and finished requests; True when a request scheduled
        this step publishes (the caller then calls :meth:`publish` after the forward),
        or when ``always`` (the model reads a :class:`StageStep`)."""
        hits = self.rows.begin_step(scheduler_output) if self.rows is not None else {}
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._add(new, hits.get(new.req_id))
        if not self._requests and not always:
            return False  # plain requests only (a text-only batch): nothing to read or publish
        for req_id in scheduler_output.num_scheduled_tokens:
            tracked = self._requests.get(req_id)
            if tracked is not None and tracked.growing_key and not tracked.failed:
                self._read_input(req_id, tracked)
        if not always and not any(
                (t := self._requests.get(r)) is not None and t.out_key and not t.failed
                for r in scheduler_output.num_scheduled_tokens) \
                and not (self.rows is not None and self.rows.step.filled):
            return False
        cached = scheduler_output.scheduled_cached_reqs
        self._computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            self._computed[new.req_id] = new.num_computed_tokens
        return True

    @property
    def computed(self) -> dict[str, int]:
        """Request id -> position of its first row in the current step."""
        return self._computed

    def tracked(self, req_id: str) -> _Tracked | None:
        """The plugin's state of a request, or None for one it does not track (a plain
        request without payload keys, or one already finished)."""
        return self._requests.get(req_id)

    def _add(self, new, hit=None) -> None:
        """Track a new request; ``hit``: the rows of its prefix-cache hit (or the error
        that fails it) where the row cache gave them."""
        if new.req_id in self._requests:  # resumed after preemption (model runner V2)
            return
        params = new.sampling_params
        keys, problem = request_payload_keys(new.req_id, params, self.store)
        if problem is None and not keys.failure_key and not keys.input \
                and not self.track_plain:
            return  # a plain request: nothing to track
        tracked = _Tracked(out_key=keys.output, failure_key=keys.failure_key,
                           stop_token=stop_token_of(params), params=params,
                           num_prompt_tokens=len(new.prompt_token_ids or ()))
        self._requests[new.req_id] = tracked
        if problem is not None:
            self.fail(new.req_id, tracked, problem)
        elif keys.prefilled:
            # The prompt's KV came from a prefill stage, which published the prompt's
            # rows: this engine publishes the generated positions only.
            tracked.published = tracked.num_prompt_tokens
        elif isinstance(hit, Exception):
            self.fail(new.req_id, tracked, hit)
        elif hit is not None and keys.output and not keys.input:
            tracked.cached = hit  # the skipped positions' rows, from the row cache
        elif (keys.output or keys.input) and new.num_computed_tokens:
            # Payload rows map one-to-one to fed positions; a prefix-cache hit skips some.
            self.fail(new.req_id, tracked, RuntimeError(
                f"stage {self.stage_id}: a request carrying payloads hit the prefix cache "
                f"({new.num_computed_tokens} tokens); set scheduler_cls: "
                "vllm_omni_plugin.worker.scheduler.OmniScheduler (a stage that publishes "
                "rows) or enable_prefix_caching: false in this stage's engine_args"))
        elif keys.input and keys.input_grows:
            tracked.growing_key = keys.input  # read by begin_step, as it is scheduled
        elif keys.input:
            try:
                tracked.inputs = self.store.get(keys.input)
                if not tracked.inputs:
                    raise RuntimeError(f"stage {self.stage_id}: the input payload "
                                       f"{keys.input!r} is missing or empty")
            except Exception as exc:
                self.fail(new.req_id, tracked, exc)

    def _read_input(self, req_id: str, tracked: _Tracked) -> None:
        """Append the chunks of a growing input payload written since the last read
        (tensors concatenated on dim 0, as :meth:`PayloadStore.get` joins them)."""
        try:
            chunks = self.store.chunks(tracked.growing_key, tracked.input_chunks)
            if not chunks and not tracked.inputs:
                raise RuntimeError(f"stage {self.stage_id}: the input payload "
                                   f"{tracked.growing_key!r} is missing or empty")
        except Exception as exc:
            self.fail(req_id, tracked, exc)
            return
        tracked.input_chunks += len(chunks)
        if chunks:
            try:
                tracked.growing.extend(chunks)
            except ValueError as exc:
                self.fail(req_id, tracked, exc)
                return
            tracked.inputs = tracked.growing.tensors()

    # -- after the forward --------------------------------------------------------
    def publish(self, model, batch_req_ids: list[str], scheduler_output) -> None:
        """Append each publishing request's rows of this step to the store.

        Args:
            model: the stage model (``stage_output_rows()`` / ``stage_output_once()``).
            batch_req_ids: the scheduled requests in the model runner's row order; each
                owns ``scheduler_output.num_scheduled_tokens[req_id]`` consecutive rows.
            scheduler_output: vLLM's ``SchedulerOutput`` of the step (its
                ``num_scheduled_tokens`` per request).
        """
        rows_of = getattr(model, "stage_output_rows", None)
        requests_of = getattr(model, "stage_output_requests", None)
        outputs = None if rows_of is None and requests_of is None else (
            rows_of() if rows_of else {}, requests_of() if requests_of else {})
        # (req id, tracked, its first row in the step's, how many of its rows were
        # published before (a recompute after preemption), its first fed position, its
        # scheduled tokens); a failed request's rows still go to the row cache
        publishing, offset = [], 0
        for req_id in batch_req_ids:
            n = scheduler_output.num_scheduled_tokens[req_id]
            tracked = self._requests.get(req_id)
            if tracked is not None and tracked.out_key and (
                    not tracked.failed or self.rows is not None):
                start = self._computed[req_id]
                skip = min(n, max(0, tracked.published - start))
                publishing.append((req_id, tracked, offset, skip, start, n))
            offset += n
        if not publishing:
            return
        if outputs is None:
            error = RuntimeError(f"stage {self.stage_id}: {type(model).__name__} publishes no "
                                 "stage outputs, but the request asks for them")
            for req_id, tracked, *_ in publishing:
                if not tracked.failed:
                    self.fail(req_id, tracked, error)
            return
        rows, per_request = outputs
        # the row cache keeps every computed row; the payload, the rows not published yet
        keeping = self.rows is not None and bool(rows)
        on_host = _rows_on_host(rows, [(row if keeping else row + skip, row + n)
                                       for _, _, row, skip, _, n in publishing])
        once = getattr(model, "stage_output_once", None)
        chunks, first = {}, 0  # out key -> its chunk; the request's first row in on_host
        for req_id, tracked, _, skip, start, n in publishing:
            if keeping:
                computed = {name: t[first:first + n] for name, t in on_host.items()}
                self.rows.keep(req_id, start, computed)
                first += n
                chunk = {name: t[skip:] for name, t in computed.items()} if n > skip else {}
            else:
                chunk = {name: t[first:first + n - skip] for name, t in on_host.items()} \
                    if n > skip else {}
                first += n - skip
            if tracked.failed:
                continue
            if tracked.cached is not None:  # the positions a prefix-cache hit skipped
                chunk = {name: torch.cat([t, chunk[name]]) if name in chunk else t
                         for name, t in tracked.cached.items()}
                tracked.cached = None
            try:
                if chunk and tracked.published == 0 and once is not None:
                    chunk.update({k: v.to("cpu") for k, v in once().items()})
                if req_id in per_request:
                    chunk.update({k: v.to("cpu") for k, v in per_request[req_id].items()})
            except Exception as exc:
                self.fail(req_id, tracked, exc)
                continue
            if chunk:
                chunks[tracked.out_key] = chunk
            tracked.published = max(tracked.published, start + n)
        if chunks:
            try:  # one file for the step's chunks (see PayloadStore.append_many)
                self.store.append_many(chunks)
            except Exception as exc:
                for req_id, tracked, *_ in publishing:
                    if tracked.out_key in chunks:
                        self.fail(req_id, tracked, exc)

    # -- failures -----------------------------------------------------------------
    def fail(self, req_id: str, tracked: _Tracked, exc: Exception) -> None:
        """Record ``exc`` as the request's failure; it emits its stop token from now on."""
        logger.error("stage %s: request %s failed: %s: %s", self.stage_id, req_id,
                     type(exc).__name__, exc, exc_info=exc)
        tracked.failed = True
        if tracked.failure_key is not None and self.store is not None:
            self.store.put_error(tracked.failure_key, f"{type(exc).__name__}: {exc}")

    def override_failed(self, output) -> None:
        """Make each failed request in ``output`` (a ``ModelRunnerOutput``) emit its
        stop token instead of what was sampled, so the scheduler finishes it."""
        if not self._requests:
            return
        for i, req_id in enumerate(output.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is not None and tracked.failed and i < len(output.sampled_token_ids):
                output.sampled_token_ids[i] = [tracked.stop_token]

