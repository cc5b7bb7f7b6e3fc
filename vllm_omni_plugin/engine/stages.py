"""Downstream stage engines: one vLLM ``AsyncLLM`` (a real EngineCore) per stage.

The entry stage is the engine ``vllm serve`` itself builds; every other stage
of the pipeline is started here from its YAML ``engine_args`` on top of the
served model's path, with the plugin's settings in ``additional_config``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm_omni_plugin.config.cli import apply_stage_engine_args
from vllm_omni_plugin.config.settings import ADDITIONAL_CONFIG_KEY
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: Entry-engine settings every downstream stage inherits unless its YAML sets them.
INHERITED_FIELDS = ("tokenizer", "dtype", "seed", "trust_remote_code", "revision",
                    "download_dir", "load_format")


@dataclass
class StageEngine:
    stage_id: int
    name: str
    engine: object  # vllm.v1.engine.async_llm.AsyncLLM


def start_stage_engine(stage, entry_vllm_config, settings: dict) -> StageEngine:
    """Build and start the engine of ``stage`` (a ``StageConfig``).

    Raises:
        RuntimeError: the engine failed to start; the message names the stage.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    model_config = entry_vllm_config.model_config
    args = AsyncEngineArgs(model=model_config.model)
    for name in INHERITED_FIELDS:
        value = getattr(model_config, name, None)
        if value is not None and hasattr(args, name):
            setattr(args, name, value if name != "dtype" else str(value).removeprefix("torch."))
    apply_stage_engine_args(args, stage.engine_args)
    apply_stage_engine_args(args, {"hf_overrides": _model_hf_overrides(args, model_config)})
    args.additional_config = {
        ADDITIONAL_CONFIG_KEY: {**settings, "stage_id": stage.stage_id, "entry": False}
    }
    start = time.perf_counter()
    try:
        vllm_config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        engine = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)
    except Exception as exc:
        raise RuntimeError(
            f"stage {stage.stage_id} ({stage.name!r}) failed to start: {exc}"
        ) from exc
    logger.info("stage %d (%s) engine ready in %.1f s", stage.stage_id, stage.name,
                time.perf_counter() - start)
    return StageEngine(stage.stage_id, stage.name, engine)


def _model_hf_overrides(args, model_config) -> dict:
    from vllm_omni_plugin.models import stage_model_class

    archs = (args.hf_overrides or {}).get("architectures") or []
    cls = stage_model_class(archs[0]) if archs else None
    return cls.engine_hf_overrides(model_config.hf_config) if cls else {}
