"""Replicated stages: where a downstream stage's requests run.

* :mod:`.cluster` -- the head's control plane (master, coordinator, hub) and
  the attach/detach of remote replicas;
* :mod:`.pool` -- :class:`~.pool.StagePool`: routing, affinity, bounded wait,
  failover;
* :mod:`.replica` -- local (in-process engine) and remote (task channel) replicas;
* :mod:`.engines` -- a stage's engine (one vLLM ``AsyncLLM``), as the head and a headless
  process start it;
* :mod:`.server` -- ``vllm serve --headless --stage-id N``: the replica side;
* :mod:`.protocol` -- task-channel wire messages; :mod:`.task` -- one task on
  one engine; :mod:`.metrics` -- ``/metrics``.

Design: ``docs/design/replicas.md``.
"""
