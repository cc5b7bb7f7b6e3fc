"""OmniCoordClientForStage: a stage replica's link to the coordinator (DEALER).

Sends one ``update`` event on construction (registration), one on every
:meth:`~OmniCoordClientForStage.update_info`, a ``heartbeat`` every
``heartbeat_interval`` seconds from a background thread (with the live queue
length from an optional provider callable), and a final ``DOWN`` on
:meth:`~OmniCoordClientForStage.close`. ZMQ reconnects by itself; since every
event carries the full replica state, the next heartbeat re-registers the
replica with a restarted coordinator.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable

import zmq

from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.wire import auth, envelope
from vllm_omni_plugin.wire.codec import encode
from vllm_omni_plugin.wire.sockets import ClosedOnExit, connect

from .messages import EventType, ReplicaEvent, ReplicaStatus

logger = init_logger(__name__)

#: Events queued while the coordinator is unreachable; older state is useless
#: once newer state is sent, so a short queue suffices (excess is dropped).
_SEND_HWM = 64


class OmniCoordClientForStage(ClosedOnExit):
    """Client used by a stage replica to report its status to the coordinator.

    Args:
        coord_zmq_addr: The coordinator's ROUTER address.
        input_addr: This replica's input address (its identity).
        output_addr: This replica's output address.
        stage_id: Stage this replica serves (>= 0).
        heartbeat_interval: Seconds between heartbeats (default 5.0, upstream's
            value for its 30 s timeout; keep it well under the coordinator's
            ``heartbeat_timeout``). ``None`` or ``0`` starts no heartbeat
            thread; call :meth:`heartbeat` yourself.
        queue_length_provider: Zero-argument callable returning the live number
            of unfinished requests, called before each heartbeat (from the
            heartbeat thread). Exceptions and invalid values are logged and the
            last known value is sent.
        cluster_token: Shared secret used to sign events (see :mod:`.auth`).
            ``None`` reads ``VLLM_OMNI_PLUGIN_CLUSTER_TOKEN``; ``""`` disables.
        close_linger: Seconds :meth:`close` waits for the final ``DOWN`` event
            to leave the socket (default 1.0).

    Raises:
        ValueError: On a negative ``stage_id`` or ``heartbeat_interval``.
        RuntimeError: If ``coord_zmq_addr`` cannot be connected to.
    """

    def __init__(
        self,
        coord_zmq_addr: str,
        input_addr: str,
        output_addr: str,
        stage_id: int,
        *,
        heartbeat_interval: float | None = 5.0,
        queue_length_provider: Callable[[], int] | None = None,
        cluster_token: str | None = None,
        close_linger: float = 1.0,
    ) -> None:
        if stage_id < 0:
            raise ValueError(f"stage_id must be >= 0, got {stage_id}")
        if heartbeat_interval is not None and heartbeat_interval < 0:
            raise ValueError(f"heartbeat_interval must be >= 0, got {heartbeat_interval}")
        self._coord_zmq_addr = coord_zmq_addr
        self._input_addr = input_addr
        self._output_addr = output_addr
        self._stage_id = stage_id
        self._key = auth.resolve_key(cluster_token)
        self._close_linger_ms = max(0, int(close_linger * 1000))
        self.queue_length_provider = queue_length_provider

        self._status = ReplicaStatus.UP
        self._queue_length = 0
        self._send_lock = threading.Lock()  # socket + state
        self._closed = False
        self._stop = threading.Event()
        self._provider_failed = False
        self.stats: dict[str, int] = {"events_sent": 0, "events_dropped": 0, "provider_errors": 0}

        self._ctx = zmq.Context()
        self._socket = connect(self._ctx, zmq.DEALER, coord_zmq_addr,
                               {zmq.SNDHWM: _SEND_HWM, zmq.LINGER: 0})

        with self._send_lock:
            self._send_locked(EventType.UPDATE)

        self._thread: threading.Thread | None = None
        if heartbeat_interval:
            self._thread = threading.Thread(
                target=self._heartbeat_loop,
                args=(float(heartbeat_interval),),
                name=f"OmniCoordHeartbeat-{stage_id}",
                daemon=True,
            )
            self._thread.start()

    # ------------------------------------------------------------------ public

    @property
    def status(self) -> ReplicaStatus:
        """Status last reported by this client."""
        return self._status

    @property
    def queue_length(self) -> int:
        """Queue length last reported by this client."""
        return self._queue_length

    def update_info(
        self,
        status: ReplicaStatus | str | None = None,
        queue_length: int | None = None,
    ) -> None:
        """Change the reported status and/or queue length and send an ``update`` now.

        Raises:
            ValueError: If both are ``None``, ``status`` is not a
                :class:`ReplicaStatus` value, or ``queue_length`` is negative.
            RuntimeError: If the client is closed.
        """
        if status is None and queue_length is None:
            raise ValueError("at least one of status or queue_length must be provided")
        new_status = ReplicaStatus(status) if status is not None else None
        if queue_length is not None:
            queue_length = _check_queue_length(queue_length)
        with self._send_lock:
            if self._closed:
                raise RuntimeError("OmniCoordClientForStage is closed")
            if new_status is not None:
                self._status = new_status
            if queue_length is not None:
                self._queue_length = queue_length
            self._send_locked(EventType.UPDATE)

    def heartbeat(self) -> None:
        """Refresh the queue length from the provider and send a heartbeat now.

        Raises:
            RuntimeError: If the client is closed.
        """
        queue_length = self._poll_provider()
        with self._send_lock:
            if self._closed:
                raise RuntimeError("OmniCoordClientForStage is closed")
            if queue_length is not None:
                self._queue_length = queue_length
            self._send_locked(EventType.HEARTBEAT)

    def close(self) -> None:
        """Stop heartbeats, send a final ``DOWN`` event, close the socket. Idempotent."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._send_lock:
            self._status = ReplicaStatus.DOWN
            self._send_locked(EventType.UPDATE)
            self._socket.close(linger=self._close_linger_ms)
        self._ctx.term()

    # --------------------------------------------------------------- internals

    def _send_locked(self, event_type: EventType) -> None:
        payload = encode(
            ReplicaEvent(
                input_addr=self._input_addr,
                output_addr=self._output_addr,
                stage_id=self._stage_id,
                status=self._status,
                queue_length=self._queue_length,
                event_type=event_type,
            )
        )
        parts = envelope.seal(self._key, payload)
        try:
            self._socket.send_multipart(parts, zmq.NOBLOCK)
            self.stats["events_sent"] += 1
        except zmq.ZMQError as e:  # Again: queue full (coordinator unreachable)
            self.stats["events_dropped"] += 1
            logger.debug("Replica %s: %s event dropped: %s", self._input_addr, event_type.value, e)

    def _poll_provider(self) -> int | None:
        provider = self.queue_length_provider
        if provider is None:
            return None
        try:
            value = _check_queue_length(provider())
        except Exception as e:
            self.stats["provider_errors"] += 1
            if not self._provider_failed:
                self._provider_failed = True
                logger.warning(
                    "Replica %s: queue_length_provider failed (%r); sending last known value",
                    self._input_addr, e,
                )
            return None
        return value

    def _heartbeat_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.heartbeat()
            except RuntimeError:  # closed concurrently
                return
            except Exception:  # pragma: no cover - keep heartbeating
                logger.exception("Replica %s: heartbeat failed", self._input_addr)


def _check_queue_length(value: object) -> int:
    """``value`` as a non-negative int (numpy integers accepted); ``ValueError`` otherwise."""
    if isinstance(value, bool):
        raise ValueError("queue_length must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"queue_length must be an int, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"queue_length must be >= 0, got {value}")
    return value
