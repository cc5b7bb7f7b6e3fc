"""Per-request token sampling for the reference backend.

Implements the subset of ``vllm.SamplingParams`` the stage models need:
greedy (``temperature == 0``), temperature, ``top_k``, ``top_p``, ``seed``
and ``min_tokens`` (stop tokens masked until reached). Other fields are
handled by vLLM's scheduler (stop strings, max_tokens) or unsupported
(logprobs: ignored).
"""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    params,
    num_output_tokens: int,
    generator: torch.Generator | None,
) -> int:
    """Sample one token id.

    Args:
        logits: ``[vocab]`` float.
        params: the request's ``vllm.SamplingParams``.
        num_output_tokens: tokens generated so far (for ``min_tokens``).
        generator: per-request RNG when ``params.seed`` is set.
    """
    logits = logits.float().clone()
    if params.min_tokens and num_output_tokens < params.min_tokens:
        stop_ids = [t for t in (params.all_stop_token_ids or ()) if t < logits.shape[0]]
        if stop_ids:
            logits[stop_ids] = float("-inf")
    if params.temperature < 1e-5:
        return int(torch.argmax(logits).item())
    logits = logits / params.temperature
    if params.top_k and 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator).item())
