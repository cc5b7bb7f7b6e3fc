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
  of ``up``/``down``/``error``).
* ``vllm_omni:stage_resubmissions_total{stage}``: tasks moved to another
  replica after theirs was lost before producing output.
* ``vllm_omni:stage_failovers_failed_total{stage}``: tasks failed because
  their replica was lost after producing output.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STATUSES = ("up", "down", "error")


class _PoolCollector:
    """One per process; reads every registered set of pools."""

    def __init__(self) -> None:
        self.pool_sets: list[dict] = []

    def collect(self):
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
        for pool in [p for pools in list(self.pool_sets) for p in list(pools.values())]:
            stage = str(pool.stage_id)
            resub.add_metric([stage], pool.resubmissions)
            failed.add_metric([stage], pool.failures)
            for replica in list(pool.replicas.values()):
                values = [stage, str(replica.replica_id), replica.location]
                total.add_metric(values, replica.requests_total)
                running.add_metric(values, len(replica.running))
                queue.add_metric(values, replica.queue_length)
                for name in STATUSES:
                    status.add_metric([*values, name], float(replica.status == name))
        yield from (total, running, queue, status, resub, failed)


_collector: _PoolCollector | None = None


def register_metrics(pools: dict) -> None:
    """Expose ``pools`` (stage id -> StagePool) in the default Prometheus registry."""
    global _collector
    from prometheus_client import REGISTRY

    if _collector is None:
        _collector = _PoolCollector()
        REGISTRY.register(_collector)
    _collector.pool_sets.append(pools)


def unregister_metrics(pools: dict) -> None:
    if _collector is not None:
        _collector.pool_sets[:] = [p for p in _collector.pool_sets if p is not pools]
