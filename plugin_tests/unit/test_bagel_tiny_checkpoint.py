"""The tiny BAGEL checkpoint (``tools.tiny_checkpoint bagel``): the official layout, what
vLLM's ``BagelConfig`` reads, and the very weights the official-code fixtures were
computed on (``plugin_tests/fixtures/bagel_reference``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import safetensors.torch as safetensors_torch
import torch

from plugin_tests.conftest import BAGEL_REFERENCE


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_weights_are_the_ones_the_reference_fixtures_were_computed_on(tiny_bagel):
    """Same seed, same bytes: were the builder to change, the fixtures would no longer
    describe the checkpoint the tests load (regenerate them: scripts/bagel_reference.sh)."""
    reference = json.loads((Path(BAGEL_REFERENCE) / "reference.json").read_text())
    for name, digest in reference["checkpoint_sha256"].items():
        assert _sha256(Path(tiny_bagel) / name) == digest, name


def test_another_seed_gives_other_weights(tmp_path, tiny_bagel):
    from vllm_omni_plugin.tools.tiny_checkpoint import build

    summary = build("bagel", tmp_path / "seed1", seed=1)
    assert summary["files"] == sorted(p.name for p in Path(tiny_bagel).iterdir())
    for name in ("ema.safetensors", "ae.safetensors"):
        assert _sha256(tmp_path / "seed1" / name) != _sha256(Path(tiny_bagel) / name)


def test_official_layout_and_weights(tiny_bagel):
    ckpt = Path(tiny_bagel)
    ema = safetensors_torch.load_file(str(ckpt / "ema.safetensors"))
    ae = safetensors_torch.load_file(str(ckpt / "ae.safetensors"))
    llm = json.loads((ckpt / "llm_config.json").read_text())
    vit = json.loads((ckpt / "vit_config.json").read_text())
    served = json.loads((ckpt / "config.json").read_text())
    layers = llm["num_hidden_layers"]
    # the generation expert: a copy of every understanding-expert module of every layer
    und = {k for k in ema if k.startswith("language_model.model.layers.") and "moe_gen" not in k}
    gen = {k for k in ema if "_moe_gen" in k and k.startswith("language_model.model.layers.")}
    assert len(und) == len(gen) > 0
    assert {k.replace("_moe_gen", "") for k in gen} == und
    assert "language_model.model.norm_moe_gen.weight" in ema
    for name in ("time_embedder.mlp.0.weight", "vae2llm.weight", "llm2vae.weight",
                 "latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed", "connector.fc1.weight"):
        assert name in ema, name
    # SigLIP's patch embedding stored as a linear layer; the official loader drops the
    # last of vit_config.json's layers, config.json counts the stored ones
    patch = vit["patch_size"]
    assert ema["vit_model.vision_model.embeddings.patch_embedding.weight"].shape == (
        vit["hidden_size"], 3 * patch * patch)
    stored = {int(k.split(".")[4]) for k in ema if ".encoder.layers." in k}
    assert len(stored) == vit["num_hidden_layers"] - 1 == served["vit_config"]["num_hidden_layers"]
    assert {int(k.split(".")[3]) for k in und} == set(range(layers))
    # latent positions: max_latent_size**2 rows, the 2-D sin-cos table
    side = served["max_latent_size"]
    table = ema["latent_pos_embed.pos_embed"]
    assert table.shape == (side * side, llm["hidden_size"])
    assert torch.allclose(table[0], torch.cat([torch.zeros(llm["hidden_size"] // 4),
                                               torch.ones(llm["hidden_size"] // 4)] * 2))
    # the autoencoder: FLUX's 16 latent channels, decoder and encoder, BFL key names
    vae = served["vae_config"]
    assert vae["z_channels"] == 16 and vae["downsample"] == 2 ** (len(vae["ch_mult"]) - 1)
    assert ae["decoder.conv_in.weight"].shape[1] == 16
    assert ae["encoder.conv_out.weight"].shape[0] == 32
    assert ae["decoder.conv_out.weight"].shape[0] == 3
    # every value bf16-exact (the reference computes in bf16 on the same weights), none
    # degenerate
    for name, tensor in {**ema, **ae}.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, tensor.to(torch.bfloat16).float()), name
        assert torch.isfinite(tensor).all() and float(tensor.std()) > 0, name


def test_config_and_tokenizer_as_vllm_reads_them(tiny_bagel):
    from transformers import AutoTokenizer
    from vllm.transformers_utils.configs.bagel import BagelConfig

    served = json.loads((Path(tiny_bagel) / "config.json").read_text())
    assert served["architectures"] == ["BagelForConditionalGeneration"]
    config = BagelConfig(**{k: v for k, v in served.items() if k != "model_type"})
    assert config.llm_config.qk_norm is True
    assert config.llm_config.tie_word_embeddings is False
    # vLLM's processor gives an image vit_max_num_patch_per_side**2 tokens, its model
    # (image_size / patch_size)**2 features: they must agree
    vit = config.vit_config
    assert (vit.image_size // vit.patch_size) == config.vit_max_num_patch_per_side
    tokenizer = AutoTokenizer.from_pretrained(tiny_bagel)
    for token in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|endoftext|>"):
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] < config.llm_config.vocab_size, token
    reference = json.loads((Path(BAGEL_REFERENCE) / "reference.json").read_text())
    assert reference["special_token_ids"]["bos_token_id"] == tokenizer.convert_tokens_to_ids(
        "<|im_start|>")
