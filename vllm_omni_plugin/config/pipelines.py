"""The pipelines shipped with the package (the checkout's ``stage_configs/*.yaml``,
installed as ``vllm_omni_plugin/stage_configs/``) and
what ``--stage-configs-path`` may name: a YAML file, a built-in pipeline by name (the
file's stem: ``qwen3_omni_moe``), or ``auto``, the built-in pipeline of the served
checkpoint's architecture (its ``config.json`` ``model_type``: the pipeline named after
it).
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
#: where the pipelines are: in an installed wheel, the package's ``stage_configs/``
#: (setup.cfg maps the checkout's there); in a source checkout (an editable install), the
#: checkout's top-level ``stage_configs/`` beside the package
BUILTIN_DIR = next((d for d in (_PACKAGE / "stage_configs", _PACKAGE.parent / "stage_configs")
                    if d.is_dir()), _PACKAGE / "stage_configs")
#: ``--stage-configs-path auto``: the built-in pipeline of the checkpoint's ``model_type``
AUTO = "auto"
FLAG = "--stage-configs-path"


def _error(message: str):
    """A ``StageConfigError`` naming the flag (the schema, and pydantic, load only here:
    ``vllm serve --help`` lists the built-in names without them)."""
    from vllm_omni_plugin.config.schema import StageConfigError

    return StageConfigError(message, field=FLAG)


def _suggest(name: str, choices) -> str:
    from vllm_omni_plugin.config.schema import suggest

    return suggest(name, choices)


def builtin_pipelines() -> dict[str, str]:
    """Built-in pipeline name -> absolute path of its YAML, sorted by name."""
    return {path.stem: str(path) for path in sorted(BUILTIN_DIR.glob("*.yaml"))}


def builtin_pipeline(name: str) -> str:
    """The absolute path of the built-in pipeline ``name``.

    Raises:
        StageConfigError: no such built-in pipeline (the names are listed).
    """
    pipelines = builtin_pipelines()
    if name not in pipelines:
        raise _error(f"no built-in pipeline {name!r}{_suggest(name, pipelines)} "
                     f"(built-in: {', '.join(pipelines)})")
    return pipelines[name]


def resolve_stage_configs(value: str, model: str | None = None,
                          revision: str | None = None) -> str:
    """The absolute path of the pipeline YAML ``--stage-configs-path value`` names: an
    existing file, a built-in pipeline's name (with or without ``.yaml``), or
    :data:`AUTO` with ``model`` the served checkpoint (a directory or a Hugging Face Hub
    id, at ``revision``). A value that looks like a path (a directory part or a
    ``.yaml``/``.yml`` suffix) and names no built-in pipeline is returned as a path: the
    loader then says the file is missing.

    Raises:
        StageConfigError: ``value`` is neither a path nor a built-in name; with ``auto``,
            the checkpoint has no ``config.json`` ``model_type`` or no built-in pipeline
            is named after it.
    """
    if os.path.isfile(value):
        return os.path.abspath(value)
    pipelines = builtin_pipelines()
    if value == AUTO:
        return _for_checkpoint(model, revision, pipelines)
    path_like = os.sep in value or value.endswith((".yaml", ".yml"))
    name = value.removesuffix(".yaml")
    if os.sep not in value and name in pipelines:
        return pipelines[name]
    if path_like:
        return os.path.abspath(value)
    raise _error(f"{value!r} is neither a file nor a built-in pipeline"
                 f"{_suggest(name, pipelines)} (built-in: {', '.join(pipelines)}; or {AUTO}: "
                 "the one of the checkpoint's model_type)")


def _for_checkpoint(model: str | None, revision: str | None, pipelines: dict) -> str:
    from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

    config = get_hf_file_to_dict("config.json", model, revision or "main") if model else None
    model_type = (config or {}).get("model_type")
    if not model_type:
        raise _error(f"{AUTO}: the served checkpoint {model!r} has no config.json with a "
                     f"model_type; name a pipeline instead (built-in: {', '.join(pipelines)})")
    if model_type not in pipelines:
        raise _error(f"{AUTO}: no built-in pipeline for model_type {model_type!r} of "
                     f"{model!r} (built-in: {', '.join(pipelines)})")
    return pipelines[model_type]
