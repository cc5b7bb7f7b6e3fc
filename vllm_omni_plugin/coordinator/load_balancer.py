"""Load-balancing policies: pick one replica of a stage for a task.

Names and semantics follow upstream vllm-omni's ``load_balancer`` module (seed
``omni-coordinator-api.txt``). ``select`` runs on the request path for every
stage submission, so the implementations avoid per-call allocations: no
temporary lists, one or two passes over ``replicas``.
"""

from __future__ import annotations

import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, TypedDict

from .messages import ReplicaInfo


class Task(TypedDict, total=False):
    """What is being routed (passed to :meth:`LoadBalancer.select`).

    The built-in policies ignore it; it is there for policies that inspect
    request metadata (affinity, prompt length, ...).
    """

    request_id: str
    engine_inputs: Any
    sampling_params: Any


class LoadBalancingPolicy(str, Enum):
    """Policy names accepted by :func:`build_load_balancer_factory`."""

    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    LEAST_QUEUE_LENGTH = "least-queue-length"


class LoadBalancer(ABC):
    """Chooses a replica for a task."""

    @abstractmethod
    def select(self, task: Task, replicas: Sequence[ReplicaInfo]) -> int:
        """Route ``task`` to one of ``replicas``.

        Args:
            task: The task to route (may be ignored by the policy).
            replicas: Candidate replicas (normally the UP replicas of one stage).

        Returns:
            Index of the chosen replica in ``replicas``.

        Raises:
            ValueError: If ``replicas`` is empty.
        """


def _empty() -> ValueError:
    return ValueError("replicas must not be empty")


class RandomBalancer(LoadBalancer):
    """Uniformly random choice.

    Args:
        seed: Seed of this balancer's private RNG (``None``: OS entropy).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._randrange = random.Random(seed).randrange

    def select(self, task: Task, replicas: Sequence[ReplicaInfo]) -> int:
        """Uniform index in ``range(len(replicas))``; ``ValueError`` if empty."""
        n = len(replicas)
        if n == 0:
            raise _empty()
        return self._randrange(n)


class RoundRobinBalancer(LoadBalancer):
    """Cycles through indices ``0, 1, ..., len(replicas) - 1``.

    The running index is taken modulo ``len(replicas)`` on every call, so the
    rotation is only fair while the list's length and order stay the same (hub
    clients publish replicas in registration order). Thread-safe: a lock
    guards the index.

    Args:
        start_index: First index returned (modulo the list length).
    """

    def __init__(self, start_index: int = 0) -> None:
        self._next_index = start_index
        self._lock = threading.Lock()

    def select(self, task: Task, replicas: Sequence[ReplicaInfo]) -> int:
        """Next index in the rotation; ``ValueError`` if ``replicas`` is empty."""
        n = len(replicas)
        if n == 0:
            raise _empty()
        with self._lock:
            idx = self._next_index % n
            self._next_index = idx + 1
        return idx


class LeastQueueLengthBalancer(LoadBalancer):
    """The replica with the smallest ``queue_length``; ties broken uniformly at random.

    Queue lengths are those last published by the coordinator (refreshed by
    every replica heartbeat).

    Args:
        seed: Seed of the tie-breaking RNG (``None``: OS entropy).

    Raises:
        ValueError: From :meth:`select`, if ``replicas`` is empty or any replica
            has a negative ``queue_length``.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._randrange = random.Random(seed).randrange

    def select(self, task: Task, replicas: Sequence[ReplicaInfo]) -> int:
        """Index of a least-loaded replica (see class doc)."""
        if not replicas:
            raise _empty()
        # Pass 1: minimum, number of ties, negative check -- no allocation.
        best_q = replicas[0].queue_length
        best_i = 0
        ties = 0
        i = 0
        for rep in replicas:
            q = rep.queue_length
            if q < best_q:
                if q < 0:
                    raise ValueError(
                        f"queue_length must be non-negative (replica {i}: {q})"
                    )
                best_q, best_i, ties = q, i, 1
            elif q == best_q:
                ties += 1
            i += 1
        if best_q < 0:
            raise ValueError(f"queue_length must be non-negative (replica 0: {best_q})")
        if ties == 1:
            return best_i
        # Pass 2: the k-th tied replica, k uniform in [0, ties).
        k = self._randrange(ties)
        for j in range(best_i, len(replicas)):
            if replicas[j].queue_length == best_q:
                if k == 0:
                    return j
                k -= 1
        raise AssertionError("unreachable: tie count changed during select")


_POLICIES: dict[LoadBalancingPolicy, Callable[[], LoadBalancer]] = {
    LoadBalancingPolicy.RANDOM: RandomBalancer,
    LoadBalancingPolicy.ROUND_ROBIN: RoundRobinBalancer,
    LoadBalancingPolicy.LEAST_QUEUE_LENGTH: LeastQueueLengthBalancer,
}


def build_load_balancer_factory(policy: str | LoadBalancingPolicy) -> Callable[[], LoadBalancer]:
    """Translate a policy name (``--omni-lb-policy``) into a per-pool balancer factory.

    Args:
        policy: A :class:`LoadBalancingPolicy` or its value; case-insensitive,
            ``_`` accepted for ``-`` (``"least_queue_length"``).

    Returns:
        A zero-argument callable returning a *new* balancer (one per stage pool,
        since round-robin keeps per-instance state).

    Raises:
        ValueError: If ``policy`` names no known policy.
    """
    if isinstance(policy, LoadBalancingPolicy):
        key = policy
    else:
        name = str(policy).strip().lower().replace("_", "-")
        try:
            key = LoadBalancingPolicy(name)
        except ValueError:
            choices = ", ".join(p.value for p in LoadBalancingPolicy)
            raise ValueError(
                f"unknown load-balancing policy {policy!r}; choose one of: {choices}"
            ) from None
    return _POLICIES[key]
