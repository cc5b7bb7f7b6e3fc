"""One request's state while the orchestrator moves it through the stages.

The orchestrator keeps one :class:`PipelineRun` per request and nothing else keyed by
request id: its tasks on stage replicas, the stage it is at, whether it was aborted or
timed out, and what to give back when it ends (the admission's slots, its payload slots,
a downstream task still running). :meth:`Orchestrator._close
<vllm_omni_plugin.engine.orchestrator.Orchestrator._close>` gives all of that back, once.
"""

from __future__ import annotations

import asyncio
import dataclasses

from vllm_omni_plugin.engine.admission import Admission
from vllm_omni_plugin.engine.omni_request import OmniRequest


@dataclasses.dataclass(eq=False)
class PipelineRun:
    """One request in flight through the orchestrator.

    Attributes:
        request_id: The client request's id (vLLM's).
        request: What the request asks beyond vLLM's fields; its result goes there.
        stage_id: The stage it is at (for the timeout's error and the abort's log).
        tasks: ``(stage id, task id)`` of each of its tasks running on a stage replica
            (what an abort aborts).
        aborted: It was aborted (:meth:`Orchestrator.abort`; also once its request
            timeout passed).
        expired: Its request timeout passed: it failed with HTTP 504.
        admission: Its slots of the downstream stages, once admitted.
        payload_key: The payload slot the entry stage publishes its rows to.
        error_key: The error slot of a text request (its worker's failure is written
            there).
        downstream: The downstream stages' task, when it started while the entry stage
            still ran (streaming input).
        final: The entry stage's final output, held back until the downstream stages
            ran (a pipeline request).
    """

    request_id: str
    request: OmniRequest
    stage_id: int
    tasks: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    aborted: bool = False
    expired: bool = False
    admission: Admission | None = None
    payload_key: str | None = None
    error_key: str | None = None
    downstream: asyncio.Future | None = None
    final: object | None = None
