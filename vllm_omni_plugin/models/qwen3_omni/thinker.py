"""Qwen3-Omni thinker stage: vLLM's own thinker, extended to hand the talker its inputs.

The model is vLLM's ``Qwen3OmniMoeThinkerForConditionalGeneration`` (its layers, fused MoE,
attention backend, multimodal processor and weight loader), unchanged except that every
forward also keeps, per fed position (prompt, then every generated token but the last):

* ``embed``  ``[n, hidden]`` - the decoder input (HF ``hidden_states[0]``: token embeddings,
  or the audio/vision encoder features at multimodal positions),
* ``hidden`` ``[n, hidden]`` - the residual stream after decoder layer
  ``talker_config.accept_hidden_layer - 1`` (HF ``hidden_states[accept_hidden_layer]``),
* ``positions`` ``[n, 3]`` int64 - the ``(t, h, w)`` M-RoPE position vLLM fed (HF
  ``get_rope_index``): the talker's positions for image and video prompts derive from them
  (:func:`~vllm_omni_plugin.models.qwen3_omni.talker_inputs.talker_mrope_positions`),

and once per request ``tts_embed`` ``[3, hidden]``: the thinker's input embeddings of
``tts_bos_token_id``, ``tts_eos_token_id`` and ``tts_pad_token_id`` (HF builds the talker's
TTS markers from the thinker's embedding table). These are exactly the tensors HF
``Qwen3OmniMoeForConditionalGeneration.generate`` collects from the thinker for the talker;
the plugin's worker (:mod:`vllm_omni_plugin.worker`) publishes them for requests that carry
an output payload key.

The two per-position tensors come from vLLM's own auxiliary-hidden-state outputs (the
EAGLE-3 seam, ``SupportsEagle3.set_aux_hidden_state_layers``): layer index 0 is the decoder
input and index ``k`` the residual stream after layer ``k - 1``, the same numbering as HF's
``hidden_states`` tuple.

CUDA graphs: the rows are copied, inside ``forward``, into buffers allocated once with the
model (``max_num_batched_tokens`` rows each: at hidden size 2048 in bf16, 8 KiB per row
for ``embed`` and ``hidden`` together, 64 MiB at 8,192 tokens). A FULL graph captures those
copies, so a replay, which skips ``forward``'s Python, still rewrites the rows of its step;
the thinker keeps vLLM's default graph mode (``stage_outputs_graph_safe``).
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

from vllm_omni_plugin.models.qwen3_omni.talker_inputs import tts_token_embeds_from
from vllm_omni_plugin.worker.stage_io import keep_rows


class Qwen3OmniThinkerStage(Qwen3OmniMoeThinkerForConditionalGeneration):
    """vLLM's Qwen3-Omni thinker that also keeps the talker's inputs of each forward.

    Raises:
        ValueError: ``talker_config.accept_hidden_layer`` is not in
            ``[1, text_config.num_hidden_layers]``.
    """

    #: the rows survive CUDA graph replay (see the module docstring)
    stage_outputs_graph_safe = True

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hf_config = vllm_config.model_config.hf_config
        self._omni_config = hf_config
        num_layers = hf_config.thinker_config.text_config.num_hidden_layers
        layer = hf_config.talker_config.accept_hidden_layer
        if not 1 <= layer <= num_layers:
            raise ValueError(
                f"talker_config.accept_hidden_layer must be in [1, {num_layers}], got {layer}")
        #: HF's last hidden_states entry is after the final norm: the model's own output.
        self._hidden_is_output = layer == num_layers
        self.set_aux_hidden_state_layers((0,) if self._hidden_is_output else (0, layer))
        # allocated on the device vLLM builds the model on (its default-device context)
        rows = vllm_config.scheduler_config.max_num_batched_tokens
        width = hf_config.thinker_config.text_config.hidden_size
        dtype = vllm_config.model_config.dtype
        self._rows = {"embed": torch.zeros(rows, width, dtype=dtype),
                      "hidden": torch.zeros(rows, width, dtype=dtype),
                      "positions": torch.zeros(rows, 3, dtype=torch.int64)}
        self._tts_embed: torch.Tensor | None = None  # set by load_weights

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        """vLLM's thinker forward; on the last pipeline rank it returns the hidden states
        ``[num_tokens, hidden_size]`` (without the auxiliary ones) after copying the
        step's ``embed``, ``hidden`` and ``positions`` rows into the buffers that
        :meth:`stage_output_rows` returns. Other ranks' intermediate tensors pass through."""
        out = super().forward(input_ids, positions, intermediate_tensors,
                              inputs_embeds=inputs_embeds, **kwargs)
        if not isinstance(out, tuple):  # not the last pipeline rank
            return out
        hidden_states, aux = out
        keep_rows(self._rows, embed=aux[0],
                  hidden=hidden_states if self._hidden_is_output else aux[1],
                  positions=positions.t())  # M-RoPE positions are [3, n]
        return hidden_states

    # -- stage outputs (read by the plugin's worker) --------------------------------
    @classmethod
    def payload_bytes_per_position(cls, model_config) -> int:
        """Bytes one prompt or generated position adds to a request's payload:
        ``embed`` and ``hidden`` (thinker hidden size, the model's dtype) and
        ``positions`` (3 x int64)."""
        width = model_config.hf_config.thinker_config.text_config.hidden_size
        return 2 * width * model_config.dtype.itemsize + 3 * 8

    def stage_output_rows(self) -> dict[str, torch.Tensor]:
        """Per-position outputs of the last forward, in the model runner's batch order:
        ``embed``, ``hidden`` ``[max_num_batched_tokens, hidden]`` (model dtype) and
        ``positions`` ``[max_num_batched_tokens, 3]`` int64, whose first ``num_tokens`` rows
        are the step's (the same tensors every step)."""
        return self._rows

    def load_weights(self, weights):
        """vLLM's weight loading, then :meth:`stage_output_once`'s ``tts_embed``: on every
        tensor-parallel rank, since the vocabulary-parallel embedding's forward all-reduces
        over them and only one rank publishes (a lookup there alone hung TP 2)."""
        loaded = super().load_weights(weights)
        self._tts_embed = self._tts_rows()
        return loaded

    @torch.no_grad()
    def _tts_rows(self) -> torch.Tensor:
        return tts_token_embeds_from(self.get_language_model().model.embed_tokens,
                                     self._omni_config)

    def stage_output_once(self) -> dict[str, torch.Tensor]:
        """Per-request outputs, published with a request's first chunk:
        ``tts_embed`` ``[3, hidden]`` in the model's dtype, computed when the weights were
        loaded (here, on the first call, where vLLM loaded none: ``--load-format dummy``)."""
        if self._tts_embed is None:
            self._tts_embed = self._tts_rows()
        return {"tts_embed": self._tts_embed}
