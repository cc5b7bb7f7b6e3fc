"""BAGEL's autoencoder (FLUX.1's): the decoder (latents -> RGB) and the encoder (RGB ->
latents, for image editing), with the checkpoint's own key names (``decoder.*`` and
``encoder.*`` in ``ae.safetensors``).

Architecture of the latent-diffusion autoencoders (Rombach et al. 2022, "High-Resolution
Image Synthesis with Latent Diffusion Models") as FLUX.1 configures it: a 3x3 input
convolution, a middle of two residual blocks around one single-head self-attention
block, then per resolution level (coarsest first) ``num_res_blocks + 1`` residual blocks
and, except at the finest level, a nearest-neighbour 2x upsampling followed by a 3x3
convolution; GroupNorm (32 groups, eps 1e-6) and SiLU before the output convolution.
The encoder mirrors it: a 3x3 input convolution, per level (finest first)
``num_res_blocks`` residual blocks and, except at the coarsest level, a 3x3 convolution
of stride 2 after padding the bottom and right by one, the same middle, then GroupNorm,
SiLU and a 3x3 convolution to the mean and log-variance of ``z_channels`` each.
vLLM has no layers for convolutional decoders, so this is plain ``torch.nn``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: FLUX.1's autoencoder, which the released BAGEL uses (its ``load_ae`` constants).
#: A checkpoint's ``vae_config`` may set any of these (the tiny test checkpoint does).
FLUX_AE: dict[str, Any] = {
    "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128, "ch_mult": [1, 2, 4, 4],
    "num_res_blocks": 2, "z_channels": 16, "downsample": 8,
    "scale_factor": 0.3611, "shift_factor": 0.1159,
}
GROUPS = 32
EPS = 1e-6


def autoencoder_config(vae_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """FLUX's geometry overridden by the checkpoint's ``vae_config``.

    Raises:
        ValueError: the levels do not give ``downsample``, or a level's channels are not a
            multiple of the GroupNorm groups.
    """
    cfg = {**FLUX_AE, **dict(vae_config or {})}
    if 2 ** (len(cfg["ch_mult"]) - 1) != cfg["downsample"]:
        raise ValueError(f"vae_config: ch_mult {cfg['ch_mult']} gives a downsampling of "
                         f"{2 ** (len(cfg['ch_mult']) - 1)}, not downsample "
                         f"{cfg['downsample']}")
    for mult in cfg["ch_mult"]:
        if (cfg["ch"] * mult) % GROUPS:
            raise ValueError(f"vae_config: ch {cfg['ch']} x {mult} is not a multiple of "
                             f"{GROUPS} (GroupNorm groups)")
    return cfg


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, channels, eps=EPS, affine=True)


class _Residual(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, cin, H, W]`` -> ``[B, cout, H, W]``, in the decoder's dtype (its weights')."""
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class _Attention(nn.Module):
    """One head over all positions of the feature map; projections are 1x1 convolutions."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1)
                                                 for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, channels, H, W]`` -> ``[B, channels, H, W]`` (``x`` plus the attention over
        its ``H * W`` positions), in the decoder's dtype (its weights')."""
        b, c, h, w = x.shape
        y = self.norm(x)

        def tokens(conv):  # [b, c, h, w] -> [b, 1, h*w, c]
            return conv(y).reshape(b, c, h * w).transpose(1, 2).unsqueeze(1)

        out = F.scaled_dot_product_attention(tokens(self.q), tokens(self.k), tokens(self.v))
        return x + self.proj_out(out.squeeze(1).transpose(1, 2).reshape(b, c, h, w))


class _Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, channels, H, W]`` -> ``[B, channels, 2 * H, 2 * W]``, in the decoder's dtype
        (its weights')."""
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Mid(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = _Residual(channels, channels)
        self.attn_1 = _Attention(channels)
        self.block_2 = _Residual(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, channels, H, W]`` -> ``[B, channels, H, W]``, in the decoder's dtype (its
        weights')."""
        return self.block_2(self.attn_1(self.block_1(x)))


class _Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, channels, H, W]`` -> ``[B, channels, H / 2, W / 2]`` (zero padding at the
        bottom and right only, then the strided convolution), in the encoder's dtype."""
        return self.conv(F.pad(x, (0, 1, 0, 1)))


def _residuals(cin: int, cout: int, blocks: int) -> nn.ModuleList:
    """A level's ``blocks`` residual blocks, ``cin`` -> ``cout`` channels at the first."""
    return nn.ModuleList(_Residual(cin if i == 0 else cout, cout) for i in range(blocks))


class _Level(nn.Module):
    def __init__(self, cin: int, cout: int, blocks: int, upsample: bool):
        super().__init__()
        self.block = _residuals(cin, cout, blocks)
        self.upsample = _Upsample(cout) if upsample else None


class FluxDecoder(nn.Module):
    """Latents ``[B, z_channels, h, w]`` (the autoencoder's scaled space) -> RGB
    ``[B, 3, h * downsample, w * downsample]`` in about ``[-1, 1]``."""

    def __init__(self, vae_config: Mapping[str, Any] | None = None):
        super().__init__()
        cfg = autoencoder_config(vae_config)
        self.scale_factor, self.shift_factor = cfg["scale_factor"], cfg["shift_factor"]
        mult, ch = cfg["ch_mult"], cfg["ch"]
        channels = ch * mult[-1]
        self.conv_in = nn.Conv2d(cfg["z_channels"], channels, 3, padding=1)
        self.mid = _Mid(channels)
        levels: list[_Level | None] = [None] * len(mult)
        for i in reversed(range(len(mult))):  # coarsest first, indexed by level
            levels[i] = _Level(channels, ch * mult[i], cfg["num_res_blocks"] + 1, i != 0)
            channels = ch * mult[i]
        self.up = nn.ModuleList(levels)
        self.norm_out = _norm(channels)
        self.conv_out = nn.Conv2d(channels, cfg["out_ch"], 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Decodes latents ``[B, z_channels, h, w]`` (unscaled first: ``z / scale_factor +
        shift_factor``) to RGB ``[B, out_ch, h * downsample, w * downsample]`` in about
        ``[-1, 1]``. ``z`` and the result are in the decoder's dtype (its weights'; the
        model's dtype in :class:`~vllm_omni_plugin.models.bagel.dit.BagelDiT`)."""
        h = self.mid(self.conv_in(z / self.scale_factor + self.shift_factor))
        for level in reversed(self.up):
            for block in level.block:
                h = block(h)
            if level.upsample is not None:
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class _DownLevel(nn.Module):
    def __init__(self, cin: int, cout: int, blocks: int, downsample: bool):
        super().__init__()
        self.block = _residuals(cin, cout, blocks)
        self.downsample = _Downsample(cout) if downsample else None


class FluxEncoder(nn.Module):
    """RGB ``[B, 3, H, W]`` in ``[-1, 1]`` (sides multiples of ``downsample``) -> the
    posterior's mean and log-variance ``[B, 2 * z_channels, H / downsample, W /
    downsample]`` (see :meth:`latent` for the scaled latent)."""

    def __init__(self, vae_config: Mapping[str, Any] | None = None):
        super().__init__()
        cfg = autoencoder_config(vae_config)
        self.scale_factor, self.shift_factor = cfg["scale_factor"], cfg["shift_factor"]
        mult, ch = cfg["ch_mult"], cfg["ch"]
        self.conv_in = nn.Conv2d(cfg["in_channels"], ch, 3, padding=1)
        channels = ch
        levels = []
        for i, m in enumerate(mult):
            levels.append(_DownLevel(channels, ch * m, cfg["num_res_blocks"],
                                     i != len(mult) - 1))
            channels = ch * m
        self.down = nn.ModuleList(levels)
        self.mid = _Mid(channels)
        self.norm_out = _norm(channels)
        self.conv_out = nn.Conv2d(channels, 2 * cfg["z_channels"], 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, in_channels, H, W]`` -> ``[B, 2 * z_channels, H / downsample, W /
        downsample]``: the mean then the log-variance, in the encoder's dtype (its
        weights')."""
        h = self.conv_in(x)
        for level in self.down:
            for block in level.block:
                h = block(h)
            if level.downsample is not None:
                h = level.downsample(h)
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))

    def latent(self, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """The scaled latent of RGB ``x`` ``[B, 3, H, W]`` in ``[-1, 1]``: a draw of the
        posterior, ``mean + exp(logvar / 2) * eps``, then ``scale_factor * (z -
        shift_factor)``, as the official ``AutoEncoder.encode`` (its ``DiagonalGaussian``
        samples). ``eps`` ``[B, z_channels, H / downsample, W / downsample]`` standard
        normal, any float dtype; the result ``[B, z_channels, ...]`` in the encoder's
        dtype."""
        mean, logvar = self(x).chunk(2, dim=1)
        z = mean + torch.exp(0.5 * logvar) * eps.to(mean.dtype)
        return self.scale_factor * (z - self.shift_factor)


def to_uint8_image(decoded: torch.Tensor) -> torch.Tensor:
    """``[3, H, W]`` decoder output -> ``[H, W, 3]`` uint8: ``clamp(x / 2 + 1 / 2, 0, 1)``
    times 255, truncated (the official inferencer's conversion)."""
    pixels = (decoded.float() * 0.5 + 0.5).clamp(0, 1) * 255
    return pixels.permute(1, 2, 0).to(torch.uint8)
