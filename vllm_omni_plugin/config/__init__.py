"""Multi-stage pipeline config: schema (pydantic) and YAML loader."""

from vllm_omni_plugin.config.loader import load_pipeline_config, parse_pipeline_config
from vllm_omni_plugin.config.schema import (
    PipelineConfig,
    RuntimeConfig,
    StageConfig,
    StageConfigError,
)

__all__ = [
    "PipelineConfig",
    "RuntimeConfig",
    "StageConfig",
    "StageConfigError",
    "load_pipeline_config",
    "parse_pipeline_config",
]
