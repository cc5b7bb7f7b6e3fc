"""BAGEL's hook implementations: how an image request is served (``omni_plan_image``)
and the AR -> DiT stage input processor (``bagel_ar2dit``).

Text to image, as the official inferencer (``InterleaveInferencer.interleave_inference``
with a text input) builds it: the AR stage prefills ``<|im_start|> prompt <|im_end|>``
(one token, ``max_tokens=1``); the DiT gets three CFG contexts: the full one, the
text-unconditional one (empty: RoPE position 0, no keys) and the image-unconditional one
(the full one again: there is no input image to leave out). With a ``negative_prompt``
the text-unconditional context is that prompt's, ``<|im_start|> negative <|im_end|>``,
prefilled by the AR stage as the request's companion :data:`NEGATIVE` (upstream
vllm-omni's meaning; the official code has no negative prompt for text to image).

With ``think`` (the official ``think=True``), the AR stage first plans: it completes
``<|im_start|> THINK_SYSTEM_PROMPT <|im_end|> <|im_start|> prompt <|im_end|>
<|im_start|>`` greedily, up to ``max_think_token_n - 1`` tokens (the official count
includes the start token it feeds), the text ending before ``<|im_end|>`` or another
``<|im_start|>`` (the official ``gen_text`` keeps what lies between them). The image is
then drawn from the full context, that prompt with ``<|im_start|> planning <|im_end|>``
after it; the text-unconditional context is the system prompt's (companion
:data:`NEGATIVE`), the image-unconditional one the system prompt's and the prompt's
(companion :data:`IMAGE_UNCOND`), as the official ``interleave_inference`` builds them.

Editing (input images, the official app's "Image Edit") prompts the AR stage with the
instruction alone, ``<|im_start|> instruction <|im_end|>``: that is the
image-unconditional context. The images, resized as the official transforms
(:mod:`~vllm_omni_plugin.models.bagel.editing`), go to the DiT, which builds the
text-unconditional context (the images through the autoencoder and the ViT) and the full
one (the images, then the instruction) itself (vLLM's AR stage attends causally; the
official image blocks attend all to all at one RoPE position). The defaults are the
official app's for editing (:data:`EDIT_GUIDANCE`); the image is drawn at the last input
image's resized size.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_plugin.models.bagel.dit import (
    Guidance,
    check_image_size,
    edit_noise,
    generation_payload,
    initial_noise,
    max_image_side,
)
from vllm_omni_plugin.models.bagel.editing import check_edit_images, edit_images
from vllm_omni_plugin.processors.hookspecs import (
    ImagePlan,
    ImageRequest,
    PlanningStep,
    RequestError,
    StageInput,
    StageRequest,
    UpstreamOutput,
    hookimpl,
)

#: the request field -> the ``Guidance`` field it sets (the official names, except
#: ``num_inference_steps``: the official ``num_timesteps``, points from 1 to 0, so 50
#: makes 49 Euler steps)
KNOBS = {"cfg_text_scale": "cfg_text_scale", "cfg_img_scale": "cfg_img_scale",
         "cfg_interval": "cfg_interval", "cfg_renorm_type": "cfg_renorm_type",
         "cfg_renorm_min": "cfg_renorm_min", "timestep_shift": "timestep_shift",
         "num_inference_steps": "num_timesteps"}
#: the official app's default image side, capped by the checkpoint's largest
DEFAULT_SIDE = 1024
#: the largest seed (the generator takes 64 bits; JSON clients keep 53 exactly)
MAX_SEED = 2 ** 53 - 1
#: the companion request holding the text-unconditional context (a negative prompt's,
#: or with ``think`` the system prompt's)
NEGATIVE = "cfg_text"
#: the companion request holding the image-unconditional context when it is not the full
#: one (with ``think``: the system prompt's and the prompt's, without the planning)
IMAGE_UNCOND = "cfg_img"
#: the official inferencer's system prompt for planning before drawing
#: (``GEN_THINK_SYSTEM_PROMPT``; its first line ends with a space)
THINK_SYSTEM_PROMPT = (
    "You should first think about the planning process in the mind and then generate "
    "the image. \nThe planning process is enclosed within <think> </think> tags, i.e. "
    "<think> planning process here </think> image here")
#: the official app's default ``max_think_token_n`` (the start token and the planning)
DEFAULT_THINK_TOKENS = 1024
#: the request fields about planning, not :class:`Guidance`'s
THINK_FIELDS = ("think", "max_think_token_n")


def ar_prompt(text: str) -> str:
    """The AR stage's prompt for one piece of text, as the official ``prepare_prompts``
    wraps it."""
    return f"<|im_start|>{text}<|im_end|>"


#: the official app's editing defaults (``edit_image`` in its ``app.py``) where they
#: differ from text to image's (:class:`Guidance`)
EDIT_GUIDANCE = {"cfg_img_scale": 2.0, "cfg_interval": (0.0, 1.0),
                 "cfg_renorm_type": "text_channel"}


@dataclass(frozen=True)
class EditInput:
    """An editing request's input images in order, each resized for the autoencoder
    (``vae``: ``[H, W, 3]`` uint8 arrays) and for the ViT (``vit``: ``[h, w, 3]``)."""

    vae: tuple[Any, ...]
    vit: tuple[Any, ...]


@dataclass(frozen=True)
class BagelImageOptions:
    """What ``bagel_ar2dit`` needs from the request (``StageRequest.options["image"]``):
    the image's size and seed, its guidance, and for an editing request its input."""

    width: int
    height: int
    seed: int
    guidance: Guidance
    edit: EditInput | None = None


def is_bagel(hf_config) -> bool:
    """Whether the served checkpoint's HF config is vLLM's ``BagelConfig`` (by class
    name)."""
    return type(hf_config).__name__ == "BagelConfig"


def _guidance(extra: dict[str, Any], defaults: dict[str, Any]) -> Guidance:
    values = dict(defaults)
    for name, value in extra.items():
        if name in THINK_FIELDS:
            continue
        if name not in KNOBS:
            raise RequestError(name, "unknown field; BAGEL's knobs are "
                               f"{', '.join((*KNOBS, *THINK_FIELDS))}")
        if name == "cfg_renorm_type":
            if not isinstance(value, str):
                raise RequestError(name, "must be a string")
        elif name == "cfg_interval":
            if not (isinstance(value, list) and len(value) == 2 and all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
                raise RequestError(name, "must be [lo, hi], two numbers")
            value = (float(value[0]), float(value[1]))
        elif name == "num_inference_steps":
            if isinstance(value, bool) or not isinstance(value, int):
                raise RequestError(name, "must be an integer")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(name, "must be a number")
        values[KNOBS[name]] = value
    try:
        return Guidance(**values)
    except RequestError as exc:
        api = {v: k for k, v in KNOBS.items()}[exc.field]
        raise RequestError(api, exc.message) from None


def _think_tokens(extra: dict[str, Any]) -> int | None:
    """The request's ``max_think_token_n`` when it asks to ``think``, else None.

    Raises:
        RequestError: ``think`` is not a boolean, or ``max_think_token_n`` not an
            integer >= 2 or given without ``think``.
    """
    think = extra.get("think", False)
    if not isinstance(think, bool):
        raise RequestError("think", "must be true or false")
    tokens = extra.get("max_think_token_n")
    if tokens is None:
        return DEFAULT_THINK_TOKENS if think else None
    if not think:
        raise RequestError("max_think_token_n", "applies only with think: true")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
        raise RequestError("max_think_token_n", "must be an integer >= 2 (the start token "
                           "and at least one planning token)")
    return tokens


def _edit_input(hf_config, request: ImageRequest) -> EditInput | None:
    """The request's input images at the autoencoder's and the ViT's sizes, or None.

    Raises:
        RequestError: images whose context outgrows one of the largest image's (field
            ``image``: :func:`~vllm_omni_plugin.models.bagel.editing.check_edit_images`).
    """
    if not request.images:
        return None
    vae, vit = zip(*(edit_images(image, hf_config) for image in request.images),
                   strict=True)
    check_edit_images(hf_config, [a.shape[:2] for a in vae], [a.shape[:2] for a in vit])
    return EditInput(vae, vit)


def plan_bagel_image(hf_config, request: ImageRequest) -> ImagePlan:
    """The AR prompt and the DiT's options of a text-to-image or editing request; with
    ``think`` and no :attr:`~ImageRequest.reasoning` yet, the planning step (see the
    module doc).

    Raises:
        RequestError: a size that is not a multiple of the latent token (16 px) or is
            above the checkpoint's largest, a bad knob, an unknown field, a seed out of
            range, a blank negative prompt or one with ``think`` or input images, input
            images larger together than the largest one (``image``), ``think`` with input
            images.
    """
    edit = _edit_input(hf_config, request)
    # an edit is drawn at its last input image's size, as the official code draws it
    default = (min(DEFAULT_SIDE, max_image_side(hf_config)),) * 2 if edit is None \
        else (edit.vae[-1].shape[1], edit.vae[-1].shape[0])
    width, height = request.size or default
    check_image_size(hf_config, width, height)
    think_tokens = _think_tokens(request.extra)
    if edit is not None and think_tokens is not None:
        raise RequestError("think", "is not served with an input image (editing) yet")
    companions = {}
    if request.negative_prompt is not None:
        if not request.negative_prompt.strip():
            raise RequestError("negative_prompt", "must not be blank (or left out)")
        if think_tokens is not None or edit is not None:
            raise RequestError("negative_prompt", "is not used with think: true or when "
                               "editing (the text-unconditional context is the system "
                               "prompt, or the input image)")
        companions[NEGATIVE] = ar_prompt(request.negative_prompt)
    seed = secrets.randbelow(MAX_SEED + 1) if request.seed is None else request.seed
    if not 0 <= seed <= MAX_SEED:
        raise RequestError("seed", f"must be in [0, {MAX_SEED}]")
    options = BagelImageOptions(width, height, seed, _guidance(
        request.extra, {} if edit is None else EDIT_GUIDANCE), edit)
    prompt = ar_prompt(request.prompt)
    if think_tokens is not None:
        system = ar_prompt(THINK_SYSTEM_PROMPT)
        if request.reasoning is None:
            return ImagePlan(prompt=system + prompt, width=width, height=height,
                             planning=PlanningStep(
                                 prompt=system + prompt + "<|im_start|>",
                                 max_tokens=think_tokens - 1,
                                 stop=("<|im_end|>", "<|im_start|>")))
        companions = {NEGATIVE: system, IMAGE_UNCOND: system + prompt}
        prompt = system + prompt + ar_prompt(request.reasoning)
    return ImagePlan(prompt=prompt, width=width, height=height, options=options,
                     companions=companions)


def _context(output: UpstreamOutput):
    """``(k, v, rope)`` of an AR output: its prompt's keys and values ``[layers, tokens,
    kv_heads, head_dim]`` and the next RoPE position.

    Raises:
        ValueError: the output has no keys and values for its whole prompt.
    """
    if "k" not in output.payload or "v" not in output.payload:
        raise ValueError(f"stage {output.stage_id} published no keys and values (is it "
                         "OmniPluginBagelAR?)")
    length = len(output.prompt_token_ids)
    k = output.payload["k"].transpose(0, 1)
    v = output.payload["v"].transpose(0, 1)
    if k.shape[1] < length:
        raise ValueError(f"stage {output.stage_id} published {k.shape[1]} positions of a "
                         f"{length}-token prompt")
    return k[:, :length], v[:, :length], length


def bagel_ar2dit(upstream: list[UpstreamOutput], stage, request: StageRequest) -> StageInput:
    """AR context -> DiT request: the CFG branches' contexts from the AR stage's
    ``k``/``v`` rows ``[tokens, layers, kv_heads, head_dim]`` (the request's, and its
    negative prompt companion's if any; see the module doc), the seed's noise and the
    guidance; a one-token placeholder prompt and ``max_tokens`` the image's Euler steps
    (``num_timesteps - 1``: the DiT advances an image by one a step), ``ignore_eos``.

    Raises:
        ValueError: the request has no image options (not an image request), or the AR
            stage published no keys and values.
    """
    options = request.options.get("image")
    if not isinstance(options, BagelImageOptions):
        raise ValueError("not an image request (POST /v1/images/generations)")
    (ar,) = upstream
    k, v, length = _context(ar)
    negative = request.companions.get(NEGATIVE)
    if negative is not None:
        text_uncond = _context(negative)
    else:
        text_uncond = (k[:, :0], v[:, :0], 0)
    image_uncond = request.companions.get(IMAGE_UNCOND)
    img_uncond = (k, v, length) if image_uncond is None else _context(image_uncond)
    hf_config = request.hf_config
    edit = options.edit
    if edit is not None:  # the DiT builds cond and text_uncond from the images
        eps, noise = edit_noise(options.seed, [a.shape[:2] for a in edit.vae],
                                options.height, options.width, hf_config)
        branches = {"img_uncond": (k, v, length)}
        edit_payload = {"text_ids": torch.tensor(ar.prompt_token_ids[:length])}
        for i, (vae, vit) in enumerate(zip(edit.vae, edit.vit, strict=True)):
            edit_payload.update({f"vae.{i}": torch.from_numpy(vae.copy()),
                                 f"vit.{i}": torch.from_numpy(vit.copy()),
                                 f"eps.{i}": eps[i]})
    else:
        noise = initial_noise(options.seed, options.height, options.width, hf_config)
        branches = {"cond": (k, v, length), "text_uncond": text_uncond,
                    "img_uncond": img_uncond}
        edit_payload = None
    payload = generation_payload(noise, options.height, options.width, options.guidance,
                                 branches, edit_payload)
    return StageInput(prompt_token_ids=[0], payload=payload, sampling_overrides={
        "max_tokens": options.guidance.num_timesteps - 1, "ignore_eos": True})


@hookimpl
def omni_register_stage_input_processors():
    """BAGEL's stage input processor: ``bagel_ar2dit`` (:func:`bagel_ar2dit`)."""
    return {"bagel_ar2dit": bagel_ar2dit}


@hookimpl
def omni_plan_image(hf_config, request: ImageRequest):
    """:func:`plan_bagel_image` for a BAGEL checkpoint, None for any other model.

    Raises:
        RequestError: see :func:`plan_bagel_image`.
    """
    return plan_bagel_image(hf_config, request) if is_bagel(hf_config) else None
