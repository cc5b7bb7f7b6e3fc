"""Checkpoint weight mapping for stage models.

Qwen3-Omni checkpoints store MoE experts one by one
(``...mlp.experts.{e}.{gate,up,down}_proj.weight``) while transformers 5's
modules hold them fused (``experts.gate_up_proj`` ``[E, 2*I, H]``, gate rows
first, and ``experts.down_proj`` ``[E, H, I]``; see
``Qwen3OmniMoeThinkerTextExperts``). :func:`fuse_experts` converts.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(
    r"^(?P<base>.*\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Fuse per-expert weights into ``<base>.gate_up_proj``/``<base>.down_proj``
    where ``expected`` (the module's state-dict keys) asks for the fused form."""
    grouped: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for key, tensor in state.items():
        m = _EXPERT.match(key)
        if m and f"{m['base']}.gate_up_proj" in expected:
            grouped.setdefault(m["base"], {}).setdefault(m["proj"], {})[int(m["idx"])] = tensor
        else:
            out[key] = tensor
    for base, projs in grouped.items():
        n = len(projs["down_proj"])
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(n)]
        )
        out[f"{base}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out
