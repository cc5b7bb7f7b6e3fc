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
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STATUSES = ("up", "starting", "error", "down")


class PoolCollector:
    """Reads one head's stage pools and admission gate at scrape time."""

    def __init__(self, pools: dict, gate=None, insecure: bool = False) -> None:
        self.pools = pools
        self.gate = gate
        self.insecure = insecure

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


def register_collector(pools: dict, gate=None, insecure: bool = False) -> PoolCollector:
    """Expose ``pools`` (stage id -> StagePool), the admission ``gate`` (an
    ``AdmissionGate``) and whether the control plane is ``insecure`` in
    ``prometheus_client``'s default registry, the one vLLM's ``/metrics`` serves; returns
    the collector for :func:`unregister_collector`."""
    from prometheus_client import REGISTRY

    collector = PoolCollector(pools, gate, insecure)
    REGISTRY.register(collector)
    return collector


def unregister_collector(collector: PoolCollector) -> None:
    """Remove ``collector`` from the default registry (no-op when it is not there)."""
    from prometheus_client import REGISTRY

    try:
        REGISTRY.unregister(collector)
    except KeyError:
        pass
