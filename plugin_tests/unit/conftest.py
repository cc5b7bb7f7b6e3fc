"""Fixtures of the unit tests' control-plane sockets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

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
