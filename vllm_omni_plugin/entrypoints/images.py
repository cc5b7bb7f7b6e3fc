"""OpenAI's image generation and editing, ``POST /v1/images/generations`` and ``POST
/v1/images/edits``, on the omni pipeline.

The API checks OpenAI's fields here; the served model's plugin (the
``omni_plan_image`` hook) checks the size and its own knobs and says what the entry
stage is prompted with. That prompt then runs as a completion (``max_tokens=1``) whose
downstream stages draw the image; the answer is OpenAI's ``ImagesResponse``:
``{"created", "data": [{"b64_json"}], "output_format", "size"}``. A failure answers
with the pipeline's error (HTTP 400/429/500/503 naming the stage), as chat does. A
model that plans before drawing (BAGEL's ``think``; the plan's
:class:`~vllm_omni_plugin.processors.hookspecs.PlanningStep`) first writes its plan as a
completion of its own; the image is drawn from it, and ``data[0].revised_prompt``
returns it.

Fields: ``model``, ``prompt`` (at most :data:`MAX_PROMPT_CHARS` characters), ``n``
(1), ``size`` (``"WxH"`` or ``"auto"``), ``response_format`` (``b64_json``),
``output_format`` (:data:`IMAGE_FORMATS`, default ``png``), ``output_compression``
(0-100, for ``jpeg`` and ``webp``), ``user`` (ignored), ``seed``, ``negative_prompt``;
any other field goes to the model, which refuses what it does not know.

Chat completions with ``"modalities": ["image"]`` draw the same way
(:func:`chat_image_body`): the last user message's text is the prompt, the image fields
above and the model's knobs may stand in the chat body, and the answer is a
``chat.completion`` whose ``choices[0].message.content`` is one image content part,
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
(:func:`chat_image_response`), after a text part with the plan when the model planned.

Editing (:func:`parse_edit_form`) takes OpenAI's multipart body: ``image`` (one file or
several, ``image[]``), the fields above as text (numbers, booleans and lists read back
from it) and the model's knobs; a ``mask`` is refused. The images, decoded within
:data:`MAX_INPUT_IMAGE_BYTES` and :data:`MAX_INPUT_IMAGE_PIXELS`, reach the model's plan
as :attr:`~vllm_omni_plugin.processors.hookspecs.ImageRequest.images`; so do the images
of an image chat's last user message (:func:`fetch_images`: ``data:``, ``http(s):`` and
``file:`` URLs, read as vLLM reads a chat's media).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import time
import uuid

from vllm_omni_plugin.engine.omni_request import IMAGE, OmniRequest
from vllm_omni_plugin.entrypoints.asgi import (
    captured,
    error_body,
    hf_config,
    send_json,
    sent_failure,
)
from vllm_omni_plugin.entrypoints.chat_audio import COMPLETIONS_PATH
from vllm_omni_plugin.entrypoints.media_input import is_choice, required_text
from vllm_omni_plugin.processors import plan_image
from vllm_omni_plugin.processors.hookspecs import ImageRequest, PlanningStep, RequestError

IMAGES_PATH = "/v1/images/generations"
EDITS_PATH = "/v1/images/edits"
MAX_PROMPT_CHARS = 32000
#: an input image's bytes at most (OpenAI's limit for an edit's image)
MAX_INPUT_IMAGE_BYTES = 50 * 1024 * 1024
#: an input image's pixels at most (a 4096 x 4096 image; the model resizes it to at
#: most 1024 on its long side): a larger one is refused before it is decoded
MAX_INPUT_IMAGE_PIXELS = 4096 * 4096
#: input images and form fields an edit's multipart body may hold at most
MAX_EDIT_FILES, MAX_EDIT_FIELDS = 16, 64
#: multipart fields of an edit kept as text (the others are read as JSON values when
#: they parse as one: numbers, booleans, lists)
_TEXT_FIELDS = ("model", "prompt", "size", "response_format", "output_format", "user",
                "negative_prompt", "cfg_renorm_type")
#: ``output_format`` -> Pillow's format name
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
#: chat fields of text sampling an image chat accepts and does not use
CHAT_IGNORED = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "stream")
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
    if not is_choice(fmt, IMAGE_FORMATS):
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


def decode_input_image(data: bytes, field: str):
    """An input image's bytes -> an RGB Pillow image; transparency over white (vLLM's
    ``convert_image_mode``, as the official BAGEL code's ``pil_img2rgb`` does).

    Raises:
        RequestError: naming ``field``: more than :data:`MAX_INPUT_IMAGE_BYTES` bytes or
            :data:`MAX_INPUT_IMAGE_PIXELS` pixels (read from the header, before
            decoding), or not an image Pillow decodes.
    """
    from PIL import Image
    from vllm.multimodal.image import convert_image_mode

    if len(data) > MAX_INPUT_IMAGE_BYTES:
        raise RequestError(field, f"is {len(data)} bytes; at most {MAX_INPUT_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_INPUT_IMAGE_PIXELS:
            raise RequestError(field, f"is {width}x{height} pixels; at most "
                               f"{MAX_INPUT_IMAGE_PIXELS} pixels")
        return convert_image_mode(image, "RGB")
    except RequestError:
        raise
    except Exception as exc:  # Pillow's own error types
        raise RequestError(field, f"is not an image this server decodes ({exc})") from None


def _form_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


async def parse_edit_form(scope, raw: bytes) -> tuple[dict, list]:
    """A ``POST /v1/images/edits`` multipart body, as the ``openai`` SDK's
    ``images.edit`` sends it: the fields as an image request's body (numbers, booleans
    and ``name[]`` lists read back from their text) and the ``image`` (or ``image[]``)
    files' bytes, in order.

    Raises:
        RequestError: naming ``body`` (not ``multipart/form-data``, or a body that does
            not parse), ``mask`` (BAGEL edits without one), ``image`` (none, or not a
            file), or a field sent as a file.
    """
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    kind = dict(scope.get("headers", ())).get(b"content-type", b"").decode("latin-1")
    if not kind.lower().startswith("multipart/form-data"):
        raise RequestError("body", "send the edit as multipart/form-data (as the openai "
                           "SDK's images.edit does)")
    try:
        form = await Request(scope, receive).form(max_files=MAX_EDIT_FILES,
                                                  max_fields=MAX_EDIT_FIELDS)
    except Exception as exc:  # python-multipart's and Starlette's own error types
        raise RequestError("body", f"not a multipart/form-data body this server reads "
                           f"({exc})") from None
    body: dict = {}
    images: list[bytes] = []
    try:
        for key, value in form.multi_items():
            name = key[:-2] if key.endswith("[]") else key
            if name == "mask":
                raise RequestError("mask", "is not served: the model edits the whole "
                                   "image from the prompt (leave it out)")
            if name == "image":
                if isinstance(value, str):
                    raise RequestError("image", "must be a file")
                images.append(await value.read())
                continue
            if not isinstance(value, str):
                raise RequestError(name, "must be a text field, not a file")
            parsed = value if name in _TEXT_FIELDS else _form_value(value)
            if key.endswith("[]"):
                body.setdefault(name, []).append(parsed)
            else:
                body[name] = parsed
    finally:
        await form.close()
    if not images:
        raise RequestError("image", "an input image to edit is required")
    return body, images


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


def images_response(encoded: bytes, fmt: str, width: int, height: int,
                    revised_prompt: str | None = None) -> dict:
    """OpenAI's ``ImagesResponse`` for one image (``data[0].revised_prompt``: the
    model's planning text, when it planned)."""
    image = {"b64_json": base64.b64encode(encoded).decode("ascii")}
    if revised_prompt is not None:
        image["revised_prompt"] = revised_prompt
    return {"created": int(time.time()), "data": [image], "output_format": fmt,
            "size": f"{width}x{height}"}


def chat_image_body(body: dict) -> tuple[dict, list[tuple[str, str]]]:
    """The ``/v1/images/generations`` body of a chat completion asking for
    ``"modalities": ["image"]``: ``model``, the last user message's text as ``prompt``
    (text parts joined by newlines; earlier turns are not part of the image's context),
    and every other field but ``messages``, ``modalities`` and :data:`CHAT_IGNORED`;
    and that message's images to edit (``image_url`` parts), as ``(field, url)``, for
    :func:`fetch_images`.

    Raises:
        RequestError: naming ``modalities`` (image with other modalities), ``stream``
            (true), ``messages`` (no user message, or no text in it, or too long) or
            ``messages[i].content[j]`` (a part other than text or an image, or an
            ``image_url`` without a URL string).
    """
    if body.get("modalities") != ["image"]:
        raise RequestError("modalities", "image output is answered on its own: use "
                           "[\"image\"]")
    if body.get("stream"):
        raise RequestError("stream", "image output is not streamed")
    messages = body.get("messages")
    users = [i for i, m in enumerate(messages) if isinstance(m, dict)
             and m.get("role") == "user"] if isinstance(messages, list) else []
    if not users:
        raise RequestError("messages", "needs a user message saying what to draw")
    index = users[-1]
    content = messages[index].get("content")
    images: list[tuple[str, str]] = []
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{index}].content[{j}]"
            if isinstance(part, dict) and part.get("type") == "image_url":
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else None
                if not isinstance(url, str):
                    raise RequestError(where, "an image_url part needs image_url.url, a "
                                       "URL string")
                images.append((where, url))
                continue
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise RequestError(where, "image output takes text parts and images to "
                                   "edit (image_url parts) only")
            texts.append(part["text"])
    else:
        texts = []
    prompt = "\n".join(texts)
    if not prompt.strip():
        raise RequestError("messages", "the last user message has no text saying what "
                           "to draw")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestError("messages", f"the last user message is {len(prompt)} characters "
                           f"long; at most {MAX_PROMPT_CHARS}")
    rest = {k: v for k, v in body.items()
            if k not in ("messages", "modalities", "model", *CHAT_IGNORED)}
    return {"model": body.get("model"), "prompt": prompt, **rest}, images


class _EncodedImage:
    """The media IO an image to edit is read through by vLLM's media connector
    (:func:`fetch_images`): the image file's bytes as they came, at most
    :data:`MAX_INPUT_IMAGE_BYTES`, which :func:`decode_input_image` then decodes with
    the pixel limit checked first."""

    def get_max_bytes(self) -> int:
        return MAX_INPUT_IMAGE_BYTES

    def load_bytes(self, data: bytes) -> bytes:
        return bytes(data)

    def load_base64(self, media_type: str, data: str) -> bytes:
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:
            raise ValueError("the data: URL's base64 does not decode") from None

    def load_file(self, filepath) -> bytes:
        size = filepath.stat().st_size
        if size > MAX_INPUT_IMAGE_BYTES:
            raise ValueError(f"the file is {size} bytes; at most {MAX_INPUT_IMAGE_BYTES}")
        return filepath.read_bytes()


async def fetch_images(model_config, parts: list[tuple[str, str]]) -> list[tuple[str, bytes]]:
    """The bytes of an image chat's images to edit (:func:`chat_image_body`'s
    ``(field, url)``), read as vLLM's chat parser reads media, with the served model's
    flags (``model_config``, a ``ModelConfig`` or None; the connector of
    :func:`~vllm_omni_plugin.compat.internals.media_connector`): a base64 ``data:``
    URL; an ``http(s):`` URL of a domain ``--allowed-media-domains`` allows (any when
    unset), fetched within ``VLLM_IMAGE_FETCH_TIMEOUT`` seconds; a ``file:`` URL under
    ``--allowed-local-media-path``. Each at most :data:`MAX_INPUT_IMAGE_BYTES`.

    Raises:
        RequestError: naming the part whose image could not be read, with vLLM's reason
            (a domain or path not allowed, an HTTP error, too many bytes, ...).
    """
    import vllm.envs as envs

    from vllm_omni_plugin.compat.internals import media_connector

    if not parts:
        return []
    connector = media_connector(model_config)
    images = []
    for where, url in parts:
        try:
            data = await connector.load_from_url_async(
                url, _EncodedImage(), fetch_timeout=envs.VLLM_IMAGE_FETCH_TIMEOUT)
        except Exception as exc:  # vLLM's, aiohttp's and the IO's errors alike
            reason = str(exc) or type(exc).__name__
            raise RequestError(where, f"the image to edit could not be read: {reason}"
                               ) from None
        images.append((where, data))
    return images


def chat_image_response(encoded: bytes, fmt: str, model: str, usage: dict | None,
                        reasoning: str | None = None) -> dict:
    """OpenAI's ``chat.completion`` answering one image: ``choices[0].message.content`` is
    ``[{"type": "image_url", "image_url": {"url": "data:<media type>;base64,..."}}]``,
    after ``{"type": "text", "text": reasoning}`` when the model planned; ``usage`` as
    the AR stage's completions counted them."""
    # each output format's media type is image/<format> (IANA's media type registry)
    url = f"data:image/{fmt};base64,{base64.b64encode(encoded).decode('ascii')}"
    content = [{"type": "image_url", "image_url": {"url": url}}]
    if reasoning is not None:
        content.insert(0, {"type": "text", "text": reasoning})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None, "message": {
                "role": "assistant", "content": content}}],
            "usage": usage}


def plan_image_request(scope, body: dict, field: str = "model",
                       images: list[tuple[str, bytes]] = ()):
    """Validate an image request and plan it with the served model's plugin; with
    ``images`` (``(field, bytes)`` each) an editing request of those images. Decodes and
    resizes images: run it off the event loop.

    Returns:
        ``(ImageRequest, ImagePlan, output_format, output_compression)``.

    Raises:
        RequestError: naming the field; ``field`` when the served model draws no
            images.
    """
    request, fmt, compression = parse_image_request(body)
    if images:
        request = dataclasses.replace(request, images=tuple(
            decode_input_image(data, name) for name, data in images))
    config = hf_config(scope)
    plan = None if config is None else plan_image(config, request)
    if plan is None:
        raise RequestError(field, "the served model does not generate images")
    return request, plan, fmt, compression


def planning_body(request: ImageRequest, planning: PlanningStep) -> dict:
    """The completion request that writes a plan's :class:`PlanningStep`: greedy, the
    model's special tokens kept in the text (the step's stop strings may be some) and
    joined without spaces, as the tokenizer decodes them."""
    return {"model": request.model, "prompt": planning.prompt,
            "max_tokens": planning.max_tokens, "temperature": 0.0,
            "stop": list(planning.stop), "skip_special_tokens": False,
            "spaces_between_special_tokens": False}


def _usage(*answers: dict) -> dict | None:
    """The completions' usage summed (None when none counted any)."""
    usages = [a.get("usage") for a in answers if a.get("usage")]
    if not usages:
        return None
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {k: sum(int(u.get(k) or 0) for u in usages) for k in keys}


async def serve_image(app, scope, receive, send, request, plan, fmt: str,
                      compression: int | None, chat: bool = False) -> None:
    """``POST /v1/images/generations``, or a chat completion asking for an image
    (``chat``): the completion of :func:`completion_body`, whose downstream stages
    draw the image, answered as OpenAI's ``ImagesResponse`` or as a
    ``chat.completion`` with an image content part (see the module docstring). A plan
    with a :class:`PlanningStep` first runs :func:`planning_body`'s completion and is
    planned again with its text, which the answer returns (``revised_prompt``, or a
    text content part before the image)."""
    # a JSON completion (an edit came as multipart; its length is the body's own)
    headers = [(k, v) for k, v in scope.get("headers", ())
               if k.lower() not in (b"content-type", b"content-length")]
    completions = {**scope, "path": COMPLETIONS_PATH, "raw_path": COMPLETIONS_PATH.encode(),
                   "headers": [*headers, (b"content-type", b"application/json")]}
    answers = []
    if plan.planning is not None:
        planning = OmniRequest()
        answer = await captured(app, completions, receive,
                                json.dumps(planning_body(request, plan.planning)).encode(),
                                planning)
        if await sent_failure(send, answer, planning):
            return
        answers.append(json.loads(answer.body))
        request = dataclasses.replace(request, reasoning=answers[0]["choices"][0]["text"])
        plan = plan_image(hf_config(scope), request)
    omni = OmniRequest(modalities=(IMAGE,), options={"image": plan.options},
                       companions=dict(plan.companions))
    answer = await captured(
        app, completions, receive,
        json.dumps(completion_body(request, plan.prompt)).encode(), omni)
    if await sent_failure(send, answer, omni):
        return
    result = omni.result
    if result is None or "image" not in result.payload:
        return await send_json(send, 500, error_body(
            "the pipeline's final stage produced no image", 500))
    answers.append(json.loads(answer.body))
    encoded = await asyncio.to_thread(encode_image, result.payload["image"], fmt,
                                      compression)
    response = chat_image_response(encoded, fmt, request.model, _usage(*answers),
                                   request.reasoning) if chat \
        else images_response(encoded, fmt, plan.width, plan.height, request.reasoning)
    await send_json(send, 200, json.dumps(response).encode())
