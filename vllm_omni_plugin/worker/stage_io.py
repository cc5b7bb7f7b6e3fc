"""Per-request bookkeeping of a stage's output payloads, independent of any model runner.

A request sent by the orchestrator names payload keys in its
``SamplingParams.extra_args`` (:func:`vllm_omni_plugin.extra_args.payload_keys`). For a
request with an output key, every engine step appends the rows of the positions it fed
(``[n, ...]`` per tensor, the model's :meth:`stage_output_rows`) to the payload store, the
first chunk also carrying the model's per-request :meth:`stage_output_once` tensors. A
request whose keys are malformed, or whose publishing fails, is *failed*: the failure is
recorded under its failure key (the orchestrator fails that request with an error naming
the stage) and the worker makes it emit its stop token, so the engine keeps serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.payload_store import PayloadStore

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
        #: req id -> first position fed this step (set by :meth:`begin_step`)
        self._computed: dict[str, int] = {}

    # -- scheduling ---------------------------------------------------------------
    def begin_step(self, scheduler_output) -> bool:
        """Track the step's new and finished requests; True when a request scheduled
        this step publishes (the caller then calls :meth:`publish` after the forward)."""
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._add(new)
        if not self._requests or not any(
                (t := self._requests.get(r)) is not None and t.out_key and not t.failed
                for r in scheduler_output.num_scheduled_tokens):
            return False
        cached = scheduler_output.scheduled_cached_reqs
        self._computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            self._computed[new.req_id] = new.num_computed_tokens
        return True

    def _add(self, new) -> None:
        if new.req_id in self._requests:  # resumed after preemption (model runner V2)
            return
        params = new.sampling_params
        keys, problem = request_payload_keys(new.req_id, params, self.store)
        if problem is None and not keys.failure_key:
            return  # a plain request: nothing to track
        tracked = _Tracked(out_key=keys.output, failure_key=keys.failure_key,
                           stop_token=stop_token_of(params))
        self._requests[new.req_id] = tracked
        if problem is not None:
            self._fail(new.req_id, tracked, problem)
        elif keys.output and new.num_computed_tokens:
            # Payload rows map one-to-one to fed positions; a prefix-cache hit skips some.
            self._fail(new.req_id, tracked, RuntimeError(
                f"stage {self.stage_id}: a request publishing payloads hit the prefix cache "
                f"({new.num_computed_tokens} tokens); set enable_prefix_caching: false in "
                "this stage's engine_args"))

    # -- after the forward --------------------------------------------------------
    def publish(self, model, batch_req_ids: list[str], scheduler_output) -> None:
        """Append each publishing request's rows of this step to the store.

        Args:
            model: the stage model (``stage_output_rows()`` / ``stage_output_once()``).
            batch_req_ids: the scheduled requests in the model runner's row order; each
                owns ``scheduler_output.num_scheduled_tokens[req_id]`` consecutive rows.
        """
        rows = getattr(model, "stage_output_rows", None)
        rows = rows() if rows is not None else None
        offset = 0
        for req_id in batch_req_ids:
            n = scheduler_output.num_scheduled_tokens[req_id]
            tracked = self._requests.get(req_id)
            if tracked is not None and tracked.out_key and not tracked.failed:
                try:
                    self._publish(model, rows, tracked, offset, n, self._computed[req_id])
                except Exception as exc:
                    self._fail(req_id, tracked, exc)
            offset += n

    def _publish(self, model, rows, tracked: _Tracked, offset: int, n: int, start: int):
        if rows is None:
            raise RuntimeError(f"stage {self.stage_id}: {type(model).__name__} publishes no "
                               "stage outputs, but the request asks for them")
        skip = max(0, tracked.published - start)
        if skip < n:  # else every row was published before this recompute
            chunk = {name: t[offset + skip:offset + n].to("cpu") for name, t in rows.items()}
            if start == 0 and tracked.published == 0:
                once = getattr(model, "stage_output_once", None)
                chunk.update({k: v.to("cpu") for k, v in (once() if once else {}).items()})
            self.store.append(tracked.out_key, chunk)
        tracked.published = max(tracked.published, start + n)

    # -- failures -----------------------------------------------------------------
    def _fail(self, req_id: str, tracked: _Tracked, exc: Exception) -> None:
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

