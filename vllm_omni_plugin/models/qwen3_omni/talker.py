"""Qwen3-Omni talker stage: codec frames from the thinker's output.

Runs HF's ``Qwen3OmniMoeTalkerForConditionalGeneration`` with its decoder on
the backend's paged KV cache (the code predictor keeps HF's own per-frame
cache). Per request (input payload from ``thinker2talker``):

* prefill positions ``0..L-1`` take ``build_talker_prompt(...).prompt_embeds``;
* decode position ``L+s`` takes ``talker_step_embeds`` of frame ``s``;
* code 0 of each frame is the token vLLM samples from HF-processed logits
  (repetition penalty over earlier code-0 ids, codec id suppression);
* :meth:`after_sample` runs the code predictor for codes 1..15 and publishes
  ``codes`` ``[1, num_code_groups]`` int64 per frame (none for ``codec_eos``).

The functions in :mod:`.talker_inputs` are checked against HF ``generate``
(plugin_tests/unit/test_talker_inputs.py).
"""

from __future__ import annotations

import torch

from vllm_omni_plugin.models.qwen3_omni import talker_inputs as ti
from vllm_omni_plugin.models.stage_model import (
    OmniStageModel,
    StepInput,
    StepOutput,
    decoder_kv_shapes,
)
from vllm_omni_plugin.reference.paged_attention import use_paged_attention


class Qwen3OmniTalkerStage(OmniStageModel):
    """Stage model for the talker (checkpoint prefix ``talker.``)."""

    weight_prefix = "talker."

    @classmethod
    def engine_hf_overrides(cls, hf_config):
        # vLLM reads a Qwen3-Omni checkpoint's text config from
        # thinker_config.text_config for every engine (HF's get_text_config), and
        # validates prompt and stop ids against its vocab_size. The talker's
        # tokens are codec ids, so its engine gets the talker's vocabulary size
        # there; this stage never reads thinker_config otherwise.
        vocab = hf_config.talker_config.text_config.vocab_size
        return {"thinker_config": {"text_config": {"vocab_size": vocab}}}

    def build(self) -> None:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

        talker_config = self.hf_config.talker_config
        use_paged_attention(talker_config.text_config)
        # the code predictor keeps HF's own per-frame cache
        talker_config.code_predictor_config._attn_implementation = "sdpa"
        self.talker = hf.Qwen3OmniMoeTalkerForConditionalGeneration(talker_config)
        self.speakers = {v: k for k, v in (talker_config.speaker_id or {}).items()}
        self.suppress = ti.talker_logits_mask(self.hf_config, self.vocab_size)

    def stage_module(self):
        return self.talker

    @property
    def vocab_size(self) -> int:
        return self.talker.config.text_config.vocab_size

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        return decoder_kv_shapes(self.talker.config.text_config)

    def _prompt(self, step: StepInput) -> ti.TalkerPrompt:
        prompt = step.state.get("prompt")
        if prompt is None:
            p = step.payload
            speaker_id = int(p["speaker_id"][0])
            if speaker_id not in self.speakers:
                raise ValueError(f"unknown talker speaker id {speaker_id}")
            prompt = ti.build_talker_prompt(
                self.talker, self.hf_config, p["sequence_ids"], p["thinker_embed"],
                p.get("thinker_hidden"), self.speakers[speaker_id],
                tts_token_embeds=p["tts_embed"],
                prompt_len=int(p["prompt_len"][0]) if "prompt_len" in p else None,
            )
            step.state["prompt"] = prompt
            step.state["frames"] = []
        return prompt

    def forward_step(self, step: StepInput) -> StepOutput:
        prompt = self._prompt(step)
        length = prompt.prompt_embeds.shape[0]
        frames = step.state["frames"]
        rows = []
        for pos in step.positions.tolist():
            if pos < length:
                rows.append(prompt.prompt_embeds[pos:pos + 1])
            else:
                s = pos - length
                rows.append(ti.talker_step_embeds(self.talker, frames[s], s,
                                                  prompt.trailing_text_hidden,
                                                  prompt.tts_pad_embed))
        embeds = torch.cat(rows, dim=0).to(self.dtype).unsqueeze(0)
        out = self.talker.model(inputs_embeds=embeds, position_ids=step.positions.unsqueeze(0),
                                use_cache=False)
        if not step.needs_logits:
            return StepOutput(logits=None)
        hidden = out.last_hidden_state[:, -1]
        step.state["last_hidden"] = hidden
        logits = self.talker.codec_head(hidden)
        params = step.sampling_params
        penalty = params.repetition_penalty if params is not None else 1.0
        scores = ti.process_talker_logits(
            logits, [int(f[0]) for f in frames], self.hf_config,
            repetition_penalty=penalty, suppress_mask=self.suppress,
        )
        return StepOutput(logits=scores[0])

    def after_sample(self, step: StepInput, token_id: int) -> dict[str, torch.Tensor]:
        if token_id == self.hf_config.talker_config.codec_eos_token_id:
            return {}
        params = step.sampling_params
        greedy = params is None or params.temperature < 1e-5
        codes = ti.predict_residual_codes(
            self.talker, step.state["last_hidden"], torch.tensor([token_id]),
            greedy=greedy, generator=step.generator,
        )
        step.state["frames"].append(codes)
        return {"codes": codes.unsqueeze(0)}
