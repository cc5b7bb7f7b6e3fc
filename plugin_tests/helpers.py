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


def run_engine_script(script, spec: dict, logdir, *, env: dict | None = None,
                      timeout: float = 600, engine: str = "default") -> dict:
    """Run an engine script (``plugin_tests/engine/scripts/*.py``) on its JSON spec, with
    the repository importable, offline; returns the result of its engine ``engine``.
    Fails the test with the script's output when it crashed or that engine failed."""
    import json
    import os
    import subprocess
    import sys

    import pytest

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join(filter(None, (repo,
                                                            os.environ.get("PYTHONPATH")))),
                **(env or {})}
    err_path = os.path.join(str(logdir), f"{engine}.err")
    with open(err_path, "w") as err:
        proc = subprocess.run([sys.executable, str(script), json.dumps(spec)], env=full_env,
                              stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        with open(err_path) as err:
            pytest.fail(f"{os.path.basename(str(script))} exited {proc.returncode}:\n"
                        f"{proc.stdout[-3000:]}\n"
                        f"{err.read()[-6000:]}")
    result = json.loads(lines[-1])["engines"][engine]
    if "error" in result:
        pytest.fail(f"engine {engine!r} failed:\n{result['error']}")
    return result
