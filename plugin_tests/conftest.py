"""Shared fixtures: tiny checkpoints are made once per session by the project's tool."""

from __future__ import annotations

import os
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_OMNI_YAML = os.path.join(REPO, "stage_configs", "qwen3_omni_moe.yaml")
QWEN3_OMNI_PD_YAML = os.path.join(REPO, "stage_configs", "qwen3_omni_moe_pd.yaml")
BAGEL_YAML = os.path.join(REPO, "stage_configs", "bagel.yaml")
#: what the official BAGEL code computed on the tiny BAGEL checkpoint (seed 0), written
#: by scripts/bagel_reference.sh
BAGEL_REFERENCE = os.path.join(REPO, "plugin_tests", "fixtures", "bagel_reference")


@pytest.fixture(scope="session")
def tiny_qwen3_omni(tmp_path_factory) -> str:
    """Path of a tiny Qwen3-Omni checkpoint (seed 0) written by tools.tiny_checkpoint."""
    from vllm_omni_plugin.tools.tiny_checkpoint import main

    out = str(tmp_path_factory.mktemp("ckpt") / "qwen3-omni")
    main(["qwen3-omni", out, "--seed", "0"])
    return out


@pytest.fixture(scope="session")
def tiny_bagel(tmp_path_factory) -> str:
    """Path of a tiny BAGEL checkpoint (seed 0) written by tools.tiny_checkpoint."""
    from vllm_omni_plugin.tools.tiny_checkpoint import main

    out = str(tmp_path_factory.mktemp("ckpt") / "bagel")
    main(["bagel", out, "--seed", "0"])
    return out


PYTHON = sys.executable
#: the `vllm` console script of the interpreter running the tests
VLLM = os.path.join(os.path.dirname(sys.executable), "vllm")


#: Test kinds in the order they run: the cheap, broad ones first (a run cut short by
#: its time budget keeps them).
KIND_ORDER = ("unit", "engine", "e2e")
#: Unix time after which no further test starts (each is skipped, saying so); set by
#: .ci/run for the releases it tests within CI's time limit. Unset: no budget.
DEADLINE_ENV = "VLLM_OMNI_PLUGIN_TEST_DEADLINE"


def pytest_collection_modifyitems(config, items):
    """Run unit tests, then engine tests, then end-to-end tests (each kind in file
    order)."""
    def kind(item) -> int:
        parts = os.path.relpath(str(item.path), os.path.join(REPO, "plugin_tests")).split(os.sep)
        return KIND_ORDER.index(parts[0]) if parts[0] in KIND_ORDER else len(KIND_ORDER)

    items.sort(key=kind)


def _environment_kept():
    """Leave ``os.environ`` as it was before the ``yield``."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


#: Each test, and each test module with its fixtures, leaves ``os.environ`` as it found
#: it. Engine and end-to-end tests hand this process's environment to vLLM's processes,
#: and unit tests run first: a variable a unit test or module fixture sets would reach
#: every engine after it. Seen in CI: ``advertise_host`` under test set ``VLLM_HOST_IP``
#: (``monkeypatch.delenv`` of an unset name does not undo it), and vLLM's Mooncake side
#: channel then failed to bind and the PD engines hung; a module fixture's
#: ``HF_HUB_OFFLINE`` made vLLM look a model name up in the local hub cache.
@pytest.fixture(autouse=True)
def _environment_restored():
    yield from _environment_kept()


@pytest.fixture(autouse=True, scope="module")
def _module_environment_restored():
    yield from _environment_kept()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline and time.time() > float(deadline):
        pytest.skip(f"the run's time budget is spent ({DEADLINE_ENV})")
