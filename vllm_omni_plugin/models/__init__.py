"""Stage model classes, registered with vLLM's ModelRegistry by lazy name."""

from __future__ import annotations

#: architecture name -> "module:Class"; referenced from stage YAMLs through
#: ``engine_args.hf_overrides.architectures``. Names are prefixed so they never
#: overwrite an architecture vLLM (or upstream vllm-omni) registers.
_QWEN3_OMNI = "vllm_omni_plugin.models.qwen3_omni"
STAGE_MODELS = {
    "OmniPluginQwen3OmniThinker": f"{_QWEN3_OMNI}.thinker:Qwen3OmniThinkerStage",
    "OmniPluginQwen3OmniTalker": f"{_QWEN3_OMNI}.talker:Qwen3OmniTalkerStage",
    "OmniPluginQwen3OmniCode2Wav": f"{_QWEN3_OMNI}.code2wav:Qwen3OmniCode2WavStage",
    "OmniPluginBagelAR": "vllm_omni_plugin.models.bagel.ar:BagelARStage",
    "OmniPluginBagelDiT": "vllm_omni_plugin.models.bagel.dit:BagelDiTStage",
}


def register_models() -> list[str]:
    """Register every stage model lazily; returns the names registered."""
    from vllm import ModelRegistry

    for arch, target in STAGE_MODELS.items():
        ModelRegistry.register_model(arch, target)
    return list(STAGE_MODELS)


def stage_model_class(arch: str):
    """The stage model class of ``arch`` (imported), or None for other architectures."""
    import importlib

    target = STAGE_MODELS.get(arch)
    if target is None:
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
