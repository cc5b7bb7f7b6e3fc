"""Paged attention in plain PyTorch for the reference backend.

The stage models are built on Hugging Face modeling code (the same approach as
vLLM's Transformers backend). HF modules call attention through
``transformers.AttentionInterface``; we register :data:`ATTN_IMPLEMENTATION`
there. While the reference model runner executes a request it installs a
:class:`PagedKVView` in a context variable; the attention function writes the
new keys/values into the slots of the request's vLLM block table and attends
over every cached position of that request.

KV cache layout per attention layer (allocated by the worker from vLLM's
``KVCacheConfig``): ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(0 = keys, 1 = values), dtype of the model.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Name under which the attention function is registered with transformers.
ATTN_IMPLEMENTATION = "vllm_omni_plugin_paged"

_CURRENT_VIEW: contextvars.ContextVar[PagedKVView | None] = contextvars.ContextVar(
    "vllm_omni_plugin_paged_kv_view", default=None
)


@dataclass
class PagedKVView:
    """One request's window onto the paged KV cache for one forward pass.

    Attributes:
        kv_caches: per attention layer (indexed by HF ``layer_idx``), a tensor
            ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
        block_table: the request's vLLM block ids, in order.
        num_computed: tokens of this request already in the cache; the query
            tokens of this pass occupy positions ``num_computed ...``.
    """

    kv_caches: Sequence[torch.Tensor]
    block_table: torch.Tensor
    num_computed: int

    def _slots(self, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.block_table[positions // block_size], positions % block_size

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """Store ``key``/``value`` and attend causally over the request's cache.

        Args:
            query: ``[1, num_heads, n, head_size]``.
            key, value: ``[1, num_kv_heads, n, head_size]``.
            scaling: softmax scale (HF module's ``scaling``).

        Returns:
            ``[1, n, num_heads, head_size]`` (HF's attention-output layout).

        Raises:
            IndexError: when the block table is too short for the positions.
        """
        cache = self.kv_caches[layer_idx]
        block_size = cache.shape[2]
        n = query.shape[2]
        end = self.num_computed + n
        new_pos = torch.arange(self.num_computed, end)
        blocks, offsets = self._slots(new_pos, block_size)
        cache[0, blocks, offsets] = key[0].transpose(0, 1).to(cache.dtype)
        cache[1, blocks, offsets] = value[0].transpose(0, 1).to(cache.dtype)

        all_pos = torch.arange(end)
        blocks, offsets = self._slots(all_pos, block_size)
        k = cache[0, blocks, offsets].transpose(0, 1).unsqueeze(0).to(query.dtype)
        v = cache[1, blocks, offsets].transpose(0, 1).unsqueeze(0).to(query.dtype)
        groups = query.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        # query i sits at absolute position num_computed + i and sees keys <= it.
        mask = all_pos.unsqueeze(0) <= new_pos.unsqueeze(1)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous()


@contextlib.contextmanager
def use_paged_kv(view: PagedKVView) -> Iterator[None]:
    """Route every paged-attention call inside the block to ``view``."""
    token = _CURRENT_VIEW.set(view)
    try:
        yield
    finally:
        _CURRENT_VIEW.reset(token)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers ``AttentionInterface`` entry: see module docstring."""
    view = _CURRENT_VIEW.get()
    if view is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} called outside "
            "use_paged_kv(); the reference model runner must install a KV view"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return view.attend(module.layer_idx, query, key, value, scaling), None


def register_attention() -> None:
    """Register :data:`ATTN_IMPLEMENTATION` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def use_paged_attention(config):
    """Make HF modules built from ``config`` attend through the paged KV cache."""
    register_attention()
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config
