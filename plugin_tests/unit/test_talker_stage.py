"""The talker stage (``models/qwen3_omni/talker.py``): its engine's configuration as the
head builds it, and its frame bookkeeping under vLLM's async scheduling, with a scripted
code predictor.

Async scheduling (vLLM's default on a GPU) schedules the next step before the sampled
token is checked, so a request whose talker sampled ``codec_eos`` has that token fed back
once more. vLLM's CPU build forces async scheduling off and cannot run it (its runner
has no CUDA streams), so the fed stop token is injected here: the only fake in these
tests, in place of a talker built from vLLM's layers. The engine and pipeline tests run
the real talker.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from plugin_tests.conftest import QWEN3_OMNI_PD_YAML, QWEN3_OMNI_YAML
from vllm_omni_plugin.models.qwen3_omni.talker import Qwen3OmniTalkerStage, _Request

CODEBOOK = 8
#: the codec specials follow the codebook: 8 + 2 stands for ``codec_eos``
CODEC_EOS = CODEBOOK + 2
HIDDEN = 4
GROUPS = 16


class _CodePredictor(nn.Module):
    """Residual codes 1..15 for every row (the real one is checked against HF)."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(CODEBOOK, HIDDEN) for _ in range(GROUPS - 1))

    def predict(self, hidden, code0_embeds, greedy, generators):
        return (torch.arange(1, GROUPS) % CODEBOOK).expand(hidden.shape[0], -1)

    def get_input_embeddings(self):
        return self.tables


def _talker() -> Qwen3OmniTalkerStage:
    talker = Qwen3OmniTalkerStage.__new__(Qwen3OmniTalkerStage)
    nn.Module.__init__(talker)
    talker.model = nn.Module()
    talker.model.embed_tokens = nn.Embedding(CODEBOOK + 16, HIDDEN)
    talker.code_predictor = _CodePredictor()
    talker.codebook_size = CODEBOOK
    talker._outputs = {}
    return talker


def _state() -> _Request:
    prompt = SimpleNamespace(trailing_text_hidden=torch.zeros(2, HIDDEN),
                             tts_pad_embed=torch.zeros(1, HIDDEN))
    return _Request(prompt, greedy=True, generator=None, hidden=torch.zeros(HIDDEN))


def test_a_fed_stop_token_makes_no_frame():
    """Request ``a`` feeds code 0 = 3 (a frame), request ``b`` its stop token: only ``a``
    publishes a frame (before the fix, ``b`` published one whose code 0 was
    ``codec_eos``, which code2wav's processor rejects, failing the request)."""
    talker, a, b = _talker(), _state(), _state()
    input_ids = torch.tensor([3, CODEC_EOS])
    rows = torch.zeros(2, HIDDEN)
    with torch.no_grad():
        talker._predict_frames([("a", a, 0, 0), ("b", b, 1, 4)], input_ids, rows)
    assert set(talker._outputs) == {"a"}
    codes = talker._outputs["a"]["codes"]
    assert codes.device.type == "cpu" and codes.dtype == torch.long
    assert codes.tolist() == [[3, *(torch.arange(1, GROUPS) % CODEBOOK).tolist()]]
    assert len(a.frames) == 1 and b.frames == []


# -- the talker engine's configuration: sized as the talker, with room for its frames --
#: the talker's text config in a copy of the tiny checkpoint's config, unlike the
#: thinker's in every field vLLM sizes an engine from (the tiny checkpoint's are equal)
_TALKER_SHAPES = {"hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 6,
                  "num_key_value_heads": 3, "head_dim": 8, "intermediate_size": 80,
                  "moe_intermediate_size": 24}


def _talker_engine_config(tiny_qwen3_omni, tmp_path, yaml_path):
    """The talker engine's ``VllmConfig`` as the head builds it from ``yaml_path`` over
    a checkpoint whose talker differs in shape from its thinker (config only)."""
    import json

    import vllm_omni_plugin
    from vllm_omni_plugin.config.loader import load_pipeline_config
    from vllm_omni_plugin.config.settings import OmniSettings
    from vllm_omni_plugin.replicas.engines import stage_engine_config

    vllm_omni_plugin.register()
    with open(f"{tiny_qwen3_omni}/config.json") as f:
        config = json.load(f)
    config["talker_config"]["text_config"].update(_TALKER_SHAPES)
    (tmp_path / "config.json").write_text(json.dumps(config))
    talker = load_pipeline_config(yaml_path).stage(1)
    settings = OmniSettings(stage_configs_path=yaml_path, payload_dir=str(tmp_path / "run"))
    return config, stage_engine_config(talker, {"model": str(tmp_path), "dtype": "float32"},
                                       settings)


@pytest.mark.parametrize("yaml_path", [QWEN3_OMNI_YAML, QWEN3_OMNI_PD_YAML],
                         ids=["default", "pd"])
def test_the_talker_engine_is_sized_as_the_talker(tiny_qwen3_omni, tmp_path, yaml_path):
    """vLLM sizes every engine of a Qwen3-Omni checkpoint from the thinker's text config:
    the talker engine's model config has the talker's layers, heads, head size, width
    and codec vocabulary (it had the thinker's but the vocabulary), and a context that
    holds a user turn as long as the thinker's context, the assistant prefix and
    MAX_FRAMES frames (the shipped YAMLs capped it at 4096 positions)."""
    from vllm_omni_plugin.models.qwen3_omni.code2wav import MAX_FRAMES
    from vllm_omni_plugin.models.qwen3_omni.talker_inputs import ASSISTANT_PREFIX_LEN

    config, vllm_config = _talker_engine_config(tiny_qwen3_omni, tmp_path, yaml_path)
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    talker = config["talker_config"]["text_config"]
    assert model.get_num_layers(parallel) == talker["num_hidden_layers"]
    assert model.get_num_attention_heads(parallel) == talker["num_attention_heads"]
    assert model.get_num_kv_heads(parallel) == talker["num_key_value_heads"]
    assert model.get_head_size() == talker["head_dim"]
    assert model.get_hidden_size() == talker["hidden_size"]
    assert model.get_vocab_size() == talker["vocab_size"]
    thinker_context = config["thinker_config"]["text_config"]["max_position_embeddings"]
    assert model.max_model_len == thinker_context + ASSISTANT_PREFIX_LEN + MAX_FRAMES
    # the talker's own rotary tables reach as far
    assert model.hf_config.talker_config.text_config.max_position_embeddings \
        == model.max_model_len
