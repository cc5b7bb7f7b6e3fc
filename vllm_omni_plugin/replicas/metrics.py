"""Per-stage, per-replica metrics in vLLM's ``/metrics`` (Prometheus).

A collector registered in ``prometheus_client``'s default registry, which is
the one vLLM's ``/metrics`` endpoint serves with a single API server. Values
are read from the stage pools at scrape time:

* ``vllm_omni:replica_requests_total{stage,replica,location}`` (counter):
  tasks sent to the replica.
* ``vllm_omni:replica_requests_running{...}`` (gauge): tasks in flight there.
* ``vllm_omni:replica_queue_length{...}`` (gauge): the replica's queue length
  (remote: its last heartbeat, or this head's in-flight tasks when higher).
* ``vllm_omni:replica_status{...,status}`` (gauge, 1 for the current status
  of ``up``/``starting``/``error``/``down``).
* ``vllm_omni:replica_restarts_total{...}`` (counter): engine restarts of a
  local replica after its EngineCore died.
* ``vllm_omni:replica_stalls_total{...}`` (counter): times the replica's EngineCore
  answered no liveness probe within the stall timeout and was killed
  (:mod:`~vllm_omni_plugin.replicas.liveness`).
* ``vllm_omni:stage_resubmissions_total{stage}``: tasks moved to another
  replica after theirs was lost before producing output.
* ``vllm_omni:stage_failovers_failed_total{stage}``: tasks failed because
  their replica was lost after producing output.
* ``vllm_omni:stage_requests_in_flight{stage}`` and
  ``vllm_omni:stage_admission_bound{stage}`` (gauges): pipeline requests holding
  an admission slot of the stage, and the bound.
* ``vllm_omni:admission_waiting`` (gauge) and ``vllm_omni:admission_refused_total``
  (counter): requests waiting for admission, and refused with HTTP 429.
* ``vllm_omni:cluster_insecure`` (gauge): 1 when the head's omni master and coordinator
  listen on a network address without a cluster token (``--omni-cluster-insecure``).
* ``vllm_omni:row_cache_blocks{stage}``, ``vllm_omni:row_cache_bytes{stage}`` (gauges) and
  ``vllm_omni:row_cache_hit_blocks_total{stage}`` (counter): the row caches
  (:mod:`~vllm_omni_plugin.worker.row_cache`) of this head's engines that compute
  prompts, summed per stage (the entry engine; with prefill/decode disaggregation the
  prefill stage's local replicas): KV blocks whose rows they hold, their bytes, and the
  blocks handed to spoken requests that hit the prefix cache; read every
  :data:`ROW_CACHE_POLL_S` by :class:`RowCacheWatch` (absent for a stage whose engines
  keep none).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

STATUSES = ("up", "starting", "error", "down")
#: Seconds between two reads of an engine's row cache counts
ROW_CACHE_POLL_S = 10.0


class RowCacheWatch:
    """Reads the row cache counts of engines every :data:`ROW_CACHE_POLL_S` (through
    vLLM's ``collective_rpc`` of the worker's ``omni_row_cache_stats``), for the
    collector to show per stage; stops reading an engine none of whose workers keeps a
    row cache.

    Args:
        engines: ``(stage_id, engine)`` per engine to read, ``engine`` a callable giving
            its current ``AsyncLLM`` (a replica's engine is replaced when it restarts).
    """

    def __init__(self, engines: list[tuple[int, Callable[[], object]]]) -> None:
        self.engines = engines
        #: per engine the last counts read (:meth:`RowCache.stats`), None before the first
        self.stats: list[dict[str, int] | None] = [None] * len(engines)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start reading (needs the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._poll())

    def stop(self) -> None:
        """Stop reading (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def per_stage(self) -> dict[int, dict[str, int]]:
        """Stage id -> its engines' last counts summed, for the stages with any read."""
        totals: dict[int, dict[str, int]] = {}
        for (stage_id, _), stats in zip(self.engines, self.stats, strict=True):
            if stats is not None:
                total = totals.setdefault(stage_id, dict.fromkeys(stats, 0))
                for key, value in stats.items():
                    total[key] += value
        return totals

    async def _poll(self) -> None:
        reading = list(range(len(self.engines)))
        while reading:
            for i in list(reading):
                stage_id, engine = self.engines[i]
                try:
                    answers = await asyncio.wait_for(
                        engine().collective_rpc("omni_row_cache_stats"), ROW_CACHE_POLL_S)
                except Exception as exc:  # the engine restarting or gone: try again later
                    logger.debug("row cache counts of stage %d not read: %s", stage_id, exc)
                    continue
                kept = [a for a in answers if a]
                if kept:
                    self.stats[i] = kept[0]
                else:  # no worker keeps a row cache
                    reading.remove(i)
            await asyncio.sleep(ROW_CACHE_POLL_S)


class PoolCollector:
    """Reads one head's stage pools and admission gate at scrape time."""

    def __init__(self, pools: dict, gate=None, insecure: bool = False,
                 row_cache: RowCacheWatch | None = None) -> None:
        self.pools = pools
        self.gate = gate
        self.insecure = insecure
        self.row_cache = row_cache

    def collect(self):
        """The metric families listed in the module docstring, with the current values of the
        pools' replicas and the admission gate (``prometheus_client`` calls it at each
        scrape)."""
        labels = ["stage", "replica", "location"]
        total = CounterMetricFamily("vllm_omni:replica_requests", "Tasks sent to the replica.",
                                    labels=labels)
        running = GaugeMetricFamily("vllm_omni:replica_requests_running",
                                    "Tasks in flight on the replica.", labels=labels)
        queue = GaugeMetricFamily("vllm_omni:replica_queue_length",
                                  "Queue length of the replica.", labels=labels)
        status = GaugeMetricFamily("vllm_omni:replica_status",
                                   "1 for the replica's current status.",
                                   labels=[*labels, "status"])
        resub = CounterMetricFamily("vllm_omni:stage_resubmissions",
                                    "Tasks resubmitted after their replica was lost.",
                                    labels=["stage"])
        failed = CounterMetricFamily("vllm_omni:stage_failovers_failed",
                                     "Tasks failed because their replica was lost mid-task.",
                                     labels=["stage"])
        restarts = CounterMetricFamily("vllm_omni:replica_restarts",
                                       "Engine restarts of the replica after its EngineCore "
                                       "died.", labels=labels)
        stalls = CounterMetricFamily("vllm_omni:replica_stalls",
                                     "Times the replica's EngineCore was killed as stalled "
                                     "(no liveness probe answered within the stall "
                                     "timeout).", labels=labels)
        in_flight = GaugeMetricFamily("vllm_omni:stage_requests_in_flight",
                                      "Pipeline requests holding an admission slot of the "
                                      "stage.", labels=["stage"])
        bound = GaugeMetricFamily("vllm_omni:stage_admission_bound",
                                  "Pipeline requests allowed in flight at the stage.",
                                  labels=["stage"])
        waiting = GaugeMetricFamily("vllm_omni:admission_waiting",
                                    "Pipeline requests waiting for admission.")
        refused = CounterMetricFamily("vllm_omni:admission_refused",
                                      "Pipeline requests refused with HTTP 429.")
        insecure = GaugeMetricFamily(
            "vllm_omni:cluster_insecure", "1 when the omni master and coordinator listen on "
            "a network address without a cluster token (--omni-cluster-insecure).",
            value=float(self.insecure))
        gate = self.gate
        if gate is not None:
            waiting.add_metric([], gate.waiting)
            refused.add_metric([], gate.refused_total)
            for stage_id, limit in gate.bounds.items():
                in_flight.add_metric([str(stage_id)], gate.in_flight[stage_id])
                bound.add_metric([str(stage_id)], limit)
        for pool in list(self.pools.values()):
            stage = str(pool.stage_id)
            resub.add_metric([stage], pool.resubmissions)
            failed.add_metric([stage], pool.failures)
            for replica in list(pool.replicas.values()):
                values = [stage, str(replica.replica_id), replica.location]
                total.add_metric(values, replica.requests_total)
                supervisor = getattr(replica, "supervisor", None)
                if supervisor is not None:
                    restarts.add_metric(values, supervisor.restarts)
                stalls.add_metric(values, replica.stalls)
                running.add_metric(values, len(replica.running))
                queue.add_metric(values, replica.queue_length)
                for name in STATUSES:
                    status.add_metric([*values, name], float(replica.status == name))
        yield from (total, running, queue, status, resub, failed, restarts, stalls,
                    in_flight, bound, waiting, refused, insecure)
        yield from self._row_cache()

    def _row_cache(self):
        stages = self.row_cache.per_stage() if self.row_cache is not None else {}
        if not stages:
            return
        for name, kind, doc, key in (
                ("row_cache_blocks", GaugeMetricFamily,
                 "KV blocks whose rows the stage's row caches hold.", "blocks"),
                ("row_cache_bytes", GaugeMetricFamily,
                 "Bytes of rows the stage's row caches hold.", "bytes"),
                ("row_cache_hit_blocks", CounterMetricFamily,
                 "KV blocks whose rows were handed to requests that hit the prefix cache.",
                 "hit_blocks")):
            family = kind(f"vllm_omni:{name}", doc, labels=["stage"])
            for stage_id, stats in sorted(stages.items()):
                family.add_metric([str(stage_id)], stats[key])
            yield family


def register_collector(pools: dict, gate=None, insecure: bool = False,
                       row_cache: RowCacheWatch | None = None) -> PoolCollector:
    """Expose ``pools`` (stage id -> StagePool), the admission ``gate`` (an
    ``AdmissionGate``), whether the control plane is ``insecure`` and the engines'
    ``row_cache`` counts in ``prometheus_client``'s default registry, the one vLLM's
    ``/metrics`` serves; returns the collector for :func:`unregister_collector`."""
    from prometheus_client import REGISTRY

    collector = PoolCollector(pools, gate, insecure, row_cache)
    REGISTRY.register(collector)
    return collector


def unregister_collector(collector: PoolCollector) -> None:
    """Remove ``collector`` from the default registry (no-op when it is not there)."""
    from prometheus_client import REGISTRY

    try:
        REGISTRY.unregister(collector)
    except KeyError:
        pass
