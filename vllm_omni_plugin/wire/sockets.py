"""ZMQ socket set-up shared by the coordinator, the master and their clients."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import zmq

from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: Frames larger than this are dropped by libzmq itself (the sending peer is
#: disconnected) before Python sees them, bounding the memory one peer can make
#: the coordinator buffer. Frames between :data:`MAX_EVENT_FRAME_BYTES` and this
#: are received and counted as ``rejected.oversize``.
ROUTER_HARD_MAX_BYTES = 64 * 1024


_Closing = TypeVar("_Closing", bound="ClosedOnExit")


class ClosedOnExit:
    """A control-plane endpoint that ``with`` closes when the block ends (its
    :meth:`close` is idempotent)."""

    def close(self) -> None:
        """Close the endpoint; subclasses implement it, idempotent."""
        raise NotImplementedError

    def __enter__(self: _Closing) -> _Closing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Linux's default ephemeral range (``net.ipv4.ip_local_port_range``), when unreadable
EPHEMERAL_DEFAULT = (32768, 60999)
#: the lowest port :func:`free_listen_port` picks
LISTEN_PORT_FLOOR = 10000


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The host's ephemeral port range, from which the kernel gives outgoing
    connections (and ``bind(port 0)``) their local port."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def free_listen_port(tries: int = 100) -> int:
    """A TCP port free now, for a server that another process binds later, picked at
    random below the ephemeral range (from :data:`LISTEN_PORT_FLOOR`). A port from
    ``bind(port 0)`` is an ephemeral one: until the server binds it, any outgoing
    connection on the host may take it as its local port, or another process picking
    the same way get it too (seen in CI: a Mooncake bootstrap port "already in use").

    Raises:
        OSError: none of ``tries`` ports was free.
    """
    low = ephemeral_ports()[0]
    top = low - 1 if low - 1 > LISTEN_PORT_FLOOR else 65535
    for port in random.sample(range(LISTEN_PORT_FLOOR, top + 1), tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port among {tries} tried in {LISTEN_PORT_FLOOR}-{top}")


def bind(sock: zmq.Socket, addr: str) -> None:
    """Bind ``sock`` to exactly ``addr`` (IPv6 enabled for bracketed hosts)."""
    if addr.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(addr)


class WakePipe:
    """A pipe a poller thread registers (:attr:`fd`) so other threads can wake it.

    :meth:`wake` never blocks (a full pipe means the poller is already due to
    wake) and never writes to a closed, possibly reused, descriptor.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)

    def wake(self) -> None:
        """Make :attr:`fd` readable so that the poller wakes; never blocks, and does nothing
        after :meth:`close`."""
        with self._lock:
            if self._write_fd >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        """Empty the pipe (call from the poller thread when :attr:`fd` is ready)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self.fd, 4096)

    def close(self) -> None:
        """Close both ends; later :meth:`wake` calls do nothing. Idempotent."""
        with self._lock:
            for fd in (self.fd, self._write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.fd = self._write_fd = -1


def connect(ctx: zmq.Context, socket_type: int, addr: str,
            options: dict[int, int | bytes]) -> zmq.Socket:
    """A ``socket_type`` socket with ``options`` set, connected to ``addr``.

    IPv6 is enabled for ``tcp://[...]`` addresses. On failure the socket and
    ``ctx`` are closed.

    Raises:
        RuntimeError: the address is invalid or cannot be connected to.
    """
    sock = ctx.socket(socket_type)
    try:
        for option, value in options.items():
            sock.setsockopt(option, value)
        if addr.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(addr)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        ctx.term()
        raise RuntimeError(f"cannot connect to coordinator at {addr}: {e}") from e
    return sock


class PollerThread:
    """The daemon thread that serves a ZMQ endpoint, and its stop.

    Once started, the thread polls the sockets given to :meth:`start` and its own
    :class:`WakePipe` (:attr:`waker`, which other threads use to interrupt a poll) for
    input, with the timeout ``timeout()`` gives (ms; None: until input), then calls
    ``step(ready)`` with the ready sockets, until :meth:`stop`. An exception in a step
    is counted (``on_error``) and logged, and the loop goes on 50 ms later: a dead
    loop would silently stall the cluster.

    Args:
        name: the thread's name, in logs.
        step: one round of work on what ``poll`` found ready (``{socket: event}``).
        timeout: milliseconds until the next round is due without input, or None.
        on_error: counts a failed step.
    """

    def __init__(self, name: str, step: Callable[[dict], None],
                 timeout: Callable[[], int | None], on_error: Callable[[], None]) -> None:
        self.name = name
        self.waker = WakePipe()
        self._stopping = threading.Event()
        self._step, self._timeout, self._on_error = step, timeout, on_error
        self._thread: threading.Thread | None = None

    def start(self, sockets: Sequence[zmq.Socket]) -> None:
        """Serve ``sockets`` from now on."""
        self._thread = threading.Thread(target=self._run, args=(sockets,), name=self.name,
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and join the thread (up to ``timeout`` s; a warning if it is
        still running then). The caller closes the sockets, then :attr:`waker`."""
        self._stopping.set()
        self.waker.wake()
        if self._thread is None:
            return
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():  # pragma: no cover - defensive
            logger.warning("%s thread did not stop within %g s", self.name, timeout)

    def _run(self, sockets: Sequence[zmq.Socket]) -> None:
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self.waker.fd, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                ready = dict(poller.poll(self._timeout()))
                if self._stopping.is_set():
                    return
                if self.waker.fd in ready:
                    self.waker.drain()
                self._step(ready)
            except Exception:  # keep serving
                self._on_error()
                logger.exception("%s loop error (continuing)", self.name)
                self._stopping.wait(0.05)
