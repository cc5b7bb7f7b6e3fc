"""A tiny, seeded, random BAGEL checkpoint for offline CPU tests.

Written by ``python -m vllm_omni_plugin.tools.tiny_checkpoint bagel OUT_DIR [--seed N]``.
Nothing is downloaded and no official BAGEL code runs: the tensor names and shapes are
those of the official checkpoint (ByteDance-Seed/BAGEL-7B-MoT), at tiny sizes.

Files in OUT_DIR, the official layout:

* ``ema.safetensors``: the whole model. ``language_model.*`` (Qwen2 with per-head q/k
  RMSNorm and, on every layer, the generation expert's copies named ``*_moe_gen``, plus
  ``model.norm_moe_gen``), ``vit_model.vision_model.*`` (SigLIP, patch embedding stored
  as a linear layer ``[hidden, 3 * patch * patch]``), ``connector.fc1/fc2``,
  ``vit_pos_embed.pos_embed`` and ``latent_pos_embed.pos_embed`` (fixed 2-D sin-cos),
  ``time_embedder.mlp.{0,2}``, ``vae2llm``, ``llm2vae``.
* ``ae.safetensors``: a FLUX autoencoder (encoder and decoder, the official key names)
  with 16 latent channels and 8x downsampling, at 32 channels.
* ``llm_config.json`` (Qwen2), ``vit_config.json`` (SigLIP, one layer more than stored:
  the official loader drops the last one).

plus what vLLM needs to serve it:

* ``config.json``: ``model_type: bagel``, ``architectures:
  [BagelForConditionalGeneration]`` (vLLM's ``BagelConfig``); its ``vit_config`` counts
  the stored ViT layers, its ``llm_config`` sets ``qk_norm``, and its ``vae_config`` adds
  the autoencoder's geometry (``ch``, ``ch_mult``, ``num_res_blocks``, ``scale_factor``,
  ``shift_factor``, ...) to ``z_channels``/``downsample``. A missing geometry key means
  the FLUX value
  (:data:`vllm_omni_plugin.models.bagel.autoencoder.FLUX_AE`).
* tokenizer (Qwen2.5's special tokens after a tiny BPE, see
  :mod:`vllm_omni_plugin.tools.tiny_tokenizer`), ``generation_config.json`` and a SigLIP
  ``preprocessor_config.json``.

Sizes: LLM hidden 128, 2 layers, 4 heads, 2 KV heads (head_dim 32, what vLLM's CPU
attention supports), MLP 256; ViT hidden 64, 2 layers, 2 heads, patch 14, 56 px images (4x4
patches, ``vit_max_num_patch_per_side`` 4 so vLLM's processor and model agree); latents up
to ``max_latent_size`` 8 a side, so images up to 128 px (multiples of 16).

Weights: ``torch.Generator().manual_seed(seed)`` draws every tensor in name order. Linear
and embedding weights and biases N(0, 0.02) (as Hugging Face's init), norm weights
1 + N(0, 0.1), convolutions N(0, 1/fan_in) (GroupNorm keeps the autoencoder's activations
at unit scale), and ``llm2vae`` N(0, 1/hidden) so the velocity is of unit scale (the
official init sets it to zero, which would make every image its noise). All values are
rounded to bfloat16 and stored as float32, so the official code (which computes in
bfloat16) and a float32 implementation read the same weights. The same seed gives
byte-identical files.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from vllm_omni_plugin.models.bagel.autoencoder import FLUX_AE, FluxDecoder
from vllm_omni_plugin.tools.tiny_tokenizer import (
    QWEN25_ADDED_TOKENS,
    build_qwen_tokenizer,
    set_tokenizer_class,
)

logger = logging.getLogger("vllm_omni_plugin.tools.tiny_checkpoint")

TINY_LLM: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "qk_norm": True,
}

TINY_VIT: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,  # stored; vit_config.json says one more (see the module doc)
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": 56,
    "patch_size": 14,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "attention_dropout": 0.0,
}

TINY_AE: dict[str, Any] = dict(FLUX_AE, ch=32, ch_mult=[1, 1, 1, 1], num_res_blocks=1)

TINY_BAGEL: dict[str, Any] = {
    "visual_gen": True,
    "visual_und": True,
    "latent_patch_size": 2,
    "max_latent_size": 8,
    "vit_max_num_patch_per_side": TINY_VIT["image_size"] // TINY_VIT["patch_size"],
    "connector_act": "gelu_pytorch_tanh",
    "interpolate_pos": False,
    "timestep_shift": 1.0,
}

#: SigLIP's image processor at the tiny ViT's resolution (mean/std 0.5 as BAGEL's ViT
#: transform).
TINY_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "SiglipImageProcessor",
    "processor_class": "BagelProcessor",
    "do_resize": True,
    "size": {"height": TINY_VIT["image_size"], "width": TINY_VIT["image_size"]},
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}

#: Qwen2.5's tokens BAGEL's prompts use, by name.
BAGEL_SPECIAL_TOKENS = {
    "image_token": "<|image_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}


def _llm_shapes(cfg: dict[str, Any], vocab: int) -> dict[str, tuple[int, ...]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"language_model.model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"language_model.model.layers.{i}."
        for expert in ("", "_moe_gen"):
            attn = pre + "self_attn."
            for proj, out in (("q", h), ("k", kv), ("v", kv)):
                shapes[f"{attn}{proj}_proj{expert}.weight"] = (out, h)
                shapes[f"{attn}{proj}_proj{expert}.bias"] = (out,)
            shapes[f"{attn}o_proj{expert}.weight"] = (h, h)
            shapes[f"{attn}q_norm{expert}.weight"] = (head_dim,)
            shapes[f"{attn}k_norm{expert}.weight"] = (head_dim,)
            mlp = f"{pre}mlp{expert}."
            shapes[mlp + "gate_proj.weight"] = (inter, h)
            shapes[mlp + "up_proj.weight"] = (inter, h)
            shapes[mlp + "down_proj.weight"] = (h, inter)
            shapes[f"{pre}input_layernorm{expert}.weight"] = (h,)
            shapes[f"{pre}post_attention_layernorm{expert}.weight"] = (h,)
    shapes["language_model.model.norm.weight"] = (h,)
    shapes["language_model.model.norm_moe_gen.weight"] = (h,)
    shapes["language_model.lm_head.weight"] = (vocab, h)
    return shapes


def _vit_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, inter, patch = cfg["hidden_size"], cfg["intermediate_size"], cfg["patch_size"]
    side = cfg["image_size"] // patch
    pre = "vit_model.vision_model."
    shapes: dict[str, tuple[int, ...]] = {
        pre + "embeddings.patch_embedding.weight": (h, cfg["num_channels"] * patch * patch),
        pre + "embeddings.patch_embedding.bias": (h,),
        pre + "embeddings.position_embedding.weight": (side * side, h),
    }
    for i in range(cfg["num_hidden_layers"]):
        layer = f"{pre}encoder.layers.{i}."
        for proj in ("q", "k", "v"):
            shapes[f"{layer}self_attn.{proj}_proj.weight"] = (h, h)
            shapes[f"{layer}self_attn.{proj}_proj.bias"] = (h,)
        shapes[layer + "self_attn.out_proj.weight"] = (h, h)
        shapes[layer + "self_attn.out_proj.bias"] = (h,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{layer}{norm}.weight"] = (h,)
            shapes[f"{layer}{norm}.bias"] = (h,)
        shapes[layer + "mlp.fc1.weight"] = (inter, h)
        shapes[layer + "mlp.fc1.bias"] = (inter,)
        shapes[layer + "mlp.fc2.weight"] = (h, inter)
        shapes[layer + "mlp.fc2.bias"] = (h,)
    shapes[pre + "post_layernorm.weight"] = (h,)
    shapes[pre + "post_layernorm.bias"] = (h,)
    return shapes


def _generation_shapes(llm_hidden: int, vit_hidden: int, z: int,
                       patch: int) -> dict[str, tuple[int, ...]]:
    latent = patch * patch * z
    return {
        "connector.fc1.weight": (llm_hidden, vit_hidden),
        "connector.fc1.bias": (llm_hidden,),
        "connector.fc2.weight": (llm_hidden, llm_hidden),
        "connector.fc2.bias": (llm_hidden,),
        "time_embedder.mlp.0.weight": (llm_hidden, 256),
        "time_embedder.mlp.0.bias": (llm_hidden,),
        "time_embedder.mlp.2.weight": (llm_hidden, llm_hidden),
        "time_embedder.mlp.2.bias": (llm_hidden,),
        "vae2llm.weight": (llm_hidden, latent),
        "vae2llm.bias": (llm_hidden,),
        "llm2vae.weight": (latent, llm_hidden),
        "llm2vae.bias": (latent,),
    }


def _ae_shapes(ae: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the FLUX autoencoder's state dict (BFL's layout): the encoder
    written out here (the plugin has no encoder module), the decoder read off
    :class:`FluxDecoder`."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name, cin, cout, k):
        shapes[name + ".weight"] = (cout, cin, k, k)
        shapes[name + ".bias"] = (cout,)

    def norm(name, c):
        shapes[name + ".weight"] = (c,)
        shapes[name + ".bias"] = (c,)

    def resnet(name, cin, cout):
        norm(name + ".norm1", cin)
        conv(name + ".conv1", cin, cout, 3)
        norm(name + ".norm2", cout)
        conv(name + ".conv2", cout, cout, 3)
        if cin != cout:
            conv(name + ".nin_shortcut", cin, cout, 1)

    def mid(name, c):
        resnet(name + ".block_1", c, c)
        norm(name + ".attn_1.norm", c)
        for proj in ("q", "k", "v", "proj_out"):
            conv(f"{name}.attn_1.{proj}", c, c, 1)
        resnet(name + ".block_2", c, c)

    ch, mult, blocks, z = ae["ch"], ae["ch_mult"], ae["num_res_blocks"], ae["z_channels"]
    levels = len(mult)
    conv("encoder.conv_in", ae["in_channels"], ch, 3)
    cin = ch
    for i in range(levels):
        cout = ch * mult[i]
        for j in range(blocks):
            resnet(f"encoder.down.{i}.block.{j}", cin, cout)
            cin = cout
        if i != levels - 1:
            conv(f"encoder.down.{i}.downsample.conv", cin, cin, 3)
    mid("encoder.mid", cin)
    norm("encoder.norm_out", cin)
    conv("encoder.conv_out", cin, 2 * z, 3)

    # the decoder: the plugin's own module, built with the same key names
    shapes.update((f"decoder.{name}", tuple(t.shape))
                  for name, t in FluxDecoder(ae).state_dict().items())
    return shapes


def _draw(shapes: dict[str, tuple[int, ...]], gen, fixed: dict[str, Any]) -> dict[str, Any]:
    """Seeded tensors for ``shapes`` (see the module doc), bf16-rounded, as float32."""
    import torch

    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name in fixed:
            value = fixed[name]
        elif len(shape) == 4:  # convolution
            value = torch.randn(shape, generator=gen) * (shape[1] * shape[2] * shape[3]) ** -0.5
        elif name.startswith("llm2vae.weight"):
            value = torch.randn(shape, generator=gen) * shape[1] ** -0.5
        elif "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            value = 0.02 * torch.randn(shape, generator=gen)
        out[name] = value.to(torch.bfloat16).to(torch.float32).contiguous()
    return out


def _sincos(side: int, hidden: int):
    """The fixed 2-D sin-cos table BAGEL stores for ``side`` x ``side`` positions
    (vLLM's ``PositionEmbedding``, the same formula as the official one): ``[side * side,
    hidden]`` float32."""
    import torch

    from vllm_omni_plugin.compat.internals import bagel_sincos_pos_embed

    return torch.from_numpy(bagel_sincos_pos_embed(hidden, side)).float()


def build_bagel(out_dir: str | os.PathLike, seed: int = 0) -> dict[str, Any]:
    """Write the tiny BAGEL checkpoint to ``out_dir``; returns a summary dict."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen_tokenizer(QWEN25_ADDED_TOKENS, BAGEL_SPECIAL_TOKENS)
    vocab = (len(tokenizer) + 127) // 128 * 128
    llm = dict(TINY_LLM, vocab_size=vocab,
               bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    h = llm["hidden_size"]
    patch, z = TINY_BAGEL["latent_patch_size"], TINY_AE["z_channels"]

    gen = torch.Generator().manual_seed(seed)
    shapes = {**_llm_shapes(llm, vocab), **_vit_shapes(TINY_VIT),
              **_generation_shapes(h, TINY_VIT["hidden_size"], z, patch)}
    fixed = {
        "vit_pos_embed.pos_embed": _sincos(TINY_BAGEL["vit_max_num_patch_per_side"], h),
        "latent_pos_embed.pos_embed": _sincos(TINY_BAGEL["max_latent_size"], h),
    }
    shapes.update({name: tuple(t.shape) for name, t in fixed.items()})
    logger.info("drawing the tiny BAGEL weights (seed=%d)", seed)
    ema = _draw(shapes, gen, fixed)
    ae = _draw(_ae_shapes(TINY_AE), gen, {})
    save_file(ema, str(out / "ema.safetensors"))
    save_file(ae, str(out / "ae.safetensors"))

    def write(name, data):
        (out / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    write("llm_config.json", llm)
    write("vit_config.json", dict(TINY_VIT, num_hidden_layers=TINY_VIT["num_hidden_layers"] + 1))
    write("config.json", dict(
        TINY_BAGEL, architectures=["BagelForConditionalGeneration"], model_type="bagel",
        dtype="float32", llm_config=llm, vit_config=TINY_VIT, vae_config=TINY_AE))
    write("preprocessor_config.json", TINY_PREPROCESSOR)
    GenerationConfig(bos_token_id=llm["bos_token_id"], eos_token_id=llm["eos_token_id"],
                     pad_token_id=llm["bos_token_id"]).save_pretrained(out)
    tokenizer.save_pretrained(out)
    set_tokenizer_class(out, "Qwen2Tokenizer")

    files = sorted(p for p in out.iterdir() if p.is_file())
    return {
        "model": "bagel",
        "path": str(out.resolve()),
        "seed": seed,
        "parameters": sum(t.numel() for t in ema.values()),
        "autoencoder_parameters": sum(t.numel() for t in ae.values()),
        "bytes": sum(p.stat().st_size for p in files),
        "files": [p.name for p in files],
        "tokenizer_size": len(tokenizer),
        "vocab_size": vocab,
        "seconds": round(time.perf_counter() - t0, 2),
    }
