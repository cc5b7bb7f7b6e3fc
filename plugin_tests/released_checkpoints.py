"""The released checkpoints' published facts, vendored under
``plugin_tests/fixtures/checkpoints/`` (sources in its README.md): Qwen3-Omni-30B-A3B-Instruct's
per-tensor listing (name, shape, dtype, shard) and facts; BAGEL-7B-MoT's facts and
derived key listing."""

from __future__ import annotations

import itertools
import json
import os
import re
from typing import NamedTuple

CHECKPOINTS = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoints")
QWEN3_OMNI = os.path.join(CHECKPOINTS, "qwen3-omni-30b-a3b-instruct")
_RANGE = re.compile(r"\{(\d+)-(\d+)\}")


class Tensor(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    #: shard file, or None where the listing says "Multi Files"
    file: str | None


def expand(pattern: str) -> list[str]:
    """The names a listing pattern stands for: each ``{a-b}`` is every integer a..b."""
    parts = _RANGE.split(pattern)
    literals, ranges = parts[0::3], list(zip(parts[1::3], parts[2::3], strict=True))
    names = []
    for values in itertools.product(*(range(int(a), int(b) + 1) for a, b in ranges)):
        names.append(literals[0] + "".join(f"{v}{lit}"
                                           for v, lit in zip(values, literals[1:], strict=True)))
    return names


def qwen3_omni_tensors() -> dict[str, Tensor]:
    """Every tensor of the released Qwen3-Omni-30B-A3B-Instruct, from the listing."""
    tensors: dict[str, Tensor] = {}
    with open(os.path.join(QWEN3_OMNI, "published_listing.tsv")) as f:
        rows = [line.rstrip("\n").split("\t") for line in f
                if line.strip() and not line.startswith("#")]
    for name, shape, dtype, file, *_ in rows[1:]:
        for key in expand(name):
            assert key not in tensors, f"{key} listed twice"
            tensors[key] = Tensor(tuple(json.loads(shape)), dtype,
                                  None if file == "Multi Files" else file)
    return tensors


def qwen3_omni_facts() -> dict:
    with open(os.path.join(QWEN3_OMNI, "facts.json")) as f:
        return json.load(f)


def qwen3_omni_config(tensors: dict[str, Tensor] | None = None) -> dict:
    """A ``config.json`` for the released Qwen3-Omni-30B-A3B-Instruct: transformers'
    ``Qwen3OmniMoeConfig`` defaults with the talker's shapes set from the listing (the
    published ``config.json`` was not found; the defaults lack the talker's shared
    expert and have 32 code groups where the checkpoint has 16). Derived, not published:
    only the talker's and code2wav's fields are checked against the listing (their
    loaders are the plugin's; the thinker is vLLM's own)."""
    from transformers import Qwen3OmniMoeConfig

    tensors = tensors or qwen3_omni_tensors()

    def rows(key: str) -> int:
        return tensors[key].shape[0]

    layer = "talker.model.layers.0."
    head_dim = rows(layer + "self_attn.q_norm.weight")
    config = Qwen3OmniMoeConfig().to_dict()
    config["talker_config"]["text_config"].update(
        vocab_size=rows("talker.model.codec_embedding.weight"),
        hidden_size=tensors["talker.model.codec_embedding.weight"].shape[1],
        num_hidden_layers=1 + max(int(k.split(".")[3]) for k in tensors
                                  if k.startswith("talker.model.layers.")),
        head_dim=head_dim,
        num_attention_heads=rows(layer + "self_attn.q_proj.weight") // head_dim,
        num_key_value_heads=rows(layer + "self_attn.k_proj.weight") // head_dim,
        num_experts=rows(layer + "mlp.gate.weight"),
        moe_intermediate_size=rows(layer + "mlp.experts.0.gate_proj.weight"),
        shared_expert_intermediate_size=rows(layer + "mlp.shared_expert.gate_proj.weight"))
    groups = 1 + sum(k.startswith("talker.code_predictor.lm_head.") for k in tensors)
    config["talker_config"]["num_code_groups"] = groups
    config["talker_config"]["code_predictor_config"].update(
        num_code_groups=groups,
        vocab_size=rows("talker.code_predictor.model.codec_embedding.0.weight"),
        num_hidden_layers=1 + max(int(k.split(".")[4]) for k in tensors
                                  if k.startswith("talker.code_predictor.model.layers.")))
    config["architectures"] = ["Qwen3OmniMoeForConditionalGeneration"]
    return config
