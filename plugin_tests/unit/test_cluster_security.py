"""Secure by default across hosts: a head whose omni master would listen on a network
address needs a cluster token (or the explicit opt-out), and the token never sits in the
parsed arguments vLLM logs. The refusal through ``vllm serve`` is in
``cli/test_serve_cli_errors.py``, across network namespaces in
``e2e/test_replicas_netns.py``."""

from __future__ import annotations

import argparse
import logging
import os

import pytest

from vllm_omni_plugin.config.cli import REDACTED, add_omni_args, exposed_without_token
from vllm_omni_plugin.wire.auth import CLUSTER_TOKEN_ENV, TOKEN_RECIPE, is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"])
def test_loopback_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.231.0.1", "192.0.2.7", "::", "*",
                                  "no-such-host.invalid"])
def test_addresses_other_hosts_may_reach(host):
    assert not is_loopback(host)


def test_a_network_address_without_a_token_is_refused_naming_the_fix():
    with pytest.raises(ValueError) as refused:
        exposed_without_token("10.231.0.1", insecure=False)
    message = str(refused.value)
    for part in ("--omni-master-address 10.231.0.1", CLUSTER_TOKEN_ENV,
                 "--omni-cluster-token", TOKEN_RECIPE, "--omni-cluster-insecure"):
        assert part in message, part


def test_a_token_or_a_loopback_address_needs_nothing(monkeypatch):
    assert exposed_without_token("127.0.0.1", insecure=False) is False
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "s3cret")
    assert exposed_without_token("10.231.0.1", insecure=False) is False


def test_the_opt_out_allows_it_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.omni_plugin"):
        assert exposed_without_token("10.231.0.1", insecure=True) is True
    assert "--omni-cluster-insecure: the omni master and coordinator listen on 10.231.0.1 " \
        "without a cluster token" in caplog.text


def test_the_token_flag_leaves_only_a_placeholder_in_the_arguments(monkeypatch):
    """vLLM logs the non-default arguments of ``vllm serve``: the token goes into the
    environment the head's processes inherit, the namespace keeps a placeholder."""
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    parser = argparse.ArgumentParser()
    add_omni_args(parser)
    args = parser.parse_args(["--omni-cluster-token", "s3cret-value"])
    assert args.omni_cluster_token == REDACTED
    assert "s3cret-value" not in repr(vars(args))
    assert os.environ[CLUSTER_TOKEN_ENV] == "s3cret-value"


@pytest.mark.parametrize("insecure", [True, False])
def test_metrics_show_an_insecure_control_plane(insecure):
    from vllm_omni_plugin.replicas.metrics import PoolCollector

    families = {f.name: f for f in PoolCollector({}, None, insecure).collect()}
    (sample,) = families["vllm_omni:cluster_insecure"].samples
    assert sample.value == float(insecure)
