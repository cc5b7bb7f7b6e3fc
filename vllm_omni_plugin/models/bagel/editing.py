"""BAGEL's image editing inputs: how an input image is resized for the autoencoder and
for the ViT (the official app's ``ImageTransform``s), and the ViT path that turns it into
context tokens (the official ``forward_cache_update_vit``'s input).

The official app edits with ``[image, instruction]``: the image is resized once for the
autoencoder (long side at most 1024, short side at least 512, sides multiples of 16),
enters the context through the autoencoder (a block of latent tokens) and then, resized
again from that for the ViT (long side at most 980, short side at least 224, multiples
of the 14-pixel patch), through the ViT (a block of ViT tokens); the instruction
follows, and the edited image is drawn at the autoencoder's size. Here those sides are
capped by the checkpoint (:func:`edit_sides`), which leaves the released BAGEL's
unchanged. Resizing is Pillow's bicubic, which torchvision's ``resize`` runs on the
official app's PIL images. The official transform also caps the pixel count (about
1.8 M), which these sides never reach: left out.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from vllm.model_executor.models.bagel import BagelVisionMLP, PositionEmbedding
from vllm.model_executor.models.siglip import SiglipVisionModel

from vllm_omni_plugin.compat.internals import siglip_parts
from vllm_omni_plugin.models.bagel.geometry import (
    grid_position_ids,
    latent_token_pixels,
    max_image_side,
)
from vllm_omni_plugin.models.weights import load_stacked

#: the official app's ``vae_transform = ImageTransform(1024, 512, 16)``: long side, short
#: side, stride (pixels)
VAE_SIDES = (1024, 512, 16)
#: the official app's ``vit_transform = ImageTransform(980, 224, 14)`` (the stride is the
#: ViT's patch)
VIT_SIDES = (980, 224, 14)


class Sides(NamedTuple):
    """An image transform's bounds in pixels: the longest side at most ``max_side``, the
    shortest at least ``min_side``, both multiples of ``stride``."""

    max_side: int
    min_side: int
    stride: int


def edit_sides(config) -> tuple[Sides, Sides]:
    """The autoencoder's and the ViT's :class:`Sides` for the checkpoint (vLLM's
    ``BagelConfig``): the official ones with the long side capped by the largest image
    the checkpoint takes (:func:`~.geometry.max_image_side`; the ViT's ``patch_size *
    vit_max_num_patch_per_side``) and the short side by half of that."""
    vae_max = min(VAE_SIDES[0], max_image_side(config))
    patch = int(config.vit_config.patch_size)
    vit_max = min(VIT_SIDES[0], patch * int(config.vit_max_num_patch_per_side))
    return (Sides(vae_max, min(VAE_SIDES[1], vae_max // 2), VAE_SIDES[2]),
            Sides(vit_max, min(VIT_SIDES[1], vit_max // 2), patch))


def _divisible(value: float, stride: int) -> int:
    return max(stride, int(round(value / stride) * stride))


def resized_size(width: int, height: int, sides: Sides) -> tuple[int, int]:
    """``(width, height)`` of an image resized within ``sides`` as the official
    ``MaxLongEdgeMinShortEdgeResize``: scale to bring the long side down to
    ``max_side`` (never up), then the short side up to ``min_side``; round each side to
    the stride; if the long side then exceeds ``max_side``, scale once more."""
    def scaled(w, h, scale):
        return _divisible(round(w * scale), sides.stride), _divisible(round(h * scale),
                                                                      sides.stride)

    scale = min(sides.max_side / max(width, height), 1.0)
    scale = max(scale, sides.min_side / min(width, height))
    w, h = scaled(width, height, scale)
    if max(w, h) > sides.max_side:
        w, h = scaled(w, h, sides.max_side / max(w, h))
    return w, h


def edit_images(image, config) -> tuple[np.ndarray, np.ndarray]:
    """The autoencoder's and the ViT's input pixels of an RGB Pillow ``image``:
    ``[H, W, 3]`` and ``[h, w, 3]`` uint8 (see the module docstring)."""
    from PIL import Image

    vae_sides, vit_sides = edit_sides(config)
    image = image.convert("RGB")
    vae = image.resize(resized_size(*image.size, vae_sides), Image.Resampling.BICUBIC)
    vit = vae.resize(resized_size(*vae.size, vit_sides), Image.Resampling.BICUBIC)
    return np.asarray(vae, dtype=np.uint8), np.asarray(vit, dtype=np.uint8)


def check_edit_images(config, vae_sizes: list[tuple[int, int]],
                      vit_sizes: list[tuple[int, int]]) -> None:
    """Refuse input images whose context would outgrow what the DiT's memory profile
    holds: one image of the largest size (``max_latent_size ** 2`` latent tokens and
    ``vit_max_num_patch_per_side ** 2`` ViT tokens). Several smaller images share that.

    Args:
        config: vLLM's ``BagelConfig`` of the checkpoint.
        vae_sizes: each image's ``(height, width)`` at the autoencoder's size.
        vit_sizes: each image's ``(height, width)`` at the ViT's size.

    Raises:
        RequestError: naming ``image``, with the tokens the images make and the bound.
    """
    from vllm_omni_plugin.processors.hookspecs import RequestError

    token = latent_token_pixels(config)
    patch = int(config.vit_config.patch_size)
    latents = sum((h // token) * (w // token) for h, w in vae_sizes)
    vit = sum((h // patch) * (w // patch) for h, w in vit_sizes)
    most_latents = int(config.max_latent_size) ** 2
    most_vit = int(config.vit_max_num_patch_per_side) ** 2
    if latents > most_latents or vit > most_vit:
        raise RequestError("image", f"{len(vae_sizes)} images make {latents} latent and "
                           f"{vit} ViT tokens once resized; the images of one edit share "
                           f"{most_latents} and {most_vit} (one image of the largest size)")


def normalized(pixels: torch.Tensor) -> torch.Tensor:
    """``[H, W, 3]`` uint8 -> ``[1, 3, H, W]`` float32 in ``[-1, 1]``: ``(x / 255 - 0.5) /
    0.5``, the official transforms' ``ToTensor`` and ``Normalize(0.5, 0.5)``."""
    x = pixels.permute(2, 0, 1).unsqueeze(0).float() / 255
    return (x - 0.5) / 0.5


class BagelViT(nn.Module):
    """BAGEL's understanding ViT path on vLLM's layers: SigLIP (``SiglipVisionModel``,
    one layer fewer than ``vit_config`` says, with its final LayerNorm, as the official
    app builds it), the connector (``BagelVisionMLP``) and the 2-D sin-cos position table
    (``PositionEmbedding``). Unlike vLLM's understanding path, which resizes every image
    to the ViT's square, an image keeps its resized aspect: each patch's position is its
    row and column in the ``vit_max_num_patch_per_side`` grid, for SigLIP's position
    table and the connector's alike.
    """

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        vit_config = copy.deepcopy(config.vit_config)
        vit_config.num_hidden_layers -= 1
        self.patch = int(vit_config.patch_size)
        self.max_side = int(config.vit_max_num_patch_per_side)
        hidden = config.llm_config.hidden_size
        self.vit_model = SiglipVisionModel(vit_config, require_post_norm=True,
                                           prefix=f"{prefix}vit_model")
        self.connector = BagelVisionMLP(vit_config.hidden_size, hidden, hidden,
                                        act_layer=config.connector_act,
                                        prefix=f"{prefix}connector")
        self.vit_pos_embed = PositionEmbedding(self.max_side, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[1, 3, h, w]`` in ``[-1, 1]`` (sides multiples of the patch, any float dtype)
        -> ``[h * w / patch ** 2, hidden]`` context tokens in the model's dtype, in
        row-major patch order."""
        vit = siglip_parts(self.vit_model)
        weight = vit.patch_embedding.weight
        patches = vit.patch_embedding(pixels.to(weight.dtype)).flatten(2)[0].T
        ids = grid_position_ids(pixels.shape[2], pixels.shape[3], self.patch,
                                self.max_side).to(pixels.device)
        # SigLIP's own position table is the ViT's square grid: the same row * side + col
        x = patches + vit.position_embedding(ids)
        x = vit.post_layernorm(vit.encoder(inputs_embeds=x[None],
                                           return_all_hidden_states=False))[0]
        return self.connector(x) + self.vit_pos_embed(ids).to(x.dtype)

    def load_weights(self, weights) -> set[str]:
        """Load ``vit_model.vision_model.*`` (the patch embedding, stored as a linear layer
        over ``(row, col, channel)`` patch vectors as the official checkpoint keeps it,
        reshaped to vLLM's convolution) and ``connector.*``; returns the names of the
        parameters loaded.

        Raises:
            ValueError: a connector parameter has no weight.
        """
        prefix = "vit_model.vision_model."
        vit, connector = [], []
        for name, tensor in weights:
            if name.startswith(prefix):
                name = name[len(prefix):]
                if name.endswith("patch_embedding.weight") and tensor.dim() == 2:
                    tensor = tensor.reshape(tensor.shape[0], self.patch, self.patch, -1
                                            ).permute(0, 3, 1, 2).contiguous()
                vit.append((name, tensor))
            elif name.startswith("connector."):
                connector.append((name[len("connector."):], tensor))
        loaded = {prefix + n for n in siglip_parts(self.vit_model).transformer.load_weights(vit)}
        names = [n for n, _ in self.connector.named_parameters()]
        return loaded | {"connector." + n for n in load_stacked(
            self.connector, connector, names, owner="BAGEL's ViT connector")}
