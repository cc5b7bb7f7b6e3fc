"""Environment variables read by the plugin (all prefixed ``VLLM_OMNI_PLUGIN_``).

Each is read at call time, not import time, so tests and child processes see
the current environment.
"""

from __future__ import annotations

import os

#: Parent directory of the per-run inter-stage payload store (default:
#: ``/dev/shm`` when it exists, else the system temp dir).
PAYLOAD_DIR = "VLLM_OMNI_PLUGIN_PAYLOAD_DIR"
#: Shared cluster token signing the coordinator's control-plane frames (unset: no signing).
CLUSTER_TOKEN = "VLLM_OMNI_PLUGIN_CLUSTER_TOKEN"
#: Set to 1 to register even on a vLLM outside the supported range.
ALLOW_UNSUPPORTED_VLLM = "VLLM_OMNI_PLUGIN_ALLOW_UNSUPPORTED_VLLM"


def payload_dir() -> str | None:
    """The payload store's parent directory from ``VLLM_OMNI_PLUGIN_PAYLOAD_DIR``, ``None``
    when unset or empty (the caller then picks the default)."""
    return os.environ.get(PAYLOAD_DIR) or None


def cluster_token() -> str | None:
    """The cluster token, ``None`` when unset or empty."""
    return os.environ.get(CLUSTER_TOKEN) or None


def allow_unsupported_vllm() -> bool:
    """Whether ``VLLM_OMNI_PLUGIN_ALLOW_UNSUPPORTED_VLLM`` is ``1``, ``true`` or ``yes``
    (case-insensitive, surrounding whitespace ignored); False when unset."""
    return os.environ.get(ALLOW_UNSUPPORTED_VLLM, "0").strip().lower() in ("1", "true", "yes")
