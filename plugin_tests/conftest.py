"""Shared fixtures: tiny checkpoints are made once per session by the project's tool."""

from __future__ import annotations

import os
import sys

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
