"""The "Omni" argument group of ``vllm serve`` and its hand-off to the engines.

``--stage-configs-path`` switches omni mode on. No flag is spelled exactly
``--omni``: vLLM >= 0.20 hands such a command line to the upstream
``vllm_omni`` package before any plugin loads.
"""

from __future__ import annotations

import argparse
import os

from vllm_omni_plugin.config.settings import ADDITIONAL_CONFIG_KEY

GROUP_TITLE = "Omni"


def add_omni_args(parser: argparse.ArgumentParser) -> None:
    """Add the Omni group to ``parser`` (no-op when already present)."""
    if any(g.title == GROUP_TITLE for g in parser._action_groups):
        return
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="Multi-stage omni pipelines (vllm-omni-plugin). Omni mode is on when "
        "--stage-configs-path is given.",
    )
    group.add_argument(
        "--stage-configs-path",
        type=str,
        default=None,
        metavar="YAML",
        help="Stage pipeline definition (YAML; see stage_configs/ in vllm-omni-plugin). "
        "Switches on omni mode: the served model becomes the pipeline's entry stage and "
        "the other stages start as their own vLLM engines. Validated before any engine starts.",
    )


def apply_omni_args(args: argparse.Namespace, engine_args) -> None:
    """Configure the entry stage's ``engine_args`` from the omni flags (in place).

    Loads and validates the pipeline, applies the entry stage's ``engine_args``
    from the YAML over the command line's, records the plugin's settings in
    ``additional_config`` and installs the audio-output middleware.

    Raises:
        StageConfigError: the YAML is invalid (names file, stage and field).
    """
    path = getattr(args, "stage_configs_path", None)
    if not path:
        return
    from vllm_omni_plugin.config.loader import load_pipeline_config
    from vllm_omni_plugin.kv_transfer.payload import default_run_dir

    pipeline = load_pipeline_config(path)
    require_stage_backend()
    entry = pipeline.entry_stage
    apply_stage_engine_args(engine_args, entry.engine_args)
    extra = dict(engine_args.additional_config or {})
    extra[ADDITIONAL_CONFIG_KEY] = {
        "stage_id": entry.stage_id,
        "stage_configs_path": os.path.abspath(path),
        "payload_dir": default_run_dir(),
        "entry": True,
    }
    engine_args.additional_config = extra
    middleware = list(getattr(args, "middleware", None) or [])
    from vllm_omni_plugin.entrypoints.audio_output import MIDDLEWARE_QUALNAME

    if MIDDLEWARE_QUALNAME not in middleware and hasattr(args, "middleware"):
        args.middleware = [*middleware, MIDDLEWARE_QUALNAME]


def require_stage_backend() -> None:
    """Fail early, with the fix, when the stage models cannot run on this platform.

    Raises:
        RuntimeError: vLLM resolved a platform other than the plugin's
            reference backend (stage models have no accelerator worker yet).
    """
    from vllm.platforms import current_platform

    from vllm_omni_plugin import envs
    from vllm_omni_plugin.reference.platform import QUALNAME

    if f"{type(current_platform).__module__}.{type(current_platform).__name__}" != QUALNAME:
        raise RuntimeError(
            "omni mode (--stage-configs-path) runs its stage models on the plugin's reference "
            f"backend, but vLLM selected {type(current_platform).__name__}; stage models have "
            f"no accelerator worker yet. Set {envs.BACKEND}=reference to run them on CPU."
        )


def apply_stage_engine_args(engine_args, overrides: dict) -> None:
    """Set each ``EngineArgs`` field in ``overrides``; ``hf_overrides`` dicts merge."""
    for key, value in overrides.items():
        if key == "hf_overrides" and isinstance(value, dict):
            merged = dict(engine_args.hf_overrides or {}) if isinstance(
                engine_args.hf_overrides, dict) else {}
            merged.update(value)
            value = merged
        setattr(engine_args, key, value)
