"""The head's stage engines starting in lanes (``engine/bootstrap.start_in_lanes``): side by
side across lanes, in order within one (engines sharing a GPU), and stopping when one
fails or the head is told to stop during start-up.

The engines are scripted (a real one takes a minute to start); the interrupt is real: a
SIGINT sent to the main thread while it waits, as Ctrl-C does (vLLM's SIGTERM handler
raises the same ``KeyboardInterrupt`` there)."""

from __future__ import annotations

import signal
import threading

import pytest

from vllm_omni_plugin.engine.bootstrap import start_in_lanes

LANES = [[("a", 0), ("a", 1)], [("b", 0)]]


class ScriptedEngine:
    def __init__(self, name: str, starter: Starter) -> None:
        self.name, self.starter = name, starter

    def shutdown(self) -> None:
        self.starter.log.append(("shutdown", self.name))
        self.starter.shutdowns.release()


class ScriptedReplica:
    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine


class Starter:
    """``start_one`` of scripted engines, each start and shutdown logged: ``fail`` names
    the ones that raise; ``script`` maps a name to what runs as its start begins."""

    def __init__(self, fail=(), script=None) -> None:
        self.log: list = []
        self.fail, self.script = set(fail), dict(script or {})
        self.shutdowns = threading.Semaphore(0)
        self.entered = {name: threading.Event() for name in ("a0", "a1", "b0")}

    def __call__(self, stage: str, replica_id: int) -> ScriptedReplica:
        name = f"{stage}{replica_id}"
        self.log.append(("start", name))
        self.entered[name].set()
        if name in self.script:
            self.script[name]()
        if name in self.fail:
            raise RuntimeError(f"stage {stage} failed to start")
        return ScriptedReplica(ScriptedEngine(name, self))

    def started(self) -> list[str]:
        return [name for kind, name in self.log if kind == "start"]

    def shut_down(self) -> list[str]:
        return sorted(name for kind, name in self.log if kind == "shutdown")


def test_every_lane_starts_each_engine_in_order():
    starter = Starter()
    replicas = start_in_lanes(LANES, starter)
    assert [r.engine.name for r in replicas] == ["a0", "a1", "b0"]
    assert starter.started().index("a0") < starter.started().index("a1")
    assert starter.shut_down() == []


def test_a_failed_engine_fails_the_start_and_shuts_the_others_down():
    """b0 fails while a0 starts: b0's error is what the head raises, and whatever the
    other lane started is shut down."""
    starter = Starter(fail={"b0"})
    with pytest.raises(RuntimeError, match="stage b failed to start"):
        start_in_lanes(LANES, starter)
    assert starter.shut_down() == sorted(set(starter.started()) - {"b0"})
    alone = Starter(fail={"a0"})
    with pytest.raises(RuntimeError, match="stage a failed"):
        start_in_lanes([[("a", 0), ("a", 1)]], alone)
    assert alone.started() == ["a0"]  # its lane starts nothing after it


def test_an_interrupt_during_start_up_starts_nothing_more_and_shuts_down_what_started():
    """SIGINT to the waiting main thread while a0 starts (b0 under way): the interrupt
    propagates, a1 (after a0 in its lane) never starts, a0 and b0 are shut down. a0 is up
    only once b0 has been shut down, which the head does only after it has stopped every
    lane from starting more."""
    main = threading.main_thread().ident
    interrupted = threading.Event()

    def on_sigint(signum, frame):
        if not interrupted.is_set():  # the first one only: as one Ctrl-C
            interrupted.set()
            raise KeyboardInterrupt

    def a0():
        assert starter.entered["b0"].wait(10)
        # sent again until handled: one that lands just before the main thread blocks
        # waits with it until something else wakes it
        while not interrupted.wait(0.05):
            signal.pthread_kill(main, signal.SIGINT)
        assert starter.shutdowns.acquire(timeout=10), "b0 was not shut down"

    starter = Starter(script={"a0": a0})
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            start_in_lanes(LANES, starter)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "a1" not in starter.started()
    assert starter.shut_down() == ["a0", "b0"], starter.log
