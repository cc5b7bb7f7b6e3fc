"""The BAGEL DiT's pieces that need no engine: the seed's noise, guidance settings and
their combination, latent positions, the autoencoder's decoder and weight names."""

from __future__ import annotations

import contextlib
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
from vllm_omni_plugin.models.bagel.geometry import grid_position_ids

#: an editing context vs the official code's (bf16): max |difference| / max |reference|
EDIT_KV_REL_TOL = 0.03


def test_noise_of_a_seed_is_the_official_codes(tiny_bagel):
    """The head draws a seed's noise exactly as the official code did for the fixtures
    (the last case is a text-to-image one: the cases are sorted by name)."""
    from safetensors.torch import load_file

    config = served_bagel_config(tiny_bagel)
    cases = json.loads((Path(BAGEL_REFERENCE) / "reference.json").read_text())["cases"]
    for name, case in cases.items():
        record = load_file(str(Path(BAGEL_REFERENCE) / f"{name}.safetensors"))
        ref = record["noise"]
        if "input_image.0" in record:  # editing: the autoencoder's posterior draws first
            sizes = [(h, w) for i in range(len(case["input_sizes"]))
                     for h, w in [record[f"posterior_eps.{i}"].shape[1:]]]
            eps, noise = dit.edit_noise(case["seed"], [(8 * h, 8 * w) for h, w in sizes],
                                        case["height"], case["width"], config)
            for i, draw in enumerate(eps):
                # (drawn there in the bf16 of the encoder's output under autocast)
                assert draw.bfloat16().float().equal(record[f"posterior_eps.{i}"]), name
        else:
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
    ids = grid_position_ids(32, 48, 16, 8)
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
    assert m("language_model.model.embed_tokens.weight") == "embed_tokens.weight"
    assert m("time_embedder.mlp.2.bias") == "time_embedder.2.bias"
    assert m("decoder.up.1.upsample.conv.weight") == "vae.up.1.upsample.conv.weight"
    # image editing: the autoencoder's encoder, the ViT and its connector
    assert m("encoder.down.0.downsample.conv.weight") == \
        "vae_encoder.down.0.downsample.conv.weight"
    assert m("vit_model.vision_model.post_layernorm.weight") == \
        "vit.vit_model.vision_model.post_layernorm.weight"
    assert m("connector.fc1.weight") == "vit.connector.fc1.weight"
    for skipped in ("language_model.model.norm.weight", "language_model.lm_head.weight",
                    "latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed"):
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
    ids = json.loads((Path(BAGEL_REFERENCE) / "reference.json").read_text())[
        "special_token_ids"]  # the tokenizer's <|vision_start|> and <|vision_end|>
    with set_current_vllm_config(vllm_config):
        model = dit.BagelDiT(served_bagel_config(tiny_bagel),
                             (ids["start_of_image"], ids["end_of_image"]))
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
        return model.velocities([x], [0.7], [pos_embed], [len(lengths)], packed), \
            packed.mask is not None


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
    ``max_num_seqs`` 1,024 would let one step hold every queued image):
    ``max_num_seqs`` is ``MAX_IMAGES_PER_STEP``, so a step is at most that many Euler
    steps, seconds at 1024x1024, and the DiT keeps the default stall timeout; the
    head's admission bound at the DiT follows ``max_num_seqs`` (times its local
    replicas), not the entry engine's default."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    from vllm_omni_plugin.config import load_pipeline_config
    from vllm_omni_plugin.config.pipelines import builtin_pipeline
    from vllm_omni_plugin.engine.bootstrap import admission_bound
    from vllm_omni_plugin.replicas.liveness import DEFAULT_STALL_TIMEOUT_S

    (stage,) = [s for s in load_pipeline_config(builtin_pipeline(name)).stages
                if s.engine_args["hf_overrides"]["architectures"] == ["OmniPluginBagelDiT"]]
    assert stage.engine_args["max_num_seqs"] == dit.MAX_IMAGES_PER_STEP == 4
    assert stage.runtime.stall_timeout is None
    # its longest step, with a slower GPU's and first compilations' margin of 4
    assert 4 * dit.MAX_IMAGES_PER_STEP * dit.EULER_STEP_SECONDS < DEFAULT_STALL_TIMEOUT_S
    entry = VllmConfig()
    entry.scheduler_config.max_num_seqs = 1024  # vLLM's GPU default, the entry engine's
    assert admission_bound(stage, [], entry) == 4  # remote replicas only: the YAML's

    def local(stage_id):  # a local replica: its engine's resolved max_num_seqs
        scheduler = SimpleNamespace(max_num_seqs=stage.engine_args["max_num_seqs"])
        return SimpleNamespace(stage_id=stage_id, engine=SimpleNamespace(
            vllm_config=SimpleNamespace(scheduler_config=scheduler)))

    assert admission_bound(stage, [local(0), local(1), local(1)], entry) == 8


def _image_inputs(model, seed: int, side: int, context: int, t2i: bool = False, **knobs):
    """``(noise, height, width, guidance, branches)`` of a ``side`` px image under
    seeded random contexts (``context`` tokens; the text-unconditional one empty; the
    image-unconditional one another, or with ``t2i`` the full one again, as text to
    image's)."""
    attn = model.layers[0].und.self_attn
    generator = torch.Generator().manual_seed(seed)
    k, v, k_img, v_img = (torch.randn(len(model.layers), context,
                                      attn.kv_size // attn.head_dim, attn.head_dim,
                                      generator=generator) for _ in range(4))
    branches = {"cond": (k, v, context), "text_uncond": (k[:, :0], v[:, :0], 0),
                "img_uncond": (k.clone(), v.clone(), context) if t2i else
                (k_img, v_img, context)}
    tokens = (side // model.downsample) ** 2
    noise = torch.randn(tokens, model.latent_dim, generator=generator)
    return noise, side, side, dit.Guidance(**{"num_timesteps": 6, **knobs}), branches


@contextlib.contextmanager
def _forwards(model):
    """The images of each forward :meth:`BagelDiT.velocities` runs meanwhile (a list)."""
    calls = []
    velocities = model.velocities

    def count(xs, *args):
        calls.append(len(xs))
        return velocities(xs, *args)

    model.velocities = count
    try:
        yield calls
    finally:
        del model.velocities


#: images of one size with their own seeds, contexts, steps and guidance (CFG on and off,
#: the interval's edge crossed at different steps, text to image's image-unconditional
#: context), and one of another size
BATCHED = [(1, 32, 5, {}), (2, 32, 9, {"num_timesteps": 4, "t2i": True}),
           (3, 32, 7, {"cfg_text_scale": 1.0}),
           (4, 32, 5, {"cfg_interval": (0.6, 1.0), "cfg_renorm_type": "text_channel"}),
           (5, 16, 6, {})]


def test_text_to_image_computes_the_image_unconditional_branch_once(tiny_dit):
    """Text to image's image-unconditional context is its full one (no input image to
    leave out): its velocity is the ``cond`` one, not computed again (a third less
    DiT work per step under image guidance), which computed it is up to float rounding
    (the same rows in one padded batch; bit for bit on vLLM's CPU build, not always
    elsewhere); a context that differs (here its RoPE position) is computed."""
    noise, height, width, guidance, branches = _image_inputs(tiny_dit, 7, 32, 5, t2i=True)
    image = tiny_dit.start(noise, height, width, guidance, branches)
    assert image.same_as_cond == {"img_uncond"} and image.names() == ("cond", "text_uncond")
    other = {**branches, "img_uncond": (branches["cond"][0] + 0, branches["cond"][1],
                                        branches["cond"][2] + 1)}  # another RoPE position
    assert tiny_dit.start(noise, height, width, guidance, other).same_as_cond == set()
    both = tiny_dit.pack([branches[b] for b in dit.BRANCHES], 4, "cpu")
    first = tiny_dit.velocities([noise], [1.0], [image.pos_embed], [3], both)
    # what is not computed again: the same values
    torch.testing.assert_close(first[2], first[0], rtol=1e-5, atol=1e-6)


def test_images_denoised_together_equal_each_alone(tiny_dit):
    """:meth:`BagelDiT.advance` on images of different seeds, contexts, steps, guidance
    and sizes at once (those of one size share forwards; shorter ones finish first):
    each final latent equals the image sampled alone, to float32 rounding, and the
    forwards run are one per size and step, not one per image."""
    images = [_image_inputs(tiny_dit, seed, side, context, **knobs)
              for seed, side, context, knobs in BATCHED]
    alone = [tiny_dit.generate(*inputs)[0] for inputs in images]
    started = [tiny_dit.start(*inputs) for inputs in images]
    packs: dict = {}
    with _forwards(tiny_dit) as calls:
        while not all(image.done for image in started):
            tiny_dit.advance(started, packs, budget=4)
    for image, want in zip(started, alone, strict=True):
        torch.testing.assert_close(image.x, want, rtol=1e-4, atol=1e-5)
    # 5 steps: the four 32 px images together (three after the 4-step one ends), the
    # 16 px one beside them
    assert calls == [4, 1, 4, 1, 4, 1, 3, 1, 3, 1], calls
    assert len(packs) == 2  # the last step's two forwards


@pytest.mark.parametrize("budget, forwards", [(1, [1, 1, 1]), (2, [2, 1]), (4, [3])])
def test_a_forward_holds_at_most_the_profiled_rows(tiny_dit, budget, forwards):
    """Images of one size share a forward only while its query and key rows stay within
    the memory profile's (:meth:`BagelDiT.forward_budget`: three branches of ``budget``,
    the engine's ``max_num_seqs``, images of the largest size, with the contexts of an
    editing request at the largest sizes); the rest go to further forwards, still in the
    same step."""
    side = dit.max_image_side(tiny_dit.config)
    rows, keys = tiny_dit.forward_budget(budget)
    n = (side // tiny_dit.downsample) ** 2 + 2
    vit = tiny_dit.config.vit_max_num_patch_per_side ** 2
    # cond: the image through the autoencoder and the ViT, an instruction of n - 2
    # tokens; text_uncond: the image; img_uncond: the instruction
    contexts = (n + vit + 2 + n - 2) + (n + vit + 2) + (n - 2)
    assert rows == budget * 3 * n and keys == budget * (contexts + 3 * n)
    started = [tiny_dit.start(*_image_inputs(tiny_dit, seed, side, 1, num_timesteps=2))
               for seed in range(3)]
    with _forwards(tiny_dit) as calls:
        tiny_dit.advance(started, {}, budget)
    assert calls == forwards and all(image.done for image in started)


@pytest.mark.parametrize("case", ["edit_text_channel", "edit_two_images"])
def test_an_editing_context_is_the_official_codes(tiny_dit, tiny_bagel, case):
    """Editing: the input images resized as the official transforms resize them, each
    through the autoencoder (the fixture's posterior draw) and the ViT, then the
    instruction: the images' context (text-unconditional) and the full one equal the
    official code's keys and values, layer by layer (bf16 there, float32 here)."""
    from PIL import Image
    from safetensors.torch import load_file

    from vllm_omni_plugin.models.bagel.editing import edit_images

    record = load_file(str(Path(BAGEL_REFERENCE) / f"{case}.safetensors"))
    count = sum(1 for k in record if k.startswith("input_image."))
    resized = [edit_images(Image.fromarray(record[f"input_image.{i}"].numpy()),
                           served_bagel_config(tiny_bagel)) for i in range(count)]
    assert resized[-1][0].shape == record["pixels"].shape  # drawn at the last one's size
    image, full = tiny_dit.edit_contexts([torch.from_numpy(vae.copy()) for vae, _ in resized],
                                         [torch.from_numpy(vit.copy()) for _, vit in resized],
                                         [record[f"posterior_eps.{i}"] for i in range(count)],
                                         record["text_ids"])
    for (k, v, rope), name in ((image, "cfg_text"), (full, "context")):
        assert k.shape[1] == record[f"{name}.k.0"].shape[0]
        text = record["text_ids"].shape[0] if name == "context" else 0
        assert rope == 2 * count + text
        for layer in range(len(tiny_dit.layers)):
            for got, ref in ((k[layer], record[f"{name}.k.{layer}"]),
                             (v[layer], record[f"{name}.v.{layer}"])):
                rel = float((got.float() - ref).abs().max() / ref.abs().max())
                assert rel < EDIT_KV_REL_TOL, (name, layer, rel)
