"""compat/hf_layout.py: checkpoint names follow the thinker module's layout."""

from __future__ import annotations

import types

import torch

from vllm_omni_plugin.compat.hf_layout import thinker_state_dict

CHECKPOINT_KEYS = [
    "audio_tower.layers.0.fc1.weight",
    "visual.blocks.0.attn.qkv.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
]


def _state():
    return {k: torch.zeros(1) for k in CHECKPOINT_KEYS}


def test_installed_layout_matches_module_names(tiny_qwen3_omni):
    """With the installed transformers, the shim maps real checkpoint names onto
    the real HF thinker module's parameter names: unchanged before 5.21 (vLLM
    0.31/0.32 pins), nested under ``.model`` from 5.21 (vLLM 0.30 resolves it)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    thinker = hf.Qwen3OmniMoeThinkerForConditionalGeneration(
        AutoConfig.from_pretrained(tiny_qwen3_omni).thinker_config)
    state = _state()
    mapped = thinker_state_dict(state, thinker)
    assert set(mapped) <= set(thinker.state_dict())
    if not hasattr(thinker.model, "language_model"):
        assert mapped is state


def test_new_layout_renames_into_the_nested_model():
    """transformers >= 5.21 (what vLLM 0.30 resolves) nests audio_tower, visual and
    the text model under ``.model``. That layout cannot be built with the
    transformers installed here, so a stand-in object carries just the attribute
    the shim detects."""
    thinker = types.SimpleNamespace(model=types.SimpleNamespace(language_model=object()))
    renamed = thinker_state_dict(_state(), thinker)
    assert sorted(renamed) == sorted([
        "model.audio_tower.layers.0.fc1.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "model.language_model.embed_tokens.weight",
        "lm_head.weight",
    ])
