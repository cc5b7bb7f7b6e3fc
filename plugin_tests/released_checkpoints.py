"""The released checkpoints' published facts, vendored under
``plugin_tests/fixtures/checkpoints/`` (sources in its README.md): Qwen3-Omni-30B-A3B-Instruct's
per-tensor listing (name, shape, dtype, shard) and facts; BAGEL-7B-MoT's facts and
derived key listing."""

from __future__ import annotations

import itertools
import json
import math
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
    ``Qwen3OmniMoeConfig`` defaults with the shapes of the thinker's decoder and encoder
    outputs and of the talker set from the listing (the published ``config.json`` was
    not found; the defaults have a 28-layer thinker with a 3,584-token vocabulary, no
    talker shared expert and 32 code groups where the checkpoint has 16). Derived, not
    published: what the listing's shapes do not show (rope, token ids, the talker's
    ``accept_hidden_layer``) keeps transformers' defaults."""
    from transformers import Qwen3OmniMoeConfig

    tensors = tensors or qwen3_omni_tensors()

    def rows(key: str) -> int:
        return tensors[key].shape[0]

    def decoder(model: str, embedding: str) -> dict:
        """A Qwen3-MoE decoder's shapes, from the listing's keys under ``model``."""
        layer = f"{model}.layers.0."
        head_dim = rows(layer + "self_attn.q_norm.weight")
        return dict(
            vocab_size=rows(f"{model}.{embedding}.weight"),
            hidden_size=tensors[f"{model}.{embedding}.weight"].shape[1],
            num_hidden_layers=1 + max(int(k.split(".")[3]) for k in tensors
                                      if k.startswith(f"{model}.layers.")),
            head_dim=head_dim,
            num_attention_heads=rows(layer + "self_attn.q_proj.weight") // head_dim,
            num_key_value_heads=rows(layer + "self_attn.k_proj.weight") // head_dim,
            num_experts=rows(layer + "mlp.gate.weight"),
            moe_intermediate_size=rows(layer + "mlp.experts.0.gate_proj.weight"))

    config = Qwen3OmniMoeConfig().to_dict()
    thinker = config["thinker_config"]
    thinker["text_config"].update(decoder("thinker.model", "embed_tokens"),
                                  tie_word_embeddings="thinker.lm_head.weight" not in tensors)
    thinker["audio_config"]["output_dim"] = rows("thinker.audio_tower.proj2.weight")
    vision = thinker["vision_config"]
    vision["out_hidden_size"] = rows("thinker.visual.merger.mlp.2.weight")
    patch = tensors["thinker.visual.patch_embed.proj.weight"].shape[-1]
    vision["image_size"] = patch * math.isqrt(rows("thinker.visual.pos_embed.weight"))
    vision["apply_vit_abs_pos_embed"] = True  # it has a pos_embed
    config["talker_config"]["text_config"].update(
        decoder("talker.model", "codec_embedding"),
        shared_expert_intermediate_size=rows(
            "talker.model.layers.0.mlp.shared_expert.gate_proj.weight"))
    groups = 1 + sum(k.startswith("talker.code_predictor.lm_head.") for k in tensors)
    config["talker_config"]["num_code_groups"] = groups
    config["talker_config"]["code_predictor_config"].update(
        num_code_groups=groups,
        vocab_size=rows("talker.code_predictor.model.codec_embedding.0.weight"),
        num_hidden_layers=1 + max(int(k.split(".")[4]) for k in tensors
                                  if k.startswith("talker.code_predictor.model.layers.")))
    config["architectures"] = ["Qwen3OmniMoeForConditionalGeneration"]
    return config


BAGEL = os.path.join(CHECKPOINTS, "bagel-7b-mot")


def bagel_facts() -> dict:
    with open(os.path.join(BAGEL, "facts.json")) as f:
        return json.load(f)


def bagel_tensors() -> dict[str, Tensor]:
    """Every key of BAGEL-7B-MoT's ``ema.safetensors`` and ``ae.safetensors`` (derived
    from the official modeling code, not published: see the fixtures' README), bf16."""
    with open(os.path.join(BAGEL, "tensors.derived.json")) as f:
        derived = json.load(f)
    return {key: Tensor(tuple(row["shape"]), "BF16", row["file"])
            for file in ("ema.safetensors", "ae.safetensors")
            for key, row in derived[file].items()}


def bagel_config() -> dict:
    """A vLLM ``config.json`` (``model_type: bagel``) for BAGEL-7B-MoT, from the vendored
    facts: the LLM and ViT sizes, the official code's load-time overrides (``qk_norm``,
    untied head, one ViT layer fewer than ``vit_config.json``, 70 patches a side, latents
    up to 64 a side, the FLUX autoencoder). The release ships no ``config.json``: a user
    writes this one (the plan tool's ``--write-config``)."""
    facts = bagel_facts()
    overrides = facts["official_load_time_overrides"]["value"]
    llm_dims, vit_dims = facts["llm_dims"]["value"], facts["vit_dims"]["value"]
    llm = dict(llm_dims, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
               hidden_act="silu", qk_norm=overrides["llm_config.qk_norm"],
               tie_word_embeddings=overrides["llm_config.tie_word_embeddings"],
               use_sliding_window=False, sliding_window=None,
               max_window_layers=llm_dims["num_hidden_layers"])
    vit = {"model_type": "siglip_vision_model", "num_channels": 3,
           "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
           "num_hidden_layers": vit_dims["stored_layers"],
           **{k: vit_dims[k] for k in ("hidden_size", "intermediate_size",
                                       "num_attention_heads", "patch_size", "image_size")}}
    return {"architectures": ["BagelForConditionalGeneration"], "model_type": "bagel",
            "visual_gen": True, "visual_und": True, "interpolate_pos": False,
            "timestep_shift": 1.0, "connector_act": overrides["connector_act"],
            "latent_patch_size": overrides["latent_patch_size"],
            "max_latent_size": overrides["max_latent_size"],
            "vit_max_num_patch_per_side": overrides["vit_max_num_patch_per_side"],
            "llm_config": llm, "vit_config": vit, "vae_config": overrides["ae"]}


def write_released_config(name: str, folder: str) -> str:
    """Write the derived ``config.json`` of released checkpoint ``name`` (``qwen3_omni``
    or ``bagel``) into ``folder`` (made if missing), with, for BAGEL, a tokenizer with
    Qwen2.5's special tokens (its DiT reads its image markers' ids from it); returns
    ``folder``."""
    os.makedirs(folder, exist_ok=True)
    config = {"qwen3_omni": qwen3_omni_config, "bagel": bagel_config}[name]()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    if name == "bagel":
        from vllm_omni_plugin.tools.tiny_bagel import BAGEL_SPECIAL_TOKENS
        from vllm_omni_plugin.tools.tiny_tokenizer import (
            QWEN25_ADDED_TOKENS,
            build_qwen_tokenizer,
        )

        build_qwen_tokenizer(QWEN25_ADDED_TOKENS, BAGEL_SPECIAL_TOKENS).save_pretrained(folder)
    return folder
