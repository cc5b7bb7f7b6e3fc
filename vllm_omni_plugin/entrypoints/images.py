"""OpenAI's image generation, ``POST /v1/images/generations``, on the omni pipeline.

The API checks OpenAI's fields here; the served model's plugin (the
``omni_plan_image`` hook) checks the size and its own knobs and says what the entry
stage is prompted with. That prompt then runs as a completion (``max_tokens=1``) whose
downstream stages draw the image; the answer is OpenAI's ``ImagesResponse``:
``{"created", "data": [{"b64_json"}], "output_format", "size"}``. A failure answers
with the pipeline's error (HTTP 400/429/500/503 naming the stage), as chat does.

Fields: ``model``, ``prompt`` (at most :data:`MAX_PROMPT_CHARS` characters), ``n``
(1), ``size`` (``"WxH"`` or ``"auto"``), ``response_format`` (``b64_json``),
``output_format`` (:data:`IMAGE_FORMATS`, default ``png``), ``output_compression``
(0-100, for ``jpeg`` and ``webp``), ``user`` (ignored), ``seed``, ``negative_prompt``;
any other field goes to the model, which refuses what it does not know.
"""

from __future__ import annotations

import base64
import io
import time

from vllm_omni_plugin.entrypoints.media_input import required_text
from vllm_omni_plugin.processors.hookspecs import ImageRequest, RequestError

IMAGES_PATH = "/v1/images/generations"
MAX_PROMPT_CHARS = 32000
#: ``output_format`` -> Pillow's format name
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
#: OpenAI fields this server does not serve (refused by name, not passed to the model)
UNSUPPORTED = ("quality", "style", "background", "moderation", "stream", "partial_images",
               "input_fidelity")
_OWN = ("model", "prompt", "n", "size", "response_format", "output_format",
        "output_compression", "user", "seed", "negative_prompt")


def parse_image_request(body: dict) -> tuple[ImageRequest, str, int | None]:
    """Validate a ``/v1/images/generations`` body.

    Returns:
        The request, its ``output_format`` and ``output_compression`` (None: Pillow's
        default).

    Raises:
        RequestError: naming the offending field.
    """
    model = required_text(body, "model", "the served model's name")
    prompt = required_text(body, "prompt", "what to draw", MAX_PROMPT_CHARS)
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise RequestError("n", "only 1 image per request is served")
    if body.get("response_format", "b64_json") != "b64_json":
        raise RequestError("response_format", "only b64_json is served (no image URLs)")
    fmt = body.get("output_format", "png")
    if fmt not in IMAGE_FORMATS:
        raise RequestError("output_format", f"use one of {', '.join(IMAGE_FORMATS)}")
    compression = body.get("output_compression")
    if compression is not None and (
            isinstance(compression, bool) or not isinstance(compression, int)
            or not 0 <= compression <= 100 or fmt == "png"):
        raise RequestError("output_compression", "must be an integer in [0, 100], for "
                           "jpeg or webp")
    for name in UNSUPPORTED:
        if name in body:
            raise RequestError(name, "is not supported by this server")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError("seed", "must be an integer")
    negative = body.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise RequestError("negative_prompt", "must be a string")
    extra = {k: v for k, v in body.items() if k not in _OWN}
    return ImageRequest(model=model, prompt=prompt, size=_size(body.get("size", "auto")),
                        seed=seed, negative_prompt=negative, extra=extra), fmt, compression


def _size(value) -> tuple[int, int] | None:
    if value == "auto":
        return None
    width, sep, height = value.partition("x") if isinstance(value, str) else ("", "", "")
    if not sep or not width.isdigit() or not height.isdigit():
        raise RequestError("size", f"{str(value)[:40]!r} is not \"WIDTHxHEIGHT\" or \"auto\"")
    return int(width), int(height)


def completion_body(request: ImageRequest, prompt: str) -> dict:
    """The completion request that runs the pipeline for one image: the entry stage
    prefills ``prompt`` (the model's plan) and generates one token no one reads."""
    return {"model": request.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}


def encode_image(pixels, fmt: str, compression: int | None) -> bytes:
    """``[H, W, 3]`` uint8 (a tensor or array) -> the bytes of an ``fmt`` image."""
    from PIL import Image

    array = pixels.numpy() if hasattr(pixels, "numpy") else pixels
    out = io.BytesIO()
    kwargs = {} if compression is None else {"quality": compression}
    Image.fromarray(array).save(out, format=IMAGE_FORMATS[fmt], **kwargs)
    return out.getvalue()


def images_response(encoded: bytes, fmt: str, width: int, height: int) -> dict:
    """OpenAI's ``ImagesResponse`` for one image."""
    return {"created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(encoded).decode("ascii")}],
            "output_format": fmt, "size": f"{width}x{height}"}
