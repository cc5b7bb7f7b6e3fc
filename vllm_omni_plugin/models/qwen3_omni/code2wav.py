"""Qwen3-Omni code2wav stage: codec codes -> waveform (non-autoregressive).

Runs HF's ``Qwen3OmniMoeCode2Wav`` once per request, at its first scheduled
step, on the input payload ``codes`` ``[T, num_code_groups]`` int64 and
publishes ``waveform`` ``[num_samples]`` float32 in ``[-1, 1]`` and
``sample_rate`` ``[1]`` int64 (Hz, see :func:`sample_rate`). The request is a
one-token placeholder prompt with ``max_tokens=1``; the sampled token is a
dummy that ends it.
"""

from __future__ import annotations

import torch

from vllm_omni_plugin.models.qwen3_omni.talker_inputs import (
    HF_CODE2WAV_CHUNK_SIZE,
    HF_CODE2WAV_LEFT_CONTEXT,
)
from vllm_omni_plugin.models.stage_model import OmniStageModel, StepInput, StepOutput

#: HF ``generate`` decodes in chunks of 300 codes with 25 codes of left context
#: (transformers' modeling_qwen3_omni_moe.py, ``Qwen3OmniMoeForConditionalGeneration.generate``).
#: Qwen3-Omni's codec decodes to 24 kHz audio (1920 samples per code frame,
#: 12.5 frames/s). HF's code2wav config has no rate field; checkpoints may set
#: ``code2wav_config.output_sample_rate`` (the tiny-checkpoint tool does).
SAMPLE_RATE = 24000


def sample_rate(hf_config) -> int:
    """Output sample rate in Hz of the checkpoint's code2wav."""
    return int(getattr(hf_config.code2wav_config, "output_sample_rate", SAMPLE_RATE) or SAMPLE_RATE)


class Qwen3OmniCode2WavStage(OmniStageModel):
    """Stage model for code2wav (checkpoint prefix ``code2wav.``)."""

    weight_prefix = "code2wav."

    def build(self) -> None:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

        self.code2wav = hf.Qwen3OmniMoeCode2Wav(self.hf_config.code2wav_config)

    def stage_module(self):
        return self.code2wav

    @property
    def vocab_size(self) -> int:
        return 1

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        return []

    def forward_step(self, step: StepInput) -> StepOutput:
        payload = {}
        if step.num_computed == 0 and step.publish_from == 0 and "codes" in step.payload:
            codes = step.payload["codes"].to(torch.long).T.unsqueeze(0)  # [1, groups, T]
            wav = self.code2wav.chunked_decode(codes, chunk_size=HF_CODE2WAV_CHUNK_SIZE,
                                               left_context_size=HF_CODE2WAV_LEFT_CONTEXT)
            payload = {"waveform": wav.reshape(-1).float(),
                       "sample_rate": torch.tensor([sample_rate(self.hf_config)])}
        logits = torch.zeros(self.vocab_size) if step.needs_logits else None
        return StepOutput(logits=logits, payload=payload)
