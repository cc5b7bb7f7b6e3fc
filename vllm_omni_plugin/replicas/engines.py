"""Downstream stage engines: one vLLM ``AsyncLLM`` (a real EngineCore) per stage.

The entry stage is the engine ``vllm serve`` itself builds; every replica of
every other stage is started here from its YAML ``engine_args`` on top of the
served model's path (and the inherited fields, see
:func:`~vllm_omni_plugin.config.cli.base_args_from`), with the plugin's
settings in ``additional_config``. The head starts its own replicas, a
headless process (``--headless --stage-id N``) those of one stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm_omni_plugin.config.cli import apply_stage_engine_args
from vllm_omni_plugin.config.placement import Host, apply_cpu_kv_cache, place_engine
from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

@dataclass
class StageEngine:
    """One started engine of a stage.

    Args:
        stage_id: The stage's id.
        name: The stage's name.
        engine: The engine, a started vLLM ``AsyncLLM``.
    """

    stage_id: int
    name: str
    engine: object  # vllm.v1.engine.async_llm.AsyncLLM


def stage_engine_config(stage, base_args: dict, settings: OmniSettings,
                        bootstrap_port: int | None = None):
    """The ``VllmConfig`` of one engine of ``stage`` (a ``StageConfig``): ``base_args``,
    the YAML's ``engine_args`` over them, the stage model's ``hf_overrides``
    (``engine_hf_overrides`` of its class), PD's KV transfer config, its placement
    (the head's plan in ``settings.devices``, else ``runtime.devices``) and KV cache size
    on vLLM's CPU build, and the plugin's settings in ``additional_config``.

    Args:
        stage: The stage's ``StageConfig``.
        base_args: ``EngineArgs`` fields under the YAML's (model path first).
        settings: The plugin's settings (made this stage's, into ``additional_config``).
        bootstrap_port: a prefill stage's KV bootstrap port (None: a free one).

    Raises:
        StageConfigError: the stage's placement does not fit this host (from
            :func:`~vllm_omni_plugin.config.placement.place_engine`).
        RuntimeError: vLLM refused the configuration; the message names the stage.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = AsyncEngineArgs(model=base_args["model"])
    for name, value in base_args.items():
        if hasattr(args, name):
            setattr(args, name, value)
    apply_stage_engine_args(args, stage.engine_args)
    if stage.pd is not None:
        args.kv_transfer_config = _kv_transfer_config(
            stage, settings.cluster.heartbeat_timeout, bootstrap_port)
    host = Host.current()
    env = place_engine(stage, args, settings.devices.get(stage.stage_id, stage.runtime.devices),
                       host, settings.stage_configs_path)
    apply_cpu_kv_cache(stage, args, host)
    args.additional_config = settings.for_stage(stage.stage_id,
                                                placement_env=env).additional_config()
    try:
        apply_stage_engine_args(args, {"hf_overrides": _model_hf_overrides(args)})
        return args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    except Exception as exc:
        raise _start_failed(stage, exc) from exc


def start_stage_engine(stage, base_args: dict, settings: OmniSettings,
                       bootstrap_port: int | None = None) -> StageEngine:
    """Build and start one engine of ``stage`` (a ``StageConfig``) from
    :func:`stage_engine_config` (same arguments).

    Raises:
        RuntimeError: the engine failed to start; the message names the stage.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    start = time.perf_counter()
    vllm_config = stage_engine_config(stage, base_args, settings, bootstrap_port)
    try:
        engine = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)
    except Exception as exc:
        raise _start_failed(stage, exc) from exc
    logger.info("stage %d (%s) engine ready in %.1f s", stage.stage_id, stage.name,
                time.perf_counter() - start)
    return StageEngine(stage.stage_id, stage.name, engine)


def _start_failed(stage, exc: Exception) -> RuntimeError:
    return RuntimeError(f"stage {stage.stage_id} ({stage.name!r}) failed to start: {exc}")


def _kv_transfer_config(stage, heartbeat_timeout: float, bootstrap_port: int | None):
    """A new engine id (and, for a prefill engine, ``bootstrap_port`` or a free one) for
    each start."""
    from vllm.config import KVTransferConfig

    from vllm_omni_plugin.kv_transfer import kv_transfer_config, new_engine_id
    from vllm_omni_plugin.wire.sockets import free_listen_port

    port = (bootstrap_port or free_listen_port()) if stage.is_prefill else None
    return KVTransferConfig(**kv_transfer_config(
        stage.pd, new_engine_id(stage.name), stage.pd.transfer_timeout(heartbeat_timeout),
        port))


def _model_hf_overrides(args) -> dict:
    from vllm_omni_plugin.models import stage_model_class

    archs = (args.hf_overrides or {}).get("architectures") or []
    cls = stage_model_class(archs[0]) if archs else None
    if not hasattr(cls, "engine_hf_overrides"):  # not a plugin stage model, or vLLM-native
        return {}
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code,
                                           revision=args.revision)
    return cls.engine_hf_overrides(hf_config)
