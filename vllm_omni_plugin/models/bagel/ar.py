"""BAGEL's AR stage: vLLM's own ``BagelForConditionalGeneration`` (understanding: text
and image in, text out), extended only to hand the DiT stage its context.

Every forward also keeps, per fed position, each decoder layer's key (after RoPE and the
q/k norm) and value as they enter vLLM's attention: ``k`` and ``v`` ``[n, layers,
kv_heads, head_dim]``. The plugin's worker publishes them for requests that carry an
output payload key; the ``bagel_ar2dit`` processor turns a request's rows into the DiT's
context (what the official code keeps in its ``NaiveCache``). A text-to-image request
runs here with ``max_tokens=1``: its rows are its prompt's.

The keys and values are read by forward pre-hooks on vLLM's ``Attention`` modules, so
the stage runs eagerly (``enforce_eager: true``: a compiled graph would not call them)
and with tensor parallelism 1 (each rank holds only its share of the KV heads).
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.bagel import BagelForConditionalGeneration

from vllm_omni_plugin.compat.internals import bagel_attention_layers


class BagelARStage(BagelForConditionalGeneration):
    """vLLM's BAGEL that also keeps each forward's keys and values (see the module doc).

    Raises:
        ValueError: the engine compiles the model or shards it (tensor parallelism > 1).
    """

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if not vllm_config.model_config.enforce_eager:
            raise ValueError("the BAGEL AR stage reads keys and values as they enter "
                             "attention: set enforce_eager: true in its engine_args")
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("the BAGEL AR stage needs tensor_parallel_size 1 (each rank "
                             "would hold only part of the KV heads)")
        llm = vllm_config.model_config.hf_config.llm_config
        self._kv_shape = (llm.num_key_value_heads, llm.hidden_size // llm.num_attention_heads)
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rows: dict[str, torch.Tensor] = {}
        for attention in bagel_attention_layers(self):
            attention.register_forward_pre_hook(self._capture)

    def _capture(self, module, args) -> None:
        _, key, value = args[:3]
        self._captured.append((key, value))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        """vLLM's BAGEL forward (hidden states ``[num_tokens, hidden_size]``); also keeps
        the keys and values its layers fed to attention as the rows ``k``, ``v``
        ``[num_tokens, layers, kv_heads, head_dim]`` (the model's dtype) that
        :meth:`stage_output_rows` returns (empty when no attention layer ran)."""
        self._captured = []
        out = super().forward(input_ids, positions, intermediate_tensors,
                              inputs_embeds=inputs_embeds, **kwargs)
        n = positions.shape[-1]
        keys = [k.reshape(n, *self._kv_shape) for k, _ in self._captured]
        values = [v.reshape(n, *self._kv_shape) for _, v in self._captured]
        self._rows = {"k": torch.stack(keys, dim=1), "v": torch.stack(values, dim=1)} \
            if keys else {}
        self._captured = []
        return out

    # -- stage outputs (read by the plugin's worker) --------------------------------
    @classmethod
    def payload_bytes_per_position(cls, model_config) -> int:
        """Bytes one prompt position adds to a request's payload: ``k`` and ``v`` of
        every decoder layer (KV heads x head size, the model's dtype)."""
        llm = model_config.hf_config.llm_config
        head_dim = llm.hidden_size // llm.num_attention_heads
        return (2 * llm.num_hidden_layers * llm.num_key_value_heads * head_dim
                * model_config.dtype.itemsize)

    def stage_output_rows(self) -> dict[str, torch.Tensor]:
        """Per-position outputs of the last forward: ``k``, ``v`` ``[num_tokens, layers,
        kv_heads, head_dim]`` in the model's dtype, rows in the model runner's batch order
        (``{}`` when no attention layer ran)."""
        return self._rows
