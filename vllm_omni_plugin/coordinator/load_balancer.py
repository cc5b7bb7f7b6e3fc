"""Load-balancing policies: pick one replica of a stage for a task.

Names and semantics follow upstream vllm-omni's ``load_balancer`` module
(``vllm_omni.distributed.omni_coordinator``). ``select`` runs on the request path for every
stage submission, so the implementations keep it to a few C calls: no lock,
no per-call allocation, and least-queue-length scans a list only the first
time it sees it (see :class:`LeastQueueLengthBalancer`).
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Protocol, TypedDict


class Task(TypedDict, total=False):
    """What is being routed (passed to :meth:`LoadBalancer.select`).

    The built-in policies ignore it; it is there for policies that inspect
    request metadata (affinity, prompt length, ...).
    """

    request_id: str
    engine_inputs: Any
    sampling_params: Any


class Routable(Protocol):
    """What a policy reads of a candidate replica: the coordinator's
    :class:`~.messages.ReplicaInfo` and the head's stage-pool replicas
    (:class:`vllm_omni_plugin.replicas.replica.Replica`) both are."""

    @property
    def queue_length(self) -> int:
        """The replica's number of unfinished requests (>= 0), as last known."""


class LoadBalancingPolicy(str, Enum):
    """Policy names accepted by :func:`build_load_balancer_factory`."""

    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    LEAST_QUEUE_LENGTH = "least-queue-length"


class LoadBalancer(ABC):
    """Chooses a replica for a task."""

    @abstractmethod
    def select(self, task: Task, replicas: Sequence[Routable]) -> int:
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

    The index is ``getrandbits(32) % len(replicas)``: one C call and one integer
    modulo (~0.13 µs per ``select`` on a dev machine, against ~0.33 µs with
    ``randrange``, which does rejection sampling in Python, and ~0.22 µs with
    ``int(random() * n)``, whose float-to-int conversion is the expensive
    part). Uniform up to a relative bias below ``len(replicas) / 2**32``
    (1.2e-7 for 512 replicas), far below any load difference a balancer could
    notice. Thread-safe under the GIL (one C call on this balancer's own
    ``random.Random``).

    Args:
        seed: Seed of this balancer's private RNG (``None``: OS entropy).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._bits = random.Random(seed).getrandbits

    def select(self, task: Task, replicas: Sequence[Routable]) -> int:
        """Uniform index in ``range(len(replicas))``; ``ValueError`` if empty."""
        n = len(replicas)
        if n == 0:
            raise _empty()
        return self._bits(32) % n


class RoundRobinBalancer(LoadBalancer):
    """Cycles through indices ``0, 1, ..., len(replicas) - 1``.

    Each call continues from the index the previous call returned (``+ 1``,
    modulo the current ``len(replicas)``), so the rotation is only fair while
    the list's length and order stay the same (hub clients publish replicas in
    registration order).

    Thread-safe without a lock: the rotation position comes from an
    ``itertools.count``, whose ``__next__`` is a single C call and therefore
    atomic under the GIL (not on a free-threaded build), so concurrent callers
    never get the same position, and over ``k * len(replicas)`` calls with a
    fixed list every index is returned exactly ``k`` times. When the length
    changes, the rotation restarts from a new counter; callers racing with
    that switch still get indices in range, only the order of a few picks
    around it can deviate (as it can with a lock when calls interleave).

    Args:
        start_index: First index returned (modulo the list length).
    """

    def __init__(self, start_index: int = 0) -> None:
        # index = next count % length; -1: no call yet (never a list's length).
        self._next = itertools.count(start_index).__next__
        self._length = -1

    def select(self, task: Task, replicas: Sequence[Routable]) -> int:
        """Next index in the rotation; ``ValueError`` if ``replicas`` is empty."""
        n = len(replicas)
        if n == self._length:  # > 0: an empty list never becomes the length
            return self._next() % n
        return self._switch_length(n)

    def _switch_length(self, n: int) -> int:
        if n == 0:
            raise _empty()
        count = self._next()
        old = self._length
        if old < 0 or old == n:
            # First call(s): keep the counter (start_index % n first), so
            # concurrent first callers still get consecutive indices. Or
            # another thread switched to this length meanwhile.
            self._length = n
            return count % n
        # One past the index the previous call returned under the old length,
        # modulo the new one (what the lock-based version did); continue from it.
        idx = ((count - 1) % old + 1) % n
        self._next = itertools.count(idx + 1).__next__
        self._length = n
        return idx


class LeastQueueLengthBalancer(LoadBalancer):
    """The replica with the smallest ``queue_length``; ties broken uniformly at random.

    Queue lengths are those last published by the coordinator (refreshed by
    every replica heartbeat).

    The minimum and the indices that reach it are computed once per list
    object and reused while the same list is passed again: hub clients hand
    out immutable snapshots (``OmniCoordClientForHub.get_replicas_for_stage``
    returns the same list until the next broadcast, at most ~10 per second),
    so routing between two broadcasts is one identity check and one random
    pick instead of a scan (~0.2 µs at any size on a dev machine). A list not
    seen before costs one scan (~28 µs for 512 replicas with mixed load, less
    than the previous single-pass loop). The balancer keeps a strong reference
    to the last list, so its identity cannot be recycled for another list.

    Callers must therefore not mutate a list (or the ``queue_length`` of its
    entries) after passing it to :meth:`select`; pass a new list instead (the
    hub client's lists are shared and read-only anyway). As a cheap guard, a
    cached result is also dropped when the list's length changed or when the
    chosen replica's ``queue_length`` is no longer the cached minimum.

    Ties are picked with ``getrandbits(32) % ties`` (see
    :class:`RandomBalancer`: uniform up to a relative bias below
    ``ties / 2**32``). Thread-safe under the GIL: the cache is one tuple,
    replaced whole.

    Args:
        seed: Seed of the tie-breaking RNG (``None``: OS entropy).

    Raises:
        ValueError: From :meth:`select`, if ``replicas`` is empty or any replica
            has a negative ``queue_length``.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._bits = random.Random(seed).getrandbits
        # (list, its length, minimum queue length, indices of the minimum)
        self._cache: tuple[Sequence[Routable] | None, int, int, Sequence[int]] = (
            None, -1, 0, ()
        )

    def select(self, task: Task, replicas: Sequence[Routable]) -> int:
        """Index of a least-loaded replica (see class doc)."""
        cached, n, best_q, ties = self._cache
        if cached is replicas and len(replicas) == n:
            idx = ties[self._bits(32) % len(ties)]
            if replicas[idx].queue_length == best_q:
                return idx
        return self._select_scan(replicas)

    def _select_scan(self, replicas: Sequence[Routable]) -> int:
        """Scan ``replicas``, cache the result for this list object, pick.

        One list of the queue lengths, then C-level passes (``min``,
        ``count``, ``index`` once per tie); when every replica ties (an idle
        pool) the ties are all indices, built without a per-index search.
        """
        if not replicas:
            raise _empty()
        queues = [rep.queue_length for rep in replicas]
        best_q = min(queues)
        if best_q < 0:
            i = queues.index(best_q)
            raise ValueError(f"queue_length must be non-negative (replica {i}: {best_q})")
        n = len(queues)
        k = queues.count(best_q)
        ties: Sequence[int]
        if k == n:
            ties = tuple(range(n))  # a tuple indexes faster than a range
        elif k == 1:
            ties = (queues.index(best_q),)
        else:
            index = queues.index
            i = index(best_q)
            found = [i]
            for _ in range(k - 1):
                i = index(best_q, i + 1)
                found.append(i)
            ties = tuple(found)
        self._cache = (replicas, n, best_q, ties)
        return ties[self._bits(32) % len(ties)]


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
