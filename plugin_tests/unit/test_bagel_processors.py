"""BAGEL's image planning and AR -> DiT processor, and the API's parsing of OpenAI's
image request (no engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from vllm_omni_plugin.entrypoints.images import (
    chat_image_body,
    chat_image_response,
    parse_image_request,
)
from vllm_omni_plugin.models.bagel import processors as bp
from vllm_omni_plugin.models.bagel.dit import BRANCHES, Guidance
from vllm_omni_plugin.processors import (
    ImageRequest,
    RequestError,
    StageRequest,
    UpstreamOutput,
    get_processor,
    plan_image,
)


@pytest.fixture(scope="module")
def config(tiny_bagel):
    from vllm.transformers_utils.configs.bagel import BagelConfig

    served = json.loads((Path(tiny_bagel) / "config.json").read_text())
    return BagelConfig(**{k: v for k, v in served.items() if k != "model_type"})


def test_openai_fields_parse_and_the_rest_goes_to_the_model():
    request, fmt, compression = parse_image_request({
        "model": "m", "prompt": "a cat", "size": "64x32", "seed": 3, "user": "u",
        "output_format": "webp", "output_compression": 50, "cfg_text_scale": 2.0})
    assert (request.size, request.seed, fmt, compression) == ((64, 32), 3, "webp", 50)
    assert request.extra == {"cfg_text_scale": 2.0}
    assert parse_image_request({"model": "m", "prompt": "a"})[0].size is None
    for body, field in (({"prompt": "a"}, "model"), ({"model": "m"}, "prompt"),
                        ({"model": "m", "prompt": "a", "size": "64"}, "size"),
                        ({"model": "m", "prompt": "a", "seed": "1"}, "seed"),
                        ({"model": "m", "prompt": "a", "quality": "hd"}, "quality"),
                        ({"model": "m", "prompt": "a", "output_compression": 5},
                         "output_compression"),
                        ({"model": "m", "prompt": "a", "output_format": {"a": 1}},
                         "output_format")):
        with pytest.raises(RequestError) as err:
            parse_image_request(body)
        assert err.value.field == field


def test_an_image_chat_becomes_an_image_request_of_its_last_user_message():
    body, images = chat_image_body({
        "model": "m", "modalities": ["image"], "max_tokens": 5, "temperature": 0.3,
        "size": "32x32", "seed": 4, "cfg_text_scale": 2.0, "messages": [
            {"role": "user", "content": "a dog"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "a cat"},
                                         {"type": "text", "text": "on a mat"}]}]})
    assert body == {"model": "m", "prompt": "a cat\non a mat", "size": "32x32", "seed": 4,
                    "cfg_text_scale": 2.0}
    assert images == []
    request = parse_image_request(body)[0]
    assert (request.prompt, request.size, request.seed) == ("a cat\non a mat", (32, 32), 4)
    user = [{"role": "user", "content": "a cat"}]
    for bad, field in (
            ({"modalities": ["text", "image"], "messages": user}, "modalities"),
            ({"modalities": ["image"], "messages": user, "stream": True}, "stream"),
            ({"modalities": ["image"], "messages": [{"role": "system", "content": "x"}]},
             "messages"),
            ({"modalities": ["image"], "messages": [{"role": "user", "content": " "}]},
             "messages"),
            ({"modalities": ["image"], "messages": [{"role": "user", "content": [
                {"type": "text", "text": "like this"},
                {"type": "image_url", "image_url": {"url": 3}}]}]},
             "messages[0].content[1]"),
            ({"modalities": ["image"], "messages": [{"role": "user", "content": [
                {"type": "text", "text": "like this"}, {"type": "image_url"}]}]},
             "messages[0].content[1]"),
            ({"modalities": ["image"], "messages": [{"role": "user", "content": [
                {"type": "text", "text": "like this"}, {"type": "input_audio"}]}]},
             "messages[0].content[1]")):
        with pytest.raises(RequestError) as err:
            chat_image_body({"model": "m", **bad})
        assert err.value.field == field


def test_an_image_in_an_image_chat_is_an_image_to_edit():
    body, images = chat_image_body({"model": "m", "modalities": ["image"], "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u1"}},
                                     {"type": "text", "text": "make it blue"},
                                     {"type": "image_url", "image_url": {"url": "u2"}}]}]})
    assert body["prompt"] == "make it blue"
    assert images == [("messages[0].content[0]", "u1"), ("messages[0].content[2]", "u2")]


def test_images_to_edit_are_read_as_vllm_reads_a_chats_media(tmp_path, monkeypatch):
    """:func:`fetch_images` through vLLM's own media connector, with real URLs: a
    ``data:`` URL, an ``http:`` URL of a real local server, a ``file:`` URL under
    ``--allowed-local-media-path``; refused (400 naming the part, vLLM's reason): an
    HTTP 404, a domain ``--allowed-media-domains`` leaves out, a file outside the
    allowed path or without one, a body over the byte limit, base64 that does not
    decode."""
    import base64
    from types import SimpleNamespace

    from plugin_tests.helpers import http_files
    from vllm_omni_plugin.entrypoints import images as api

    png = b"\x89PNG" + bytes(range(256)) * 4
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(png)
    (tmp_path / "elsewhere.png").write_bytes(png)

    def config(**flags):
        return SimpleNamespace(**{"allowed_local_media_path": str(tmp_path / "media"),
                                  "allowed_media_domains": None, "media_io_kwargs": None,
                                  **flags})

    async def fetch(url, model_config=None):
        return await api.fetch_images(model_config or config(), [("part", url)])

    async def check(base):  # one event loop: vLLM's HTTP client keeps a session on it
        assert await fetch("data:image/png;base64," + base64.b64encode(png).decode()) \
            == [("part", png)]
        assert await fetch(f"{base}/a.png") == [("part", png)]
        assert await fetch((tmp_path / "media" / "a.png").as_uri()) == [("part", png)]
        monkeypatch.setattr(api, "MAX_INPUT_IMAGE_BYTES", len(png) + 1)
        for url, model_config, reason in (
                (f"{base}/missing.png", None, "404"),
                (f"{base}/a.png", config(allowed_media_domains=["example.com"]),
                 "allowed domains"),
                ((tmp_path / "elsewhere.png").as_uri(), None, "allowed-local-media-path"),
                ((tmp_path / "media" / "a.png").as_uri(),
                 config(allowed_local_media_path=""), "allowed-local-media-path"),
                (f"{base}/big.png", None, "exceed"),
                ("data:image/png;base64,%%", None, "base64")):
            with pytest.raises(RequestError) as err:
                await fetch(url, model_config)
            assert err.value.field == "part" and reason in str(err.value), (url, err.value)

    with http_files({"a.png": png, "big.png": png * 2}) as base:
        asyncio.run(check(base))


def test_input_images_are_decoded_within_limits():
    import io

    from PIL import Image

    from vllm_omni_plugin.entrypoints import images as api

    png = io.BytesIO()
    rgba = Image.new("RGBA", (30, 20), (1, 2, 3, 255))
    rgba.putpixel((0, 0), (1, 2, 3, 0))
    rgba.save(png, format="PNG")
    image = api.decode_input_image(png.getvalue(), "image")
    assert (image.mode, image.size) == ("RGB", (30, 20))
    # transparency over white, as the official pil_img2rgb (dropping alpha would keep
    # the transparent pixel's colour)
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 0)) == (1, 2, 3)
    huge = io.BytesIO()
    Image.new("L", (4097, 4096)).save(huge, format="PNG")
    for data, words in ((b"GIF89a broken", "decodes"), (huge.getvalue(), "4097x4096"),
                        (b"0" * (api.MAX_INPUT_IMAGE_BYTES + 1), "bytes")):
        with pytest.raises(RequestError, match=words) as err:
            api.decode_input_image(data, "image")
        assert err.value.field == "image"


def test_an_edit_plans_the_input_at_the_official_sizes_and_defaults(config):
    """An input image (100 x 60) resized as the official transforms (capped by the tiny
    checkpoint: autoencoder 128/64/16, ViT 56/28/14) and the official editing defaults;
    the image is drawn at the autoencoder's size unless ``size`` says otherwise."""
    from PIL import Image

    image = Image.new("RGB", (100, 60), (10, 20, 30))
    plan = plan_image(config, ImageRequest("m", "make it red", images=(image,)))
    assert plan.prompt == "<|im_start|>make it red<|im_end|>" and plan.companions == {}
    assert (plan.width, plan.height) == (112, 64)
    assert [a.shape for a in plan.options.edit.vae] == [(64, 112, 3)]
    assert [a.shape for a in plan.options.edit.vit] == [(28, 56, 3)]
    assert plan.options.guidance == Guidance(cfg_img_scale=2.0, cfg_interval=(0.0, 1.0),
                                             cfg_renorm_type="text_channel")
    sized = plan_image(config, ImageRequest("m", "x", size=(32, 32), images=(image,),
                                            extra={"cfg_img_scale": 1.2}))
    assert (sized.width, sized.height) == (32, 32)
    assert sized.options.guidance.cfg_img_scale == 1.2
    # two images share one largest image's tokens: these two fit, three do not
    two = plan_image(config, ImageRequest("m", "x", images=(image, image.rotate(90, expand=True))))
    assert (two.width, two.height) == (64, 112)  # the last image's size
    for request, field in ((ImageRequest("m", "x", images=(image,) * 3), "image"),
                           (ImageRequest("m", "x", images=(image,), negative_prompt="n"),
                            "negative_prompt"),
                           (ImageRequest("m", "x", images=(image,), extra={"think": True}),
                            "think")):
        with pytest.raises(RequestError) as err:
            plan_image(config, request)
        assert err.value.field == field


def test_an_edit_sends_the_image_and_the_instruction_to_the_dit(config):
    """``bagel_ar2dit`` of an editing request: the AR stage's context (the instruction
    alone) is the image-unconditional branch; the DiT gets the image at both sizes, the
    instruction's ids and the seed's draws (the posterior's first), and builds the other
    two branches itself."""
    from vllm_omni_plugin.models.bagel.dit import edit_noise

    vae = torch.randint(0, 255, (64, 112, 3), dtype=torch.uint8).numpy()
    vit = torch.randint(0, 255, (28, 56, 3), dtype=torch.uint8).numpy()
    options = bp.BagelImageOptions(112, 64, 5, Guidance(num_timesteps=3),
                                   bp.EditInput((vae,), (vit,)))
    k, v = torch.randn(4, 2, 2, 32), torch.randn(4, 2, 2, 32)
    ar = UpstreamOutput(stage_id=0, prompt_token_ids=[1, 2, 3, 4], output_token_ids=[1],
                        payload={"k": k, "v": v})
    out = get_processor("bagel_ar2dit")([ar], None,
                                        StageRequest(config, options={"image": options}))
    p = out.payload
    assert "cond.k" not in p and "text_uncond.k" not in p
    assert p["img_uncond.k"].equal(k.transpose(0, 1)) and int(p["img_uncond.rope"]) == 4
    assert p["edit.text_ids"].tolist() == [1, 2, 3, 4]
    assert p["edit.vae.0"].numpy().tolist() == vae.tolist()
    assert p["edit.vit.0"].shape == (28, 56, 3) and "edit.vae.1" not in p
    (eps,), noise = edit_noise(5, [(64, 112)], 64, 112, config)
    assert p["edit.eps.0"].equal(eps) and p["noise"].equal(noise)


def test_an_image_chat_answer_is_one_image_content_part():
    import base64

    answer = chat_image_response(b"\x89PNG", "png", "m", {"prompt_tokens": 3})
    assert answer["object"] == "chat.completion" and answer["model"] == "m"
    (part,) = answer["choices"][0]["message"]["content"]
    assert part["type"] == "image_url"
    head, data = part["image_url"]["url"].split(",", 1)
    assert head == "data:image/png;base64" and base64.b64decode(data) == b"\x89PNG"
    assert answer["usage"] == {"prompt_tokens": 3}
    # a planning model's text comes first, as a text part
    text, image = chat_image_response(b"\x89PNG", "png", "m", None, "a plan")[
        "choices"][0]["message"]["content"]
    assert text == {"type": "text", "text": "a plan"} and image["type"] == "image_url"


def test_the_planning_step_and_its_usage_are_returned():
    from vllm_omni_plugin.entrypoints.images import _usage, images_response, planning_body
    from vllm_omni_plugin.processors import PlanningStep

    body = planning_body(ImageRequest("m", "a cat"), PlanningStep("p", 7, ("<|im_end|>",)))
    assert body == {"model": "m", "prompt": "p", "max_tokens": 7, "temperature": 0.0,
                    "stop": ["<|im_end|>"], "skip_special_tokens": False,
                    "spaces_between_special_tokens": False}
    assert images_response(b"x", "png", 8, 8, "a plan")["data"][0]["revised_prompt"] \
        == "a plan"
    assert "revised_prompt" not in images_response(b"x", "png", 8, 8)["data"][0]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert _usage({"usage": usage}, {"usage": usage}, {}) == {
        "prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    assert _usage({}) is None


def test_the_plan_wraps_the_prompt_and_checks_size_and_knobs(config):
    plan = plan_image(config, ImageRequest("m", "a cat", size=(64, 32), seed=5, extra={
        "num_inference_steps": 7, "cfg_interval": [0.2, 0.8]}))
    assert plan.prompt == "<|im_start|>a cat<|im_end|>"
    assert (plan.width, plan.height) == (64, 32)
    assert plan.options.seed == 5
    assert plan.options.guidance == Guidance(num_timesteps=7, cfg_interval=(0.2, 0.8))
    # the default size is the checkpoint's largest below 1024 (128 for the tiny one)
    default = plan_image(config, ImageRequest("m", "a cat"))
    assert (default.width, default.height) == (128, 128)
    assert 0 <= default.options.seed <= bp.MAX_SEED
    for request, field in ((ImageRequest("m", "x", size=(48, 40)), "size"),
                           (ImageRequest("m", "x", size=(144, 16)), "size"),
                           (ImageRequest("m", "x", seed=-1), "seed"),
                           (ImageRequest("m", "x", negative_prompt=" "), "negative_prompt"),
                           (ImageRequest("m", "x", extra={"num_inference_steps": 2.5}),
                            "num_inference_steps"),
                           (ImageRequest("m", "x", extra={"num_inference_steps": 1}),
                            "num_inference_steps"),
                           (ImageRequest("m", "x", extra={"cfg_img_scale": True}),
                            "cfg_img_scale")):
        with pytest.raises(RequestError) as err:
            plan_image(config, request)
        assert err.value.field == field


def test_a_negative_prompt_is_a_companion_of_the_ar_stage(config):
    plan = plan_image(config, ImageRequest("m", "a cat", negative_prompt="blurry"))
    assert plan.companions == {bp.NEGATIVE: "<|im_start|>blurry<|im_end|>"}
    assert plan_image(config, ImageRequest("m", "a cat")).companions == {}


def test_thinking_plans_first_then_draws_from_the_plan(config):
    """``think``: the official inferencer's contexts (the module doc of
    ``models/bagel/processors.py``): first a planning step, then the full context with
    the planning, the system prompt's as the text-unconditional companion and the system
    prompt's and prompt's as the image-unconditional one."""
    system = "<|im_start|>" + bp.THINK_SYSTEM_PROMPT + "<|im_end|>"
    prompt = "<|im_start|>a cat<|im_end|>"
    request = ImageRequest("m", "a cat", size=(32, 32), seed=1,
                           extra={"think": True, "max_think_token_n": 9})
    first = plan_image(config, request)
    assert first.planning.prompt == system + prompt + "<|im_start|>"
    assert first.planning.max_tokens == 8  # the official count includes the start token
    assert set(first.planning.stop) == {"<|im_end|>", "<|im_start|>"}
    plan = plan_image(config, dataclasses.replace(request, reasoning="a plan"))
    assert plan.planning is None
    assert plan.prompt == system + prompt + "<|im_start|>a plan<|im_end|>"
    assert plan.companions == {bp.NEGATIVE: system, bp.IMAGE_UNCOND: system + prompt}
    assert plan.options.guidance == Guidance()
    default = plan_image(config, ImageRequest("m", "a cat", extra={"think": True}))
    assert default.planning.max_tokens == bp.DEFAULT_THINK_TOKENS - 1
    assert plan_image(config, ImageRequest("m", "a cat", extra={"think": False})
                      ).planning is None
    for request, field in ((ImageRequest("m", "x", extra={"think": "yes"}), "think"),
                           (ImageRequest("m", "x", extra={"max_think_token_n": 8}),
                            "max_think_token_n"),
                           (ImageRequest("m", "x", extra={"think": True,
                                                          "max_think_token_n": 1}),
                            "max_think_token_n"),
                           (ImageRequest("m", "x", negative_prompt="blurry",
                                         extra={"think": True}), "negative_prompt")):
        with pytest.raises(RequestError) as err:
            plan_image(config, request)
        assert err.value.field == field


def test_another_model_plans_no_images():
    assert plan_image(object(), ImageRequest("m", "x")) is None


def test_ar2dit_builds_the_three_cfg_contexts(config):
    options = bp.BagelImageOptions(32, 16, 9, Guidance(num_timesteps=30))
    tokens, layers, heads, dim = 5, 2, 2, 32
    k = torch.randn(tokens + 1, layers, heads, dim)  # one row more: a generated position
    v = torch.randn(tokens + 1, layers, heads, dim)
    ar = UpstreamOutput(stage_id=0, prompt_token_ids=list(range(tokens)),
                        output_token_ids=[1], payload={"k": k, "v": v})
    out = get_processor("bagel_ar2dit")([ar], None,
                                        StageRequest(config, options={"image": options}))
    # the DiT advances the image by one Euler step an engine step: 29 of them
    assert out.prompt_token_ids == [0]
    assert out.sampling_overrides == {"max_tokens": 29, "ignore_eos": True}
    p = out.payload
    assert p["cond.k"].equal(k[:tokens].transpose(0, 1))
    assert p["img_uncond.v"].equal(v[:tokens].transpose(0, 1))
    assert p["text_uncond.k"].shape == (layers, 0, heads, dim)
    assert [int(p[f"{b}.rope"]) for b in BRANCHES] == [tokens, 0, tokens]
    assert p["size"].tolist() == [16, 32] and p["noise"].shape == (2, 64)
    assert Guidance.from_tensor(p["guidance"]) == options.guidance
    # a negative prompt's context becomes the text-unconditional branch
    nk, nv = torch.randn(3, layers, heads, dim), torch.randn(3, layers, heads, dim)
    negative = UpstreamOutput(stage_id=0, prompt_token_ids=[7, 8, 9], output_token_ids=[1],
                              payload={"k": nk, "v": nv})
    out = get_processor("bagel_ar2dit")([ar], None, StageRequest(
        config, options={"image": options}, companions={bp.NEGATIVE: negative}))
    assert out.payload["text_uncond.k"].equal(nk.transpose(0, 1))
    assert int(out.payload["text_uncond.rope"]) == 3
    assert out.payload["cond.k"].equal(k[:tokens].transpose(0, 1))
    # a thinking request's image-unconditional context is a companion's too
    out = get_processor("bagel_ar2dit")([ar], None, StageRequest(
        config, options={"image": options},
        companions={bp.NEGATIVE: negative, bp.IMAGE_UNCOND: negative}))
    assert out.payload["img_uncond.v"].equal(nv.transpose(0, 1))
    assert int(out.payload["img_uncond.rope"]) == 3
    with pytest.raises(ValueError, match="image request"):
        get_processor("bagel_ar2dit")([ar], None, StageRequest(config))
    with pytest.raises(ValueError, match="keys and values"):
        get_processor("bagel_ar2dit")([UpstreamOutput(0, [1], [1])], None,
                                      StageRequest(config, options={"image": options}))
