"""Fixtures of the unit tests: their control-plane sockets, and a payload store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from vllm_omni_plugin.payload_store import PayloadStore
from vllm_omni_plugin.wire.auth import CLUSTER_TOKEN_ENV


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch):
    """Unsigned frames unless a test sets a cluster token itself."""
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    """A private ZMQ context, destroyed with its sockets after the test."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def store(tmp_path) -> PayloadStore:
    """A payload store of the test's own (the worker's payload channel tests)."""
    return PayloadStore(str(tmp_path / "payloads"))
