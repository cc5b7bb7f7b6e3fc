"""Per-stage settings carried to every vLLM process through ``additional_config``.

vLLM copies ``--additional-config`` into ``vllm_config.additional_config`` in
every process (API server, engine core, workers), so the plugin keeps its
per-stage settings there under :data:`ADDITIONAL_CONFIG_KEY`:

``{"stage_id": int, "stage_configs_path": str, "payload_dir": str, "entry": bool}``

``entry`` is False for the downstream stage engines the orchestrator starts.
"""

from __future__ import annotations

from typing import Any

ADDITIONAL_CONFIG_KEY = "omni_plugin"


def stage_settings(vllm_config) -> dict[str, Any]:
    """The plugin's settings of this engine, ``{}`` when not in omni mode."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    value = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
    return dict(value) if isinstance(value, dict) else {}


def is_entry_stage(vllm_config) -> bool:
    """True for the engine ``vllm serve`` builds in omni mode (not a downstream stage)."""
    settings = stage_settings(vllm_config)
    return bool(settings) and settings.get("entry", True)
