"""The BAGEL DiT's pieces that need no engine: the seed's noise, guidance settings and
their combination, latent positions, the autoencoder's decoder and weight names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugin_tests.conftest import BAGEL_REFERENCE
from plugin_tests.helpers import served_bagel_config

torch = pytest.importorskip("torch")

from vllm_omni_plugin.models.bagel import dit  # noqa: E402
from vllm_omni_plugin.models.bagel.autoencoder import (  # noqa: E402
    FluxDecoder,
    autoencoder_config,
)


def test_noise_of_a_seed_is_the_official_codes(tiny_bagel):
    """The head draws a seed's noise exactly as the official code did for the fixtures."""
    from safetensors.torch import load_file

    config = served_bagel_config(tiny_bagel)
    cases = json.loads((Path(BAGEL_REFERENCE) / "reference.json").read_text())["cases"]
    for name, case in cases.items():
        ref = load_file(str(Path(BAGEL_REFERENCE) / f"{name}.safetensors"))["noise"]
        noise = dit.initial_noise(case["seed"], case["height"], case["width"], config)
        assert noise.equal(ref), name
    other = dit.initial_noise(case["seed"] + 1, case["height"], case["width"], config)
    assert not other.equal(ref)


def test_guidance_round_trips_and_names_bad_fields():
    g = dit.Guidance(cfg_text_scale=3.0, cfg_img_scale=1.2, cfg_interval=(0.1, 0.9),
                     cfg_renorm_min=0.5, cfg_renorm_type="text_channel",
                     timestep_shift=2.0, num_timesteps=7)
    assert dit.Guidance.from_tensor(g.to_tensor()) == g
    for field, value in (("cfg_text_scale", -1.0), ("cfg_interval", (0.9, 0.1)),
                         ("cfg_renorm_type", "bogus"), ("timestep_shift", 0.0),
                         ("num_timesteps", 1), ("cfg_renorm_min", 2.0)):
        with pytest.raises(ValueError, match=field):
            dit.Guidance(**{field: value})
    with pytest.raises(ValueError, match="guidance"):
        dit.Guidance.from_tensor(torch.zeros(3))


def test_shifted_timesteps_and_interval():
    g = dit.Guidance(timestep_shift=3.0, num_timesteps=5, cfg_interval=(0.4, 1.0))
    t = g.timesteps()
    assert t[0] == 1.0 and t[-1] == 0.0 and bool((t[:-1] > t[1:]).all())
    # s t / (1 + (s - 1) t) at t = 0.5: 1.5 / 2
    assert float(t[2]) == pytest.approx(0.75)
    assert g.scales_at(1.0) == (4.0, 1.5)
    assert g.scales_at(0.4) == (1.0, 1.0)  # the interval's low end is open


def test_guided_velocity():
    gen = torch.Generator().manual_seed(0)
    v, vt, vi = (torch.randn(4, 8, generator=gen) for _ in range(3))
    assert dit.guided_velocity(v, None, None, 1.0, 1.5, "global", 0.0) is v
    with pytest.raises(ValueError, match="missing"):
        dit.guided_velocity(v, vt, None, 4.0, 1.5, "global", 0.0)
    # renorm_min 1 keeps the guided velocity's own norm (clamped ratio 1): plain CFG
    plain = dit.guided_velocity(v, vt, vi, 4.0, 1.5, "global", 1.0)
    assert torch.allclose(plain, vi + 1.5 * (vt + 4.0 * (v - vt) - vi))
    # global renorm: never longer than the conditional velocity
    renormed = dit.guided_velocity(v, vt, vi, 4.0, 1.5, "global", 0.0)
    assert float(renormed.norm()) <= float(v.norm()) * (1 + 1e-6)
    channel = dit.guided_velocity(v, vt, None, 4.0, 1.0, "channel", 0.0)
    assert bool((channel.norm(dim=-1) <= v.norm(dim=-1) * (1 + 1e-6)).all())


def test_latent_positions_are_row_major_in_the_max_grid():
    ids = dit.latent_position_ids(32, 48, 16, 8)
    assert ids.tolist() == [0, 1, 2, 8, 9, 10]


def test_decoder_loads_the_checkpoints_autoencoder(tiny_bagel):
    from safetensors.torch import load_file

    config = served_bagel_config(tiny_bagel)
    decoder = FluxDecoder(config.vae_config)
    weights = load_file(str(Path(tiny_bagel) / "ae.safetensors"))
    own = {k[len("decoder."):]: w for k, w in weights.items() if k.startswith("decoder.")}
    decoder.load_state_dict(own, strict=True)
    with torch.inference_mode():
        rgb = decoder(torch.randn(1, 16, 2, 3))
    assert rgb.shape == (1, 3, 16, 24)


def test_autoencoder_config_errors_name_the_field():
    with pytest.raises(ValueError, match="downsample"):
        autoencoder_config({"ch_mult": [1, 2], "downsample": 8})
    with pytest.raises(ValueError, match="GroupNorm"):
        autoencoder_config({"ch": 24})


def test_checkpoint_names_map_to_the_dit():
    m = dit._map_weight
    assert m("language_model.model.layers.3.self_attn.q_proj_moe_gen.bias") == \
        "layers.3.gen.self_attn.q_proj.bias"
    assert m("language_model.model.layers.3.mlp_moe_gen.up_proj.weight") == \
        "layers.3.gen.mlp.up_proj.weight"
    assert m("language_model.model.layers.0.input_layernorm.weight") == \
        "layers.0.und.input_layernorm.weight"
    assert m("language_model.model.norm_moe_gen.weight") == "norm_gen.weight"
    assert m("language_model.model.embed_tokens.weight") == "marker_embeds"
    assert m("time_embedder.mlp.2.bias") == "time_embedder.2.bias"
    assert m("decoder.up.1.upsample.conv.weight") == "vae.up.1.upsample.conv.weight"
    for skipped in ("language_model.model.norm.weight", "language_model.lm_head.weight",
                    "vit_model.vision_model.post_layernorm.weight", "connector.fc1.weight",
                    "latent_pos_embed.pos_embed", "encoder.conv_in.weight"):
        assert m(skipped) is None, skipped
