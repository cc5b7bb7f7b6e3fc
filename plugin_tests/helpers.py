"""Helpers shared by the tests: waiting for a condition (every wait in the
suite is for a condition with a bound, never a bare sleep) and raw sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq

#: Seconds: upper bound for anything that should happen "soon".
WAIT = 5.0


def wait_until(pred: Callable[[], bool], timeout: float = WAIT, interval: float = 0.01) -> bool:
    """True as soon as ``pred()`` holds; its last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


async def until(pred: Callable[[], bool], timeout: float = WAIT, interval: float = 0.01) -> None:
    """Return once ``pred()`` holds, yielding to the event loop meanwhile.

    Raises:
        AssertionError: it did not hold within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(interval)


def dealer(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """A DEALER socket connected to ``addr`` that drops unsent frames on close."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock
