"""Run the official BAGEL code on the tiny checkpoint and write what it computed as test
fixtures (a development check; CI only reads the fixtures).

Run by ``scripts/bagel_reference.sh``, in a venv of its own (the official code pins
transformers 4.49, vLLM brings 5.x), from a checkout of ByteDance-Seed/Bagel kept
outside this project: its ``modeling/bagel/modeling_utils.py`` is CC BY-NC 4.0, so
nothing of it is copied here; this script only imports it.

What it replaces, without editing the official files: ``flash_attn`` (CUDA only) by
:func:`_varlen_attention`, exact attention over packed sequences with flash-attn's
conventions (grouped KV heads, causal mask aligned to the bottom right when the keys
include cached context). The official code runs under ``torch.autocast("cuda",
bfloat16)``, a no-op on the CPU: the CPU's bfloat16 autocast stands in for it. The model's
weights are bfloat16 (the official loader's dtype), the autoencoder's float32 (its
``load_ae``), which autocast runs in bfloat16 as on a GPU.

For each case it records, with the settings used:

* ``context.k.{layer}`` / ``context.v.{layer}``: the context's keys (after RoPE) and
  values, ``[tokens, kv_heads, head_dim]``, of ``<|im_start|> prompt <|im_end|>``;
* ``text_ids``: those token ids; ``noise``: the initial latent, ``[h*w, 64]`` float32,
  drawn with ``torch.manual_seed(seed)`` as the official code does;
* ``velocity.{step}``: the guided velocity of every Euler step, ``[h*w, 64]``;
* ``latent``: the final latent; ``pixels``: the decoded image, ``[H, W, 3]`` uint8;
* ``understanding_ids``: greedy text the understanding path generates after the prompt.

A case with ``think`` (text to image after planning, the official ``think=True``) records
instead of ``context.*`` three contexts: ``context.*`` the full one (system prompt,
prompt, the planning re-prefilled), ``cfg_text.*`` the text-unconditional one (the system
prompt) and ``cfg_img.*`` the image-unconditional one (system prompt and prompt), with
``text_ids`` the full one's token ids, ``reasoning_ids`` the greedy planning tokens (the
start token left out) and the planning text in ``reference.json``.

An editing case (the official app's "Image Edit": input images, then the instruction)
records per input image ``i`` ``input_image.{i}`` ``[H, W, 3]`` uint8 (drawn from the
case's seed plus ``i``) and ``posterior_eps.{i}`` ``[z, H / 8, W / 8]`` (the
autoencoder's posterior draws, the first after the seed, in order; ``noise`` comes
after them), ``context.*`` the full context (each image through the VAE, then through
the ViT; then the instruction), ``cfg_text.*`` the images alone (text-unconditional)
and ``cfg_img.*`` the instruction alone (image-unconditional), ``text_ids`` the
instruction's ids, and the velocities, latent and pixels as above; the image is drawn at
the last input's resized size.
The official transforms' sizes (VAE 1024/512/16, ViT 980/224/14) are capped by the tiny
checkpoint's largest sides as the plugin caps them (:func:`edit_transforms`).

Usage::

    python scripts/bagel_reference.py --bagel-repo DIR --checkpoint CKPT --out DIR
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

#: (name, prompt, seed, (H, W), knobs): text to image as the official app calls it
#: (InterleaveInferencer defaults, fewer steps).
CASES = [
    ("t2i_cfg_global", "A red cat sitting on a blue chair.", 42, (64, 64),
     dict(cfg_text_scale=4.0, cfg_img_scale=1.5, cfg_interval=[0.4, 1.0], timestep_shift=3.0,
          num_timesteps=6, cfg_renorm_min=0.0, cfg_renorm_type="global")),
    ("t2i_cfg_text_channel", "Two dogs on the beach at night.", 7, (32, 48),
     dict(cfg_text_scale=3.0, cfg_img_scale=1.0, cfg_interval=[0.0, 1.0], timestep_shift=2.0,
          num_timesteps=5, cfg_renorm_min=0.5, cfg_renorm_type="text_channel")),
]
#: (name, prompt, seed, (H, W), knobs, max_think_token_n): text to image with
#: ``think=True`` (greedy planning, as the official app's default)
THINK_CASES = [
    ("t2i_think", "A house made of cheese.", 3, (32, 32),
     dict(cfg_text_scale=4.0, cfg_img_scale=1.5, cfg_interval=[0.4, 1.0], timestep_shift=3.0,
          num_timesteps=5, cfg_renorm_min=0.0, cfg_renorm_type="global"), 8),
]
#: the official app's editing defaults (fewer steps)
EDIT_KNOBS = dict(cfg_text_scale=4.0, cfg_img_scale=2.0, cfg_interval=[0.0, 1.0],
                  timestep_shift=3.0, num_timesteps=5, cfg_renorm_min=0.0,
                  cfg_renorm_type="text_channel")
#: (name, instruction, seed, the input images' (W, H), knobs): editing
EDIT_CASES = [
    ("edit_text_channel", "Make the sky green.", 11, [(100, 60)], EDIT_KNOBS),
    ("edit_two_images", "Put the second one on the first.", 12, [(100, 60), (60, 100)],
     EDIT_KNOBS),
]
UNDERSTANDING_TOKENS = 8


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                      max_seqlen_k=None, causal=False, **_):
    """flash-attn's ``flash_attn_varlen_func`` on the CPU: ``q`` ``[total_q, H, D]``,
    ``k``/``v`` ``[total_k, H_kv, D]``, sequence ``i`` spanning ``cu_seqlens_*[i:i+2]``."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
        vi = v[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
        mask = None
        if causal:
            lq, lk = qe - qs, ke - ks
            rows = torch.arange(lq).unsqueeze(1) + (lk - lq)
            mask = torch.arange(lk).unsqueeze(0) <= rows
        out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask).transpose(0, 1)
    return out


def _install_flash_attn_stub() -> None:
    import importlib.machinery

    module = types.ModuleType("flash_attn")
    # a spec, so transformers' probe finds a module without a distribution: "not installed"
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", loader=None)
    module.flash_attn_varlen_func = _varlen_attention
    sys.modules["flash_attn"] = module


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_official(ckpt: Path):
    """The official model (bf16), autoencoder (float32), tokenizer and special ids."""
    from data.data_utils import add_special_tokens
    from modeling.autoencoder import AutoEncoder, AutoEncoderParams
    from modeling.bagel import (
        Bagel,
        BagelConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
        SiglipVisionConfig,
        SiglipVisionModel,
    )
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    served = json.loads((ckpt / "config.json").read_text())
    llm_config = Qwen2Config.from_json_file(str(ckpt / "llm_config.json"))
    llm_config.qk_norm = True
    llm_config.tie_word_embeddings = False
    llm_config.layer_module = "Qwen2MoTDecoderLayer"
    vit_config = SiglipVisionConfig.from_json_file(str(ckpt / "vit_config.json"))
    vit_config.rope = False
    vit_config.num_hidden_layers -= 1
    ae_fields = AutoEncoderParams.__dataclass_fields__
    ae_params = AutoEncoderParams(**{k: v for k, v in served["vae_config"].items()
                                     if k in ae_fields})
    config = BagelConfig(
        visual_gen=True, visual_und=True, llm_config=llm_config, vit_config=vit_config,
        vae_config=ae_params, vit_max_num_patch_per_side=served["vit_max_num_patch_per_side"],
        connector_act=served["connector_act"], latent_patch_size=served["latent_patch_size"],
        max_latent_size=served["max_latent_size"])
    model = Bagel(Qwen2ForCausalLM(llm_config), SiglipVisionModel(vit_config), config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config, meta=False)
    model.load_state_dict(load_file(str(ckpt / "ema.safetensors")), strict=True)
    model = model.to(torch.bfloat16).eval()
    vae = AutoEncoder(ae_params)
    vae.load_state_dict(load_file(str(ckpt / "ae.safetensors")), strict=True)
    vae = vae.eval()
    # tokenizer.json alone: the checkpoint's tokenizer_config.json is transformers 5's
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"))
    tokenizer, new_token_ids, _ = add_special_tokens(tokenizer)
    return model, vae, tokenizer, new_token_ids


def _store_context(record: dict, name: str, context: dict) -> None:
    cache = context["past_key_values"]
    for layer in range(cache.num_layers):
        record[f"{name}.k.{layer}"] = cache.key_cache[layer].float().clone()
        record[f"{name}.v.{layer}"] = cache.value_cache[layer].float().clone()


def run_case(model, vae, tokenizer, new_token_ids, prompt, seed, size, knobs,
             think_tokens=None):
    """One case's record (see the module doc); with ``think_tokens`` (the official
    ``max_think_token_n``) the case thinks first, and the record holds ``reasoning`` (a
    string, not a tensor)."""
    from inferencer import GEN_THINK_SYSTEM_PROMPT, InterleaveInferencer

    inferencer = InterleaveInferencer(model, vae, tokenizer, None, None, new_token_ids)
    record: dict[str, torch.Tensor] = {}
    velocities: list[torch.Tensor] = []
    contexts: list = []
    forward_flow, update_text = model._forward_flow, inferencer.update_context_text
    prepare_latent, generate_image = model.prepare_vae_latent, model.generate_image
    latents: list[torch.Tensor] = []
    generated: list[torch.Tensor] = []
    generate_text = model.generate_text

    def recording_generate(**kwargs):
        out = generate_text(**kwargs)
        generated.append(out[:, 0].clone())
        return out

    def recording_flow(**kwargs):
        v = forward_flow(**kwargs)
        velocities.append(v.detach().float().clone())
        return v

    def recording_update(text, context):
        context = update_text(text, context)
        contexts.append(copy.deepcopy(context))
        return context

    def recording_latent(*args, **kwargs):
        out = prepare_latent(*args, **kwargs)
        record["noise"] = out["packed_init_noises"].clone()
        return out

    def recording_image(**kwargs):
        out = generate_image(**kwargs)
        latents.append(out[0])
        return out

    model._forward_flow = recording_flow
    model.generate_image = recording_image
    inferencer.update_context_text = recording_update
    model.prepare_vae_latent = recording_latent
    model.generate_text = recording_generate
    think = {} if think_tokens is None else {"think": True, "max_think_token_n": think_tokens}
    try:
        torch.manual_seed(seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = inferencer.interleave_inference([prompt], image_shapes=size, **knobs,
                                                     **think)
    finally:
        del model._forward_flow, model.prepare_vae_latent, model.generate_image
        del model.generate_text
    image = result[-1]
    text_ids = [new_token_ids["bos_token_id"], *tokenizer.encode(prompt),
                new_token_ids["eos_token_id"]]
    if think:
        # contexts: the system prompt (full, then image-unconditional), the prompt (the
        # same two), the planning (full)
        _store_context(record, "cfg_text", contexts[0])
        _store_context(record, "cfg_img", contexts[3])
        _store_context(record, "context", contexts[4])
        record["reasoning_ids"] = generated[0][1:].to(torch.int64)
        record["reasoning"] = result[0]
        wrap = [GEN_THINK_SYSTEM_PROMPT, prompt, result[0]]
        text_ids = [i for text in wrap for i in (
            new_token_ids["bos_token_id"], *tokenizer.encode(text),
            new_token_ids["eos_token_id"])]
    else:
        # contexts: the full one, then the image-unconditional one (both the prompt only)
        _store_context(record, "context", contexts[0])
    for step, v in enumerate(velocities):
        record[f"velocity.{step}"] = v
    record["latent"] = latents[0].float().clone()
    record["pixels"] = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8))
    record["text_ids"] = torch.tensor(text_ids, dtype=torch.int64)
    if think:
        return record
    generated.clear()
    model.generate_text = recording_generate
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inferencer.interleave_inference([prompt], understanding_output=True,
                                            do_sample=False,
                                            max_think_token_n=UNDERSTANDING_TOKENS)
    except IndexError:
        pass  # the tiny model's text has no <|im_start|> to split the answer at
    finally:
        del model.generate_text
    # the first id is the start token the official loop feeds, not a generated one
    record["understanding_ids"] = generated[0][1:].to(torch.int64)
    return record


def edit_transforms(served: dict):
    """The official app's VAE and ViT ``ImageTransform``s with each (max side, min side)
    capped by the checkpoint: the max by its largest image (``16 * max_latent_size``;
    ViT: ``patch_size * vit_max_num_patch_per_side``), the min by half of that (the
    plugin's ``models/bagel/editing.py`` rule, written again here: this venv cannot
    import the plugin)."""
    from data.transforms import ImageTransform

    vae_max = min(1024, 16 * served["max_latent_size"])
    patch = served["vit_config"]["patch_size"]
    vit_max = min(980, patch * served["vit_max_num_patch_per_side"])
    return (ImageTransform(vae_max, min(512, vae_max // 2), 16),
            ImageTransform(vit_max, min(224, vit_max // 2), patch))


def edit_input(seed: int, width: int, height: int) -> np.ndarray:
    """A smooth ``[H, W, 3]`` uint8 test picture drawn from ``seed`` (numpy)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    waves = [np.sin(2 * np.pi * (rng.uniform(0.5, 3) * x + rng.uniform(0.5, 3) * y
                                 + rng.uniform(0, 1))) for _ in range(3)]
    return ((np.stack(waves, axis=-1) + 1) * 127.5).round().astype(np.uint8)


def run_edit_case(model, vae, tokenizer, new_token_ids, served, prompt, seed, sizes, knobs):
    """An editing case's record (see the module doc)."""
    from inferencer import InterleaveInferencer
    from PIL import Image

    vae_transform, vit_transform = edit_transforms(served)
    inferencer = InterleaveInferencer(model, vae, tokenizer, vae_transform, vit_transform,
                                      new_token_ids)
    inputs = [edit_input(seed + i, *size) for i, size in enumerate(sizes)]
    record: dict[str, torch.Tensor] = {f"input_image.{i}": torch.from_numpy(pixels)
                                       for i, pixels in enumerate(inputs)}
    velocities, latents, texts, images, draws = [], [], [], [], []
    forward_flow, generate_image = model._forward_flow, model.generate_image
    update_text, update_image = inferencer.update_context_text, inferencer.update_context_image
    prepare_latent, randn_like = model.prepare_vae_latent, torch.randn_like

    def recording_latent(*args, **kwargs):
        out = prepare_latent(*args, **kwargs)
        record["noise"] = out["packed_init_noises"].clone()
        return out

    def recording_randn_like(*args, **kwargs):  # the autoencoder's posterior draw
        out = randn_like(*args, **kwargs)
        draws.append(out.clone())
        return out

    def recording_flow(**kwargs):
        v = forward_flow(**kwargs)
        velocities.append(v.detach().float().clone())
        return v

    def recording_image(**kwargs):
        out = generate_image(**kwargs)
        latents.append(out[0])
        return out

    def recording_text(text, context):
        context = update_text(text, context)
        texts.append(copy.deepcopy(context))
        return context

    def recording_update_image(image, context, **kwargs):
        context = update_image(image, context, **kwargs)
        images.append(copy.deepcopy(context))
        return context

    model._forward_flow, model.generate_image = recording_flow, recording_image
    model.prepare_vae_latent = recording_latent
    inferencer.update_context_text = recording_text
    inferencer.update_context_image = recording_update_image
    torch.randn_like = recording_randn_like
    try:
        torch.manual_seed(seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = inferencer.interleave_inference(
                [*(Image.fromarray(pixels) for pixels in inputs), prompt], **knobs)
    finally:
        del model._forward_flow, model.generate_image, model.prepare_vae_latent
        torch.randn_like = randn_like
    for i, draw in enumerate(draws):
        record[f"posterior_eps.{i}"] = draw[0].float()
    # contexts: the images (text-unconditional), then the full one and the instruction's
    _store_context(record, "cfg_text", images[-1])
    _store_context(record, "context", texts[0])
    _store_context(record, "cfg_img", texts[1])
    for step, v in enumerate(velocities):
        record[f"velocity.{step}"] = v
    record["latent"] = latents[0].float().clone()
    record["pixels"] = torch.from_numpy(np.array(result[-1].convert("RGB"), dtype=np.uint8))
    record["text_ids"] = torch.tensor([new_token_ids["bos_token_id"], *tokenizer.encode(prompt),
                                       new_token_ids["eos_token_id"]], dtype=torch.int64)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bagel-repo", required=True, type=Path,
                        help="checkout of github.com/ByteDance-Seed/Bagel (kept outside "
                             "this project)")
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="the tiny checkpoint (tools.tiny_checkpoint bagel)")
    parser.add_argument("--out", required=True, type=Path, help="fixture directory")
    parser.add_argument("--commit", default="", help="the checkout's commit, recorded")
    args = parser.parse_args()
    _install_flash_attn_stub()
    sys.path.insert(0, str(args.bagel_repo.resolve()))
    torch.set_num_threads(2)
    model, vae, tokenizer, new_token_ids = load_official(args.checkpoint)

    from safetensors.torch import save_file
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "source": "github.com/ByteDance-Seed/Bagel" + (f" @ {args.commit}" if args.commit else ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model_dtype": "bfloat16",
        "autoencoder_dtype": "float32",
        "checkpoint_sha256": {name: _sha256(args.checkpoint / name)
                              for name in ("ema.safetensors", "ae.safetensors")},
        "special_token_ids": {k: int(v) for k, v in new_token_ids.items()},
        "cases": {},
    }
    cases = [(*case, None) for case in CASES] + THINK_CASES
    for name, prompt, seed, size, knobs, think_tokens in cases:
        record, again = (run_case(model, vae, tokenizer, new_token_ids, prompt, seed, size,
                                  knobs, think_tokens) for _ in range(2))
        reasoning = record.pop("reasoning", None)
        repeatable = reasoning == again.pop("reasoning", None) and all(
            torch.equal(record[k], again[k]) for k in record)
        save_file({k: v.contiguous() for k, v in record.items()},
                  str(args.out / f"{name}.safetensors"))
        meta["cases"][name] = {"prompt": prompt, "seed": seed, "height": size[0],
                               "width": size[1], "knobs": knobs,
                               "steps": knobs["num_timesteps"] - 1,
                               "bitwise_repeatable": repeatable}
        if think_tokens is not None:
            meta["cases"][name].update(max_think_token_n=think_tokens, reasoning=reasoning)
        print(f"{name}: {len(record)} tensors, repeatable={repeatable}")
    served = json.loads((args.checkpoint / "config.json").read_text())
    for name, prompt, seed, sizes, knobs in EDIT_CASES:
        record, again = (run_edit_case(model, vae, tokenizer, new_token_ids, served, prompt,
                                       seed, sizes, knobs) for _ in range(2))
        save_file({k: v.contiguous() for k, v in record.items()},
                  str(args.out / f"{name}.safetensors"))
        height, width = record["pixels"].shape[:2]
        meta["cases"][name] = {
            "prompt": prompt, "seed": seed, "input_sizes": sizes,
            "height": height, "width": width, "knobs": knobs,
            "steps": knobs["num_timesteps"] - 1,
            "bitwise_repeatable": all(torch.equal(record[k], again[k]) for k in record)}
        print(f"{name}: {len(record)} tensors, "
              f"repeatable={meta['cases'][name]['bitwise_repeatable']}")
    (args.out / "reference.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
