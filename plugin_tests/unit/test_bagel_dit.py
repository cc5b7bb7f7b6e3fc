"""The BAGEL DiT's pieces that need no engine: the seed's noise, guidance settings and
their combination, latent positions, the autoencoder's decoder and weight names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plugin_tests.conftest import BAGEL_REFERENCE
from plugin_tests.helpers import served_bagel_config
from vllm_omni_plugin.models.bagel import dit
from vllm_omni_plugin.models.bagel.autoencoder import (
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


@pytest.fixture(scope="module")
def tiny_dit(tiny_bagel):
    """The tiny checkpoint's :class:`~vllm_omni_plugin.models.bagel.dit.BagelDiT` (vLLM's
    layers, one gloo rank in this process, float32 on the CPU), its weights loaded."""
    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_omni_plugin.tools.plan import single_rank

    vllm_config = VllmConfig()
    single_rank(vllm_config)
    with set_current_vllm_config(vllm_config):
        model = dit.BagelDiT(served_bagel_config(tiny_bagel), (1, 2))
    weights = {**load_file(str(Path(tiny_bagel) / "ema.safetensors")),
               **load_file(str(Path(tiny_bagel) / "ae.safetensors"))}
    model.load_weights(weights.items())
    for module in model.modules():  # what vLLM's loader does next (the CPU build's GEMMs)
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()


def _velocities(model, lengths: list[int]):
    """The velocities of a 4 x 4 latent under CFG branches with contexts of ``lengths``
    tokens (seeded), and whether their packed batch has a padding mask."""
    attn = model.layers[0].und.self_attn
    generator = torch.Generator().manual_seed(0)
    contexts = []
    for length in lengths:
        k, v = (torch.randn(len(model.layers), length, attn.kv_size // attn.head_dim,
                            attn.head_dim, generator=generator) for _ in range(2))
        contexts.append((k, v, length))
    packed = model.pack(contexts, 16, "cpu")
    x = torch.randn(16, model.latent_dim, generator=generator)
    pos_embed = torch.randn(16, model.hidden_size, generator=generator)
    with torch.inference_mode():
        return model.velocities(x, 0.7, pos_embed, packed), packed.mask is not None


def test_masked_attention_repeats_kv_heads_instead_of_gqa(tiny_dit, monkeypatch):
    """No SDPA call of the DiT takes both a mask and ``enable_gqa``: PyTorch has no
    fused CUDA kernel for that pair and falls back to its math kernel (float32 scores,
    GiBs per layer at 1024x1024; review 2, N2). Branches of equal context length (no
    mask) keep ``enable_gqa``; unequal ones (``text_uncond`` without the prompt) get
    keys and values repeated to the query heads. The velocities equal those of SDPA
    called with both (what the DiT did before), to float32 rounding."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def record(q, k, v, attn_mask=None, **kwargs):
        calls.append({"mask": attn_mask is not None, "gqa": kwargs.get("enable_gqa", False),
                      "heads": (q.shape[1], k.shape[1])})
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)
    heads = tiny_dit.layers[0].und.self_attn.q_size // tiny_dit.layers[0].und.self_attn.head_dim
    results = {}
    for lengths in ([5, 5, 5], [5, 0, 5]):
        calls.clear()
        results[tuple(lengths)] = _velocities(tiny_dit, lengths)
        masked = results[tuple(lengths)][1]
        assert masked == (lengths[1] != lengths[0])
        assert len(calls) == len(tiny_dit.layers), calls
        both = [c for c in calls if c["mask"] and c["gqa"]]
        assert not both, f"SDPA called with a mask and enable_gqa: {both}"
        if masked:
            assert all(c["mask"] and c["heads"] == (heads, heads) for c in calls), calls
        else:
            assert all(c["gqa"] and c["heads"][1] < heads for c in calls), calls
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)

    def both_at_once(q, k, v, mask):
        return sdpa(q, k, v, attn_mask=mask, enable_gqa=True)

    monkeypatch.setattr(dit, "attend", both_at_once)
    for lengths, (new, _) in results.items():
        old, _ = _velocities(tiny_dit, list(lengths))
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["bagel", "bagel_replicated", "bagel_1xh100"])
def test_shipped_bagel_pipelines_bound_the_dit_step(name):
    """Every BAGEL pipeline bounds a DiT engine step (review 2, N4: vLLM's GPU default
    ``max_num_seqs`` 1,024 let one step render every queued image, past the stall
    timeout: kill, resubmit, the same batch again): ``max_num_seqs`` is
    ``MAX_IMAGES_PER_STEP``, the stall timeout the multiple of that step's longest time
    ``DIT_STALL_TIMEOUT_S``, and the head's admission bound at the DiT follows
    ``max_num_seqs`` (times its local replicas), not the entry engine's default."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    from vllm_omni_plugin.config import load_pipeline_config
    from vllm_omni_plugin.config.pipelines import builtin_pipeline
    from vllm_omni_plugin.engine.bootstrap import admission_bound
    from vllm_omni_plugin.replicas.liveness import DEFAULT_STALL_TIMEOUT_S

    (stage,) = [s for s in load_pipeline_config(builtin_pipeline(name)).stages
                if s.engine_args["hf_overrides"]["architectures"] == ["OmniPluginBagelDiT"]]
    assert stage.engine_args["max_num_seqs"] == dit.MAX_IMAGES_PER_STEP == 2
    assert stage.runtime.stall_timeout == dit.DIT_STALL_TIMEOUT_S
    assert dit.DIT_STALL_TIMEOUT_S == 420 > DEFAULT_STALL_TIMEOUT_S
    entry = VllmConfig()
    entry.scheduler_config.max_num_seqs = 1024  # vLLM's GPU default, the entry engine's
    assert admission_bound(stage, [], entry) == 2  # remote replicas only: the YAML's

    def local(stage_id):  # a local replica: its engine's resolved max_num_seqs
        scheduler = SimpleNamespace(max_num_seqs=stage.engine_args["max_num_seqs"])
        return SimpleNamespace(stage_id=stage_id, engine=SimpleNamespace(
            vllm_config=SimpleNamespace(scheduler_config=scheduler)))

    assert admission_bound(stage, [local(0), local(1), local(1)], entry) == 4
