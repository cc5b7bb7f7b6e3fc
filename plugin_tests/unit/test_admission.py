"""AdmissionGate: bounds per stage, first come first served, bounded wait, 429.

Pure asyncio, no engines: the gate only counts. The same gate in a real
`vllm serve` under a burst is in ``test_hardening_serve.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from vllm_omni_plugin.engine.admission import AdmissionGate, AdmissionRefused


def test_admits_up_to_the_tightest_stage_then_refuses_after_the_wait():
    async def scenario():
        gate = AdmissionGate({1: 2, 2: 3}, timeout_s=0.05)
        held = [await gate.admit(), await gate.admit()]
        with pytest.raises(AdmissionRefused, match=r"stage\(s\) \[1\]") as info:
            await gate.admit()
        return gate, held, info.value

    gate, held, refused = asyncio.run(scenario())
    assert gate.in_flight == {1: 2, 2: 2} and gate.refused_total == 1
    assert refused.status == 429 and refused.retry_after >= 1
    assert gate.waiting == 0


def test_leaving_one_stage_frees_its_slot_and_the_first_waiter_goes_first():
    async def scenario():
        gate = AdmissionGate({1: 1, 2: 1}, timeout_s=5.0)
        first = await gate.admit()
        order = []

        async def wait(name):
            admission = await gate.admit()
            order.append(name)
            return admission

        a = asyncio.create_task(wait("a"))
        await asyncio.sleep(0)
        b = asyncio.create_task(wait("b"))
        await asyncio.sleep(0)
        assert gate.waiting == 2
        first.release(1)  # left stage 1, still in stage 2: no room yet
        await asyncio.sleep(0)
        assert order == [] and gate.in_flight == {1: 0, 2: 1}
        first.release_all()
        second = await a
        second.release_all()
        await b
        return gate, order

    gate, order = asyncio.run(scenario())
    assert order == ["a", "b"] and gate.in_flight == {1: 1, 2: 1}


def test_release_is_idempotent_and_cancelled_waiters_hold_nothing():
    async def scenario():
        gate = AdmissionGate({1: 1}, timeout_s=5.0)
        held = await gate.admit()
        waiter = asyncio.create_task(gate.admit())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        held.release(1)
        held.release(1)
        held.release_all()
        return gate

    gate = asyncio.run(scenario())
    assert gate.in_flight == {1: 0} and gate.waiting == 0 and gate.refused_total == 0


def test_retry_after_follows_recent_request_durations():
    gate = AdmissionGate({1: 1}, timeout_s=30.0)
    assert gate.retry_after() == 30  # nothing measured yet: the timeout
    gate._finished(2.2)
    assert gate.retry_after() == 3


def test_bounds_must_be_positive():
    with pytest.raises(ValueError, match="admission bounds must be >= 1"):
        AdmissionGate({1: 0}, timeout_s=1.0)
