"""Base class for the plugin's stage models.

A stage model is registered with vLLM's ``ModelRegistry`` (so vLLM's config,
scheduler and engine core treat it like any generative model) and is executed
by a worker one request-slice at a time through :meth:`OmniStageModel.forward_step`.
The reference worker (``vllm_omni_plugin.reference``) is such a worker; the thinker
runs on vLLM's own model runner instead (``models/qwen3_omni/thinker.py``).

Models are built on Hugging Face modeling code with attention routed through
``transformers.AttentionInterface`` to the active backend's paged KV cache,
the approach of vLLM's own Transformers backend.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class StepInput:
    """One request's slice of one engine step.

    Attributes:
        req_id: vLLM's internal request id.
        token_ids: ``[n]`` int64, the scheduled tokens.
        positions: ``[n]`` int64, their absolute positions.
        num_computed: tokens of the request already in the KV cache.
        payload: the request's input payload (tensors from the orchestrator),
            empty when the stage takes none.
        state: per-request scratch the model keeps across steps.
        needs_logits: the slice ends the known sequence, so a token is sampled.
        publish: the request has an output payload key; return chunks to publish.
        publish_from: positions below this were already published (they are
            being recomputed after a preemption): publish no rows for them.
        sampling_params: the request's ``vllm.SamplingParams``.
    """

    req_id: str
    token_ids: torch.Tensor
    positions: torch.Tensor
    num_computed: int
    payload: dict[str, torch.Tensor]
    state: dict[str, Any] = field(default_factory=dict)
    needs_logits: bool = True
    publish: bool = False
    publish_from: int = 0
    sampling_params: Any = None
    generator: torch.Generator | None = None


@dataclass
class StepOutput:
    """What a model returns for one :class:`StepInput`.

    Attributes:
        logits: ``[vocab]`` float32 for the last position, or None when the
            slice does not need a sample.
        payload: tensors to append to the request's output payload (dim 0 is
            concatenated across steps).
    """

    logits: torch.Tensor | None
    payload: dict[str, torch.Tensor] = field(default_factory=dict)


def decoder_kv_shapes(text_config) -> list[tuple[int, int]]:
    """``(num_kv_heads, head_size)`` for each layer of an HF decoder config
    (``head_dim``, else ``hidden_size // num_attention_heads``)."""
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads)
    return [(text_config.num_key_value_heads, head_dim)] * text_config.num_hidden_layers


class OmniStageModel(nn.Module):
    """A pipeline stage runnable by the plugin's workers.

    Subclasses set :attr:`weight_prefix` (the checkpoint key prefix of the
    stage's sub-model, e.g. ``"thinker."``) and implement :meth:`build`,
    :meth:`forward_step` and :meth:`kv_cache_shapes`.
    """

    weight_prefix: str = ""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.vllm_config = vllm_config
        self.hf_config = vllm_config.model_config.hf_config
        self.dtype = vllm_config.model_config.dtype
        self.build()

    # -- vLLM model interface (registry inspection) -------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("stage models are executed through forward_step()")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs: Any):
        raise NotImplementedError("stage models are executed through forward_step()")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError("stage models are executed through forward_step()")

    # -- stage interface ----------------------------------------------------
    @classmethod
    def engine_hf_overrides(cls, hf_config) -> dict[str, Any]:
        """``hf_overrides`` this stage's engine needs (merged by the stage launcher)."""
        return {}

    def build(self) -> None:
        """Construct the HF sub-modules from ``self.hf_config``."""
        raise NotImplementedError

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """``(num_kv_heads, head_size)`` per paged attention layer, by ``layer_idx``."""
        raise NotImplementedError

    def forward_step(self, step: StepInput) -> StepOutput:
        raise NotImplementedError

    def after_sample(self, step: StepInput, token_id: int) -> dict[str, torch.Tensor]:
        """Hook run once a token was sampled for ``step``; returns payload to publish."""
        return {}

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def load_checkpoint(self, model_dir: str) -> None:
        """Load this stage's weights from the safetensors files in ``model_dir``.

        Raises:
            FileNotFoundError: no ``*.safetensors`` file in ``model_dir``.
            ValueError: a parameter of the stage has no weight in the checkpoint.
        """
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
        state = {}
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key.startswith(self.weight_prefix):
                        state[key[len(self.weight_prefix):]] = f.get_tensor(key)
        from vllm_omni_plugin.models.weights import fuse_experts

        module = self.stage_module()
        state = self.checkpoint_state(state)
        state = fuse_experts(state, set(module.state_dict()))
        missing, _ = module.load_state_dict(state, strict=False)
        if missing:
            raise ValueError(
                f"{model_dir}: checkpoint lacks {len(missing)} weights of "
                f"{type(self).__name__} (prefix {self.weight_prefix!r}), e.g. {missing[:3]}"
            )
        self.to(self.dtype)

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint weights (prefix removed) renamed to :meth:`stage_module`'s names."""
        return state

    def stage_module(self) -> nn.Module:
        """The HF module whose state dict matches the checkpoint under the prefix."""
        raise NotImplementedError
