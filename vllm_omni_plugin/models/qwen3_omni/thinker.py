"""Qwen3-Omni thinker stage: text generation that publishes the hidden states
the talker consumes.

Runs HF's ``Qwen3OmniMoeThinkerForConditionalGeneration`` (text input; the
audio and vision towers are built but not yet fed) with attention on the
backend's paged KV cache. For requests with an output payload key it publishes,
per fed position (prompt, then every generated token but the last):

* ``embed``  ``[n, hidden]`` — the input embeddings (HF ``hidden_states[0]``),
* ``hidden`` ``[n, hidden]`` — the output of layer ``talker_config.accept_hidden_layer``
  (HF ``hidden_states[accept_hidden_layer]``),
* ``tts_embed`` ``[3, hidden]`` (first chunk only) — the thinker's input
  embeddings of ``tts_bos_token_id``, ``tts_eos_token_id``, ``tts_pad_token_id``
  (HF builds the talker's TTS markers from the thinker's embedding table),

exactly the tensors HF ``Qwen3OmniMoeForConditionalGeneration.generate``
collects from the thinker for the talker.
"""

from __future__ import annotations

from vllm_omni_plugin.models.qwen3_omni.talker_inputs import tts_token_embeds_from
from vllm_omni_plugin.models.stage_model import (
    OmniStageModel,
    StepInput,
    StepOutput,
    decoder_kv_shapes,
)
from vllm_omni_plugin.reference.paged_attention import use_paged_attention


class Qwen3OmniThinkerStage(OmniStageModel):
    """Stage model for the thinker (checkpoint prefix ``thinker.``)."""

    weight_prefix = "thinker."

    def build(self) -> None:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

        thinker_config = self.hf_config.thinker_config
        use_paged_attention(thinker_config.text_config)
        self.thinker = hf.Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config)
        self.accept_hidden_layer = self.hf_config.talker_config.accept_hidden_layer

    def stage_module(self):
        return self.thinker

    def checkpoint_state(self, state):
        from vllm_omni_plugin.compat.hf_layout import thinker_state_dict

        return thinker_state_dict(state, self.thinker)

    @property
    def vocab_size(self) -> int:
        return self.thinker.config.text_config.vocab_size

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        return decoder_kv_shapes(self.thinker.config.text_config)

    def forward_step(self, step: StepInput) -> StepOutput:
        out = self.thinker.model(
            input_ids=step.token_ids.unsqueeze(0),
            position_ids=step.positions.unsqueeze(0),
            use_cache=False,
            output_hidden_states=step.publish,
        )
        last = out.last_hidden_state[0]
        logits = self.thinker.lm_head(last[-1]) if step.needs_logits else None
        payload = {}
        if step.publish:
            skip = max(0, step.publish_from - step.num_computed)
            payload = {
                "embed": out.hidden_states[0][0][skip:],
                "hidden": out.hidden_states[self.accept_hidden_layer][0][skip:],
            }
            if step.publish_from == 0 and step.num_computed == 0:
                payload["tts_embed"] = tts_token_embeds_from(
                    self.thinker.get_input_embeddings(), self.hf_config)
        return StepOutput(logits=logits, payload=payload)
