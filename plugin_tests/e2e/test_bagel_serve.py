"""End to end: a real ``vllm serve`` of the tiny BAGEL checkpoint with
the built-in pipeline ``bagel`` (vLLM's BAGEL as the AR stage, the plugin's DiT stage),
driven with the official ``openai`` SDK: text to image (``/v1/images/generations``),
image understanding, and bad requests.

The server runs the plugin as a user who installed its wheel does: the checkout's
wheel installed (not editable) into a directory of its own, on ``PYTHONPATH``, the
pipeline named (``--stage-configs-path bagel``), from a directory outside the checkout
(``helpers.installed_wheel``)."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

from plugin_tests.conftest import BAGEL_REFERENCE
from plugin_tests.helpers import http_files, installed_wheel
from plugin_tests.serve_utils import check_stall_recovery, serving

pytestmark = pytest.mark.e2e

#: the server's key, given as vLLM's VLLM_API_KEY (the Qwen3-Omni hardening server takes
#: --api-key)
API_KEY = "sk-omni-bagel"
#: decoded pixels vs the official code (bf16): mean |difference| in uint8 levels
PIXEL_MEAN_TOL = 3.0
#: the server's --omni-stall-timeout (every stage's, over the pipeline's own), seconds:
#: far above their longest step on a 2-core host shared with another server (a stall of
#: the AR stage, the head's engine, would take the server down)
STALL_S = 45


@pytest.fixture(scope="module")
def server(tiny_bagel, tmp_path_factory):
    root = tmp_path_factory.mktemp("bagel_e2e")
    site = installed_wheel(root)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    # a request resubmitted while the DiT restarts waits 3 s for it
    with serving(tiny_bagel, ["--stage-configs-path", "bagel", "--max-model-len", "512",
                              "--dtype", "float32", "--omni-stall-timeout", str(STALL_S),
                              "--omni-replica-wait-timeout", "3"], str(root / "serve.log"),
                 env={**os.environ, "PYTHONPATH": str(site), "VLLM_API_KEY": API_KEY},
                 cwd=str(elsewhere)) as proc:
        proc.api_key = API_KEY
        yield proc


def test_the_server_runs_the_installed_wheel(server):
    """The API server took the plugin, and the pipeline it named, from the wheel's
    files."""
    site = Path(server.log_path).parent / "site"
    assert f"omni mode: pipeline {site}/vllm_omni_plugin/stage_configs/bagel.yaml " \
        "(stages 0 ar, 1 dit)" in server.log()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _image(response):
    from PIL import Image

    data = base64.b64decode(response.data[0].b64_json)
    return Image.open(io.BytesIO(data)), data


def _case(name: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    meta = json.loads((Path(BAGEL_REFERENCE) / "reference.json").read_text())["cases"][name]
    return meta, load_file(str(Path(BAGEL_REFERENCE) / f"{name}.safetensors"))


def _generate(client, server, prompt="A lighthouse at dawn.", size="64x48", **extra):
    return client.images.generate(model=server.model, prompt=prompt, size=size,
                                  extra_body=extra)


def test_text_to_image_is_a_png_of_the_requested_size(client, server):
    response = _generate(client, server, seed=1, num_inference_steps=4)
    image, data = _image(response)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.format == "PNG" and image.size == (64, 48) and image.mode == "RGB"
    assert response.size == "64x48" and response.output_format == "png"


def test_the_image_is_the_official_codes(client, server):
    """The fixture case through the API: the AR stage's context, the processor, the DiT
    and the PNG encoder give the official code's pixels (up to its bf16 rounding)."""
    meta, ref = _case("t2i_cfg_global")
    knobs = dict(meta["knobs"], num_inference_steps=meta["knobs"].pop("num_timesteps"))
    response = _generate(client, server, prompt=meta["prompt"],
                         size=f"{meta['width']}x{meta['height']}", seed=meta["seed"], **knobs)
    pixels = np.asarray(_image(response)[0]).astype(int)
    assert pixels.shape == tuple(ref["pixels"].shape)
    assert np.abs(pixels - ref["pixels"].numpy().astype(int)).mean() < PIXEL_MEAN_TOL


def test_same_seed_same_bytes_cfg_and_seed_matter(client, server):
    first = _image(_generate(client, server, seed=7, num_inference_steps=4))[1]
    again = _image(_generate(client, server, seed=7, num_inference_steps=4))[1]
    no_cfg = _image(_generate(client, server, seed=7, num_inference_steps=4,
                              cfg_text_scale=1.0))[1]
    other = _image(_generate(client, server, seed=8, num_inference_steps=4))[1]
    assert first == again
    assert no_cfg != first and other != first


def test_a_negative_prompt_steers_the_image(client, server):
    """The negative prompt's context (a companion request on the AR stage) replaces the
    empty text-unconditional one: another image than without it, the same twice."""
    plain = _image(_generate(client, server, seed=9, num_inference_steps=4))[1]
    steered = _image(_generate(client, server, seed=9, num_inference_steps=4,
                               negative_prompt="A blurry photo."))[1]
    again = _image(_generate(client, server, seed=9, num_inference_steps=4,
                             negative_prompt="A blurry photo."))[1]
    assert steered == again and steered != plain


def test_thinking_plans_then_draws_the_official_image(client, server):
    """``think``: the AR stage's greedy planning is the official code's
    (``revised_prompt``), and the image drawn from it its pixels (up to bf16 rounding);
    chat answers the planning as a text part before the same image."""
    meta, ref = _case("t2i_think")
    knobs = dict(meta["knobs"], num_inference_steps=meta["knobs"].pop("num_timesteps"))
    extra = dict(knobs, seed=meta["seed"], think=True,
                 max_think_token_n=meta["max_think_token_n"])
    size = f"{meta['width']}x{meta['height']}"
    response = _generate(client, server, prompt=meta["prompt"], size=size, **extra)
    assert response.data[0].revised_prompt == meta["reasoning"]
    image, png = _image(response)
    pixels = np.asarray(image).astype(int)
    assert pixels.shape == tuple(ref["pixels"].shape)
    assert np.abs(pixels - ref["pixels"].numpy().astype(int)).mean() < PIXEL_MEAN_TOL
    chat = client.chat.completions.create(
        model=server.model, modalities=["image"],
        messages=[{"role": "user", "content": meta["prompt"]}],
        extra_body=dict(extra, size=size))
    text, part = chat.choices[0].message.content
    assert text == {"type": "text", "text": meta["reasoning"]}
    assert base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) == png
    # the planning's tokens are counted with the image's prompt
    assert chat.usage.completion_tokens == 1 + len(ref["reasoning_ids"])


def _png(pixels) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.asarray(pixels, dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_an_edit_through_the_sdk_is_the_official_codes(client, server):
    """``client.images.edit`` (multipart): the input image through the autoencoder and
    the ViT, the instruction, the official editing defaults but the steps; the edited
    image has the input's resized size and the official code's pixels (up to its bf16
    rounding). The same edit as a chat gives the same bytes, the image sent as a data:
    URL part or as an http: URL the server fetches (from a real HTTP server here)."""
    meta, ref = _case("edit_text_channel")
    steps = meta["knobs"]["num_timesteps"]
    png = _png(ref["input_image.0"].numpy())
    response = client.images.edit(model=server.model, image=("input.png", png, "image/png"),
                                  prompt=meta["prompt"],
                                  extra_body={"seed": meta["seed"],
                                              "num_inference_steps": steps})
    assert response.size == f"{meta['width']}x{meta['height']}"
    image, edited = _image(response)
    pixels = np.asarray(image).astype(int)
    assert pixels.shape == tuple(ref["pixels"].shape)
    assert np.abs(pixels - ref["pixels"].numpy().astype(int)).mean() < PIXEL_MEAN_TOL
    with http_files({"input.png": png}) as base:
        for image_part in (_image_part(png),
                           {"type": "image_url", "image_url": {"url": f"{base}/input.png"}}):
            chat = client.chat.completions.create(
                model=server.model, modalities=["image"], messages=[{
                    "role": "user", "content": [
                        image_part, {"type": "text", "text": meta["prompt"]}]}],
                extra_body={"seed": meta["seed"], "num_inference_steps": steps})
            (part,) = chat.choices[0].message.content
            assert base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) == edited


def test_two_images_edited_together_are_the_official_codes(server):
    """Two input images (``image[]``, as the SDK sends a list): both enter the context in
    order, and the image is drawn at the last one's size with the official pixels."""
    from PIL import Image

    meta, ref = _case("edit_two_images")
    files = [("image[]", (f"{i}.png", _png(ref[f"input_image.{i}"].numpy()), "image/png"))
             for i in range(2)]
    r = _edit(server, files, {"prompt": meta["prompt"], "seed": str(meta["seed"]),
                              "num_inference_steps": str(meta["knobs"]["num_timesteps"])})
    assert r.status_code == 200, r.text
    assert r.json()["size"] == f"{meta['width']}x{meta['height']}"
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(
        r.json()["data"][0]["b64_json"])))).astype(int)
    assert np.abs(pixels - ref["pixels"].numpy().astype(int)).mean() < PIXEL_MEAN_TOL


def _edit(server, files, data: dict):
    """A multipart edit: ``files`` (a dict or ``(name, file)`` pairs) and the text fields
    ``data`` (and the model)."""
    import requests

    fields = [(k, (None, v)) for k, v in {"model": server.model, **data}.items()]
    files = list(files.items()) if isinstance(files, dict) else list(files)
    return requests.post(f"{server.url}/v1/images/edits", timeout=60,
                         files=[*files, *fields], headers=server.headers)


def test_bad_edits_are_400s_naming_the_field(server):
    """A mask, no image, a file that is no image, an image over the pixel limit, images
    too large together, an unknown knob, thinking while editing, a body that is not
    multipart, a chat's image the server may not read: 400s naming the field; the
    server goes on editing."""
    import requests
    from PIL import Image

    png = _png(np.full((40, 40, 3), 128))
    huge = io.BytesIO()
    Image.new("RGB", (5000, 4000)).save(huge, format="PNG")
    cases = [
        ({"image": ("a.png", png), "mask": ("m.png", png)}, {"prompt": "x"}, "mask"),
        ({}, {"prompt": "x"}, "image"),
        ({"image": ("a.png", b"not an image")}, {"prompt": "x"}, "image"),
        ({"image": ("a.png", huge.getvalue())}, {"prompt": "x"}, "image"),
        ([("image[]", ("a.png", png)), ("image[]", ("b.png", png))], {"prompt": "x"},
         "image"),  # two 64 x 64 images: twice the ViT tokens of the largest image
        ({"image": ("a.png", png)}, {"prompt": "x", "sharpness": "3"}, "sharpness"),
        ({"image": ("a.png", png)}, {"prompt": "x", "think": "true"}, "think"),
        ({"image": ("a.png", png)}, {}, "prompt"),
    ]
    for files, data, field in cases:
        r = _edit(server, files, data)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field, r.text
    r = requests.post(f"{server.url}/v1/images/edits", timeout=60, headers={
        **server.headers, "Content-Type": "multipart/form-data; boundary=xyz"},
        data=b"--xyz\r\nX-Part: no name\r\n\r\nx\r\n--xyz--\r\n")
    assert (r.status_code, r.json()["error"]["param"]) == (400, "body"), r.text
    r = requests.post(f"{server.url}/v1/images/edits", timeout=60, headers=server.headers,
                      json={"model": server.model, "prompt": "x"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "body"), r.text
    # an image chat's image by a file: URL, which this server (no
    # --allowed-local-media-path) does not read, as vLLM's chat parser would not
    r = requests.post(f"{server.url}/v1/chat/completions", timeout=60, headers=server.headers,
                      json={"model": server.model, "modalities": ["image"], "messages": [{
                          "role": "user", "content": [
                              {"type": "text", "text": "x"},
                              {"type": "image_url", "image_url": {"url": "file:///etc/hosts"}}]}]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages[0].content[1]"), r.text
    assert "--allowed-local-media-path" in r.json()["error"]["message"]
    ok = _edit(server, {"image": ("a.png", png)}, {"prompt": "Make it blue.", "seed": "1",
                                                  "num_inference_steps": "2"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["size"] == "64x64"  # 40 px up to the autoencoder's shortest side


@pytest.mark.parametrize("fmt,magic", [("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")])
def test_other_output_formats_decode(client, server, fmt, magic):
    response = client.images.generate(model=server.model, prompt="A boat.", size="32x32",
                                      output_format=fmt, output_compression=80,
                                      extra_body={"seed": 3, "num_inference_steps": 3})
    image, data = _image(response)
    assert data.startswith(magic) and image.size == (32, 32)
    assert response.output_format == fmt


def _image_part(png: bytes) -> dict:
    """A chat content part with ``png`` inline (a base64 ``data:`` URL)."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_understanding_through_the_same_server(client, server):
    """Image in, text out on the AR stage: the answer depends on the image."""
    def first_logprob(color):
        response = client.chat.completions.create(
            model=server.model, max_tokens=3, temperature=0, logprobs=True,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is in the picture?"},
                _image_part(_png(np.full((56, 56, 3), color)))]}])
        assert response.choices[0].message.content
        return response.choices[0].logprobs.content[0].logprob

    red = first_logprob((220, 20, 20))
    assert red == first_logprob((220, 20, 20))
    assert red != first_logprob((20, 20, 220))


@pytest.mark.parametrize("extra,field", [
    ({"size": "60x64"}, "size"),            # not a multiple of 16
    ({"size": "256x256"}, "size"),          # above the checkpoint's largest (128)
    ({"size": "big"}, "size"),
    ({"cfg_text_scale": -1}, "cfg_text_scale"),
    ({"cfg_interval": [0.9, 0.1]}, "cfg_interval"),
    ({"cfg_renorm_type": "sideways"}, "cfg_renorm_type"),
    ({"num_inference_steps": 1}, "num_inference_steps"),
    ({"timestep_shift": 0}, "timestep_shift"),
    ({"guidance": 3}, "guidance"),          # not a BAGEL knob
    ({"n": 2}, "n"),
    ({"response_format": "url"}, "response_format"),
    ({"output_format": "gif"}, "output_format"),
    ({"negative_prompt": "  "}, "negative_prompt"),
    ({"think": "yes"}, "think"),
    ({"think": True, "negative_prompt": "A dog."}, "negative_prompt"),
    ({"max_think_token_n": 8}, "max_think_token_n"),  # without think
])
def test_bad_requests_are_400s_naming_the_field(server, extra, field):
    import requests

    body = {"model": server.model, "prompt": "A cat.", **extra}
    r = requests.post(f"{server.url}/v1/images/generations", json=body, timeout=60,
                      headers=server.headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("path,body", [
    ("/v1/images/generations", {"prompt": "A cat.", "size": "48x32"}),
    ("/v1/images/edits", {"prompt": "A cat."}),
    ("/v1/chat/completions", {"modalities": ["image"], "messages": [
        {"role": "user", "content": "A cat."}]})])
def test_without_the_key_image_requests_get_vllms_401(server, path, body):
    """VLLM_API_KEY guards the image routes as vLLM guards its own: without the key, or
    with another, vLLM's 401 and nothing drawn."""
    import requests

    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        r = requests.post(f"{server.url}{path}", json={"model": server.model, **body},
                          headers=headers, timeout=60)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})


def test_a_stage_failure_names_the_stage_and_the_server_goes_on(client, server):
    """A chat asking for audio reaches the DiT's processor, which refuses a request that
    is not an image request: a 400 naming the stage; the next image request is served."""
    import requests

    r = requests.post(f"{server.url}/v1/chat/completions", timeout=60, headers=server.headers,
                      json={
        "model": server.model, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2, "modalities": ["text", "audio"]})
    assert r.status_code == 400, r.text
    assert "stage 1 (dit)" in r.json()["error"]["message"]
    assert _image(_generate(client, server, seed=5, num_inference_steps=3))[0].size == (64, 48)


def test_chat_asking_for_an_image_answers_an_image_content_part(client, server):
    """``modalities: ["image"]`` on chat: the last user message is drawn; the answer's
    content is one image part (the official SDK parses it), the same bytes as the images
    API gives for the same prompt, size and seed."""
    from PIL import Image

    response = client.chat.completions.create(
        model=server.model, modalities=["image"], messages=[
            {"role": "user", "content": "Draw something."},
            {"role": "assistant", "content": "What?"},
            {"role": "user", "content": [{"type": "text", "text": "A lighthouse at dawn."}]}],
        extra_body={"size": "64x48", "seed": 1, "num_inference_steps": 4})
    (part,) = response.choices[0].message.content
    assert part["type"] == "image_url"
    head, data = part["image_url"]["url"].split(",", 1)
    assert head == "data:image/png;base64"
    png = base64.b64decode(data)
    assert Image.open(io.BytesIO(png)).size == (64, 48)
    assert response.usage.prompt_tokens > 0
    direct = _image(_generate(client, server, prompt="A lighthouse at dawn.", seed=1,
                              num_inference_steps=4))[1]
    assert png == direct


@pytest.mark.parametrize("extra,field", [
    ({"modalities": ["text", "image"]}, "modalities"),
    ({"modalities": ["image"], "stream": True}, "stream"),
    ({"modalities": ["image"], "size": "60x64"}, "size"),
    ({"modalities": ["image"], "tools": []}, "tools"),
])
def test_bad_image_chats_are_400s_naming_the_field(server, extra, field):
    import requests

    r = requests.post(f"{server.url}/v1/chat/completions", timeout=60, headers=server.headers,
                      json={"model": server.model,
                            "messages": [{"role": "user", "content": "A cat."}], **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def _stalls(server) -> float:
    """``vllm_omni:replica_stalls_total`` summed over the replicas of stage 1 (the DiT)."""
    return sum(value for (name, labels), value in server.metrics().items()
               if name == "vllm_omni:replica_stalls_total" and ("stage", "1") in labels)


def test_eight_concurrent_images_under_the_dit_cap_equal_serial_ones(server):
    """Eight image requests at once against the shipped pipeline's DiT cap of four images
    a step (``max_num_seqs: 4``, ``dit.MAX_IMAGES_PER_STEP``; review 2, N4): the head's
    admission bound at the DiT is 4 (``/metrics``), every request is answered 200, no
    replica stalls, and each image, denoised beside others (the DiT batches them), is
    the bytes the same request gives alone. The run's
    wall time and latencies go to ``eight_requests.json`` beside the server log (for
    the record; no timing is asserted)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from vllm_omni_plugin.models.bagel.dit import MAX_IMAGES_PER_STEP

    assert server.metrics()[("vllm_omni:stage_admission_bound",
                             frozenset({("stage", "1")}))] == MAX_IMAGES_PER_STEP == 4
    stalls = _stalls(server)

    def post(i: int) -> tuple[int, bytes, float]:
        start = time.monotonic()
        r = requests.post(f"{server.url}/v1/images/generations", timeout=300,
                          headers=server.headers, json={
            "model": server.model, "prompt": f"A lighthouse, number {i}.", "size": "64x48",
            "seed": 100 + i, "num_inference_steps": 4})
        took = time.monotonic() - start
        data = base64.b64decode(r.json()["data"][0]["b64_json"]) if r.ok else r.content
        return r.status_code, data, took

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(post, range(8)))
    wall = time.monotonic() - start
    alone = [post(i) for i in range(8)]
    figures = {"concurrent_wall_s": round(wall, 2),
               "concurrent_latency_s": [round(t, 2) for _, _, t in together],
               "serial_latency_s": [round(t, 2) for _, _, t in alone]}
    (Path(server.log_path).parent / "eight_requests.json").write_text(json.dumps(figures))
    print(f"eight concurrent image requests: {figures}")
    assert [code for code, _, _ in together] == [200] * 8, together
    assert [code for code, _, _ in alone] == [200] * 8, alone
    for i, ((_, got, _), (_, want, _)) in enumerate(zip(together, alone, strict=True)):
        assert got == want, f"request {i}: the concurrent image differs from the one alone"
    assert len({data for _, data, _ in alone}) == 8  # eight seeds, eight images
    assert _stalls(server) == stalls


def test_a_stalled_dit_is_restarted_and_its_request_answered(server):
    """SIGSTOP of the DiT's EngineCore with an image request in it: see
    :func:`check_stall_recovery` (``--omni-stall-timeout``). The module's last test (it
    restarts the DiT)."""
    import requests

    def image():
        return requests.post(f"{server.url}/v1/images/generations", timeout=300,
                             headers=server.headers, json={
            "model": server.model, "prompt": "A red boat.", "size": "48x32", "seed": 3,
            "num_inference_steps": 4})

    answer = check_stall_recovery(server, 1, "dit", STALL_S, image)
    assert answer.status_code == 503
