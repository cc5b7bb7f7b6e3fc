"""ZMQ socket set-up shared by the coordinator, the master and their clients."""

from __future__ import annotations

import contextlib
import os

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


def drain_pipe(fd: int) -> None:
    """Empty a non-blocking wake-up pipe."""
    with contextlib.suppress(BlockingIOError, OSError):
        os.read(fd, 4096)


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
