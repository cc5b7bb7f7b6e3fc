"""Client-side ZMQ socket set-up shared by the stage and hub clients."""

from __future__ import annotations

import zmq


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
