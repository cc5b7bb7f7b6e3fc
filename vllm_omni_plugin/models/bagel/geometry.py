"""BAGEL's image geometry, read from the checkpoint's config (vLLM's ``BagelConfig``):
the pixels of a latent token, the largest image side, and the rows of a token grid's
position table. Shared by the DiT (:mod:`.dit`) and the editing inputs (:mod:`.editing`).
"""

from __future__ import annotations

import torch


def latent_token_pixels(config) -> int:
    """Pixels a side of one latent token: the autoencoder's downsampling times
    ``latent_patch_size`` (16 for BAGEL)."""
    return int(config.vae_config.get("downsample", 8)) * int(config.latent_patch_size)


def max_image_side(config) -> int:
    """The largest image side in pixels: ``max_latent_size`` latent tokens."""
    return latent_token_pixels(config) * int(config.max_latent_size)


def grid_position_ids(height: int, width: int, token: int, max_side: int) -> torch.Tensor:
    """``[rows * cols]`` int64 rows of a ``max_side x max_side`` position table for an
    image of ``height`` x ``width`` pixels in ``token``-pixel tokens (row-major, ``row *
    max_side + col``: the official ``get_flattened_position_ids_extrapolate``), for the
    latent tokens and the ViT's patches alike."""
    rows = torch.arange(height // token)
    cols = torch.arange(width // token)
    return (rows[:, None] * max_side + cols).reshape(-1)
