"""The talker stage's frame bookkeeping (``models/qwen3_omni/talker.py``) under vLLM's
async scheduling, with a scripted code predictor.

Async scheduling (vLLM's default on a GPU) schedules the next step before the sampled
token is checked, so a request whose talker sampled ``codec_eos`` has that token fed back
once more. vLLM's CPU build forces async scheduling off and cannot run it (its runner
has no CUDA streams), so the fed stop token is injected here: the only fake in these
tests, in place of a talker built from vLLM's layers. The engine and pipeline tests run
the real talker.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

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
