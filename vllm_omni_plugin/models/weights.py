"""Loading HF-named checkpoint weights into modules built from vLLM's fused layers."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

#: HF projection names -> vLLM's fused parameter and its shard id
#: (``QKVParallelLinear``, ``MergedColumnParallelLinear``).
_STACKED = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"),
            ".v_proj.": (".qkv_proj.", "v"), ".gate_proj.": (".gate_up_proj.", 0),
            ".up_proj.": (".gate_up_proj.", 1)}
#: the shards a fused parameter needs before it counts as loaded
_SHARDS = {".qkv_proj.": {"q", "k", "v"}, ".gate_up_proj.": {0, 1}}


def load_stacked(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 required: Iterable[str], owner: str) -> set[str]:
    """Load ``(name, tensor)`` pairs named after ``module``'s parameters, fusing HF's
    q/k/v and gate/up projections into vLLM's ``qkv_proj`` / ``gate_up_proj``.

    Args:
        module: the module whose parameters (``named_parameters()`` names) are loaded.
        weights: ``(name, tensor)`` pairs in ``module``'s naming, except that HF's
            ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` stand for the
            shards of the fused parameters. Each tensor as the checkpoint stores it: HF's
            unsharded shape (e.g. ``[out_features, in_features]``; vLLM's weight loaders
            take each rank's share and check it), in the checkpoint's dtype (copied into
            the parameter's dtype).
        required: parameter names that must be loaded whole (every shard).
        owner: what the parameters belong to, for error messages.

    Returns:
        The names of the parameters loaded.

    Raises:
        ValueError: a weight names no parameter of ``module``, or a required parameter
            (or one of its shards) has no weight.
    """
    params = dict(module.named_parameters())
    loaded: dict[str, set] = {}  # parameter -> shards loaded (None: whole)
    for name, tensor in weights:
        target, shard = name, None
        for part, (fused, shard_id) in _STACKED.items():
            if part in name:
                target, shard = name.replace(part, fused), shard_id
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint weight {name!r} has no parameter in {owner}")
        if shard is None:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)
        loaded.setdefault(target, set()).add(shard)
    missing = sorted(
        name for name in required
        if not loaded.get(name)
        or any(f in name and loaded[name] != want for f, want in _SHARDS.items()))
    if missing:
        raise ValueError(f"the checkpoint lacks weights of {len(missing)} parameters of "
                         f"{owner}, e.g. {missing[:3]}")
    return set(loaded)


class OwnShards:
    """Mixin for a stage model that takes only some of a shared checkpoint's weights
    (those under :attr:`checkpoint_prefixes`): vLLM's default loader (0.32 and later,
    ``DefaultModelLoader.Source.is_unused_weight``) then skips every safetensors shard
    whose keys :meth:`is_unused_checkpoint_weight` all accepts, and logs how many it
    skipped. Qwen3-Omni's code2wav (0.4 GiB) sits in the last of 15 shards (66 GiB in
    all). vLLM 0.30 and 0.31 read every shard.
    """

    #: checkpoint key prefixes this model loads; others are skipped
    checkpoint_prefixes: tuple[str, ...] = ()

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """True for a checkpoint key this model does not load."""
        return not name.startswith(self.checkpoint_prefixes)
