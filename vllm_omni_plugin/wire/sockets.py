"""ZMQ socket set-up shared by the coordinator, the master and their clients."""

from __future__ import annotations

import contextlib
import os
import threading

import zmq

#: Frames larger than this are dropped by libzmq itself (the sending peer is
#: disconnected) before Python sees them, bounding the memory one peer can make
#: the coordinator buffer. Frames between :data:`MAX_EVENT_FRAME_BYTES` and this
#: are received and counted as ``rejected.oversize``.
ROUTER_HARD_MAX_BYTES = 64 * 1024


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
