"""OmniCoordClientForHub: the head's cached view of the active replicas (SUB).

A background thread receives :class:`ReplicaList` broadcasts, checks and
decodes them with bounds (rejects are counted in ``stats``), and swaps in the
new list plus a per-stage index. Readers never block on the network: the
getters return the cached objects (a lock-protected reference swap), so
routing costs one dict lookup.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import zmq

from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.wire import auth, envelope
from vllm_omni_plugin.wire.codec import (
    BoundedDecoder,
    FrameRejected,
    reject_stat_keys,
)
from vllm_omni_plugin.wire.sockets import ClosedOnExit, WakePipe, connect

from .messages import MAX_LIST_FRAME_BYTES, ReplicaList, empty_replica_list

logger = init_logger(__name__)


class OmniCoordClientForHub(ClosedOnExit):
    """Subscribes to the coordinator's replica list and caches the latest one.

    Args:
        coord_zmq_addr: The coordinator's PUB address.
        cluster_token: Shared secret; when set, broadcasts without its valid
            HMAC are dropped. ``None`` reads ``VLLM_OMNI_PLUGIN_CLUSTER_TOKEN``;
            ``""`` disables.
        on_update: Optional callback invoked with each accepted
            :class:`ReplicaList`, from the receive thread (keep it short;
            exceptions are logged and ignored).

    Raises:
        RuntimeError: If ``coord_zmq_addr`` cannot be connected to.
    """

    def __init__(
        self,
        coord_zmq_addr: str,
        *,
        cluster_token: str | None = None,
        on_update: Callable[[ReplicaList], None] | None = None,
    ) -> None:
        self._coord_zmq_addr = coord_zmq_addr
        self._key = auth.resolve_key(cluster_token)
        self._on_update = on_update
        self._decoder = BoundedDecoder(ReplicaList, MAX_LIST_FRAME_BYTES)

        self._cond = threading.Condition()
        # (full list, per-stage index), swapped as one reference so a lock-free
        # reader never pairs a new list with an old index.
        self._view: tuple[ReplicaList, dict[int, ReplicaList]] = (empty_replica_list(), {})
        self._received_at = -math.inf  # monotonic
        self._stats: dict[str, int] = {
            "frames_received": 0,
            "lists_accepted": 0,
            **reject_stat_keys(),
        }
        self._closed = False

        self._ctx = zmq.Context()
        # libzmq drops (and disconnects on) anything over MAXMSGSIZE; frames
        # between MAX_LIST_FRAME_BYTES and it are received and counted as oversize.
        self._socket = connect(self._ctx, zmq.SUB, coord_zmq_addr, {
            zmq.LINGER: 0,
            zmq.MAXMSGSIZE: 2 * MAX_LIST_FRAME_BYTES,
            zmq.SUBSCRIBE: b"",
        })
        self._waker = WakePipe()
        self._thread = threading.Thread(target=self._run, name="OmniCoordHub", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def get_replica_list(self) -> ReplicaList:
        """The latest :class:`ReplicaList` (shared; do not mutate).

        Before the first broadcast arrives: an empty list with ``timestamp=0.0``.
        """
        return self._view[0]

    def get_replicas_for_stage(self, stage_id: int) -> ReplicaList:
        """The latest active replicas of ``stage_id`` (shared; do not mutate).

        Same ``timestamp``/``seq`` as the full list; empty if the stage has none.
        """
        current, by_stage = self._view
        found = by_stage.get(stage_id)
        if found is not None:
            return found
        return ReplicaList(replicas=[], timestamp=current.timestamp, seq=current.seq)

    @property
    def seconds_since_update(self) -> float:
        """Seconds since the last accepted broadcast (``inf`` if none yet).

        The coordinator republishes every ``republish_interval`` (1 s by
        default), so a value far above that means the coordinator is gone.
        """
        return time.monotonic() - self._received_at

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``frames_received``, ``lists_accepted``, ``rejected.<reason>``."""
        with self._cond:
            return dict(self._stats)

    def wait_for_update(
        self,
        predicate: Callable[[ReplicaList], bool] | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Block until the cached list satisfies ``predicate``.

        Args:
            predicate: Test on the cached :class:`ReplicaList`; default: any
                broadcast has been received.
            timeout: Seconds to wait at most (``None``: forever).

        Returns:
            True if satisfied, False on timeout or close.
        """
        pred = predicate or (lambda rl: rl.timestamp > 0.0)
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or pred(self._view[0]), timeout) and (
                not self._closed
            )

    def close(self) -> None:
        """Stop the receive thread and close the SUB socket. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._waker.wake()
        self._thread.join(timeout=5.0)
        self._socket.close(linger=0)
        self._ctx.term()
        self._waker.close()

    # --------------------------------------------------------------- internals

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        while not self._closed:
            ready = dict(poller.poll())
            if self._closed or self._waker.fd in ready:
                return
            latest: ReplicaList | None = None
            while True:  # drain; only the newest valid list matters
                try:
                    frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    latest = self._decode(frames)
                except FrameRejected as rej:
                    with self._cond:
                        self._stats["frames_received"] += 1
                        self._stats[f"rejected.{rej.reason.value}"] += 1
                    logger.debug("Hub client dropped a broadcast: %s", rej)
                except Exception:  # pragma: no cover - never die on one frame
                    logger.exception("Hub client: error handling a broadcast (dropped)")
            if latest is not None:
                self._install(latest)

    def _decode(self, frames: list[zmq.Frame]) -> ReplicaList:
        decoded = envelope.unseal(self._key, [f.buffer for f in frames], self._decoder)
        with self._cond:
            self._stats["frames_received"] += 1
            self._stats["lists_accepted"] += 1
        return decoded

    def _install(self, replica_list: ReplicaList) -> None:
        grouped: dict[int, list] = {}
        for rep in replica_list.replicas:
            grouped.setdefault(rep.stage_id, []).append(rep)
        by_stage = {
            sid: ReplicaList(replicas=reps, timestamp=replica_list.timestamp, seq=replica_list.seq)
            for sid, reps in grouped.items()
        }
        with self._cond:
            self._view = (replica_list, by_stage)
            self._received_at = time.monotonic()
            self._cond.notify_all()
        if self._on_update is not None:
            try:
                self._on_update(replica_list)
            except Exception:
                logger.exception("Hub client: on_update callback failed")
