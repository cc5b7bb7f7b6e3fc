"""Read, parse and validate a pipeline config YAML file."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from vllm_omni_plugin.config.schema import (
    PDConfig,
    PipelineConfig,
    RuntimeConfig,
    StageConfig,
    StageConfigError,
    StreamingConfig,
    suggest,
)
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


def load_pipeline_config(path: str | os.PathLike, *,
                         check_processors: bool = True) -> PipelineConfig:
    """Read, parse and fully validate the pipeline config at ``path``.

    Args:
        path: YAML file.
        check_processors: also check ``input_processor`` names against the
            processor registry (loads processor plugins).
    Raises:
        StageConfigError: unreadable file, malformed YAML (names line and
            column), or any schema/graph/processor error (names file, stage
            and field).
    """
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise StageConfigError("file not found", path=p) from None
    except (OSError, UnicodeDecodeError) as e:
        raise StageConfigError(f"cannot read file: {e}", path=p) from None
    cfg = parse_pipeline_config(_parse_yaml(text, p), path=p, check_processors=check_processors)
    logger.debug("loaded pipeline config %s: stages %s", p,
                 [(s.stage_id, s.name) for s in cfg.stages])
    return cfg


def parse_pipeline_config(data: Any, *, path: str | None = None,
                          check_processors: bool = True) -> PipelineConfig:
    """Validate already-parsed config ``data`` (a mapping); see :func:`load_pipeline_config`.

    Raises:
        StageConfigError: ``data`` is not a mapping, or is invalid.
    """
    if not isinstance(data, Mapping):
        raise StageConfigError(
            f"top level must be a mapping with a 'stages' list, got {type(data).__name__}",
            path=path)
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        errors = [_convert(err, data, path) for err in e.errors()]
        errors[0].more = errors[1:]
        raise errors[0] from None
    if check_processors and any(s.input_processor for s in cfg.stages):
        from vllm_omni_plugin.processors.registry import available_processors

        cfg.check_processors(available_processors(), path=path)
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys instead of keeping the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
            except TypeError:  # unhashable key; SafeLoader reports it
                pass
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, path: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = ", ".join(filter(None, [e.context, e.problem])) or "invalid YAML"
        raise StageConfigError(f"{where}malformed YAML: {what}", path=path) from None
    except yaml.YAMLError as e:
        raise StageConfigError(f"malformed YAML: {e}", path=path) from None


#: The models of a stage's nested blocks, by field (for their unknown-field errors).
_NESTED: dict[str, type[BaseModel]] = {
    "runtime": RuntimeConfig, "pd": PDConfig, "streaming": StreamingConfig}


def _convert(err: dict[str, Any], data: Mapping, path: str | None) -> StageConfigError:
    """Map one pydantic error dict to a StageConfigError naming stage and field."""
    loc = err["loc"]
    idx = loc[1] if len(loc) >= 2 and loc[0] == "stages" and isinstance(loc[1], int) else None
    rest = loc[2:] if idx is not None else loc
    sid, sname = _stage_ident(data, idx)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, StageConfigError):
        return StageConfigError(
            cause.message, path=path, field=cause.field or _dotted(rest),
            stage_id=cause.stage_id if cause.stage_id is not None else sid,
            stage_name=cause.stage_name or sname, stage_index=idx)
    if err["type"] == "extra_forbidden":
        model: type[BaseModel] = (
            PipelineConfig if idx is None
            else _NESTED.get(rest[0], StageConfig) if len(rest) > 1 else StageConfig)
        msg = (f"unknown field{suggest(str(rest[-1]), model.model_fields)}; "
               f"allowed: {', '.join(model.model_fields)}")
    else:
        msg = str(cause) if isinstance(cause, Exception) else err["msg"]
        if isinstance(err.get("input"), (str, int, float, bool)):
            msg += f" (got {err['input']!r})"
    return StageConfigError(msg, path=path, stage_id=sid, stage_name=sname,
                            stage_index=idx, field=_dotted(rest))


def _stage_ident(data: Mapping, idx: int | None) -> tuple[int | None, str | None]:
    """Best-effort (stage_id, name) of raw ``data['stages'][idx]``."""
    stages = data.get("stages")
    if idx is None or not isinstance(stages, list) or idx >= len(stages):
        return None, None
    raw = stages[idx]
    if not isinstance(raw, Mapping):
        return None, None
    sid, name = raw.get("stage_id"), raw.get("name")
    return (sid if isinstance(sid, int) and not isinstance(sid, bool) else None,
            name if isinstance(name, str) else None)


def _dotted(loc: tuple) -> str | None:
    """``('runtime', 'num_replicas')`` -> ``'runtime.num_replicas'``;
    ``('inputs', 0)`` -> ``'inputs[0]'``; ``()`` -> ``None``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None
