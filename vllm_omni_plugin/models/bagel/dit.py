"""BAGEL's image generation (the DiT stage): flow matching over FLUX latents, conditioned
on the AR stage's context keys and values, with classifier-free guidance; served as a
vLLM model on vLLM's own worker and model runner (the plugin's ``OmniWorker``).

A request is one image, and each engine step advances every image it schedules by one
Euler step: the step that prefills the request's one-token placeholder prompt starts its
image, and the request lives one engine step per Euler step (its ``max_tokens`` must be
``num_timesteps - 1``; the orchestrator sets it), the last one decoding the image. An
image that arrives while others are denoised joins them at the next step (continuous
batching, as vLLM batches decode steps), and images of one size share each step's
forwards (:meth:`BagelDiT.advance`).

* **Input payload** (the orchestrator's, see :func:`generation_payload`):
  ``noise`` ``[h*w, p*p*z]`` float32, the initial latent (drawn on the CPU from the
  request's seed by the head, so any replica reproduces it), ``size`` ``[2]`` int64
  (height, width in pixels), ``guidance`` (:class:`Guidance` as a tensor), and per CFG
  branch ``{branch}.k`` / ``{branch}.v`` ``[layers, tokens, kv_heads, head_dim]`` (the
  branch's context keys after RoPE and values, float32) and ``{branch}.rope`` ``[1]``
  int64 (the context's next RoPE position) for the branches :data:`BRANCHES`. A branch
  whose scale is above 1 must be there: a missing one fails the request naming it.
  An editing request carries ``img_uncond`` (the instruction alone, from the AR stage)
  and its input images instead of the other two: per image ``i`` ``edit.vae.{i}`` ``[H,
  W, 3]`` and ``edit.vit.{i}`` ``[h, w, 3]`` uint8 (the image at the autoencoder's and
  the ViT's sizes) and ``edit.eps.{i}`` ``[z, H / 8, W / 8]`` float32 (its posterior
  draw), and ``edit.text_ids`` ``[T]`` int64 (the instruction's tokens); its first step
  builds ``cond`` and ``text_uncond`` from them (:meth:`BagelDiT.edit_contexts`).
* **Velocity** (the official ``Bagel._forward_flow``): the query is
  ``<|vision_start|>``, the ``h*w`` latent tokens, ``<|vision_end|>``, all at the
  context's next RoPE position, attending to the context and to each other without a
  causal mask. Marker tokens go through the understanding expert, latent tokens through
  the generation expert (``*_moe_gen`` weights, their final norm ``norm_moe_gen``).
  A latent token's input is ``vae2llm(x) + time_embedder(t) + latent_pos_embed(row *
  max_latent_size + col)``; the velocity is ``llm2vae`` of its output. The branches the
  step's images of one size need run as one padded batch (contexts of different lengths
  masked), each image at its own timestep, up to the rows of ``max_num_seqs`` images of
  the largest size (:meth:`BagelDiT.forward_budget`, what the memory profile runs);
  results equal the image's alone up to float rounding.
* **Guidance and sampling** (the official ``generate_image``): :func:`guided_velocity`,
  :meth:`Guidance.timesteps` and Euler steps ``x <- x - v * (t_k - t_{k+1})``.
* **Output payload** (:meth:`BagelDiTStage.stage_output_requests`): ``latent``
  ``[h*w, p*p*z]`` float32 and ``image`` ``[H, W, 3]`` uint8, decoded by
  :class:`~vllm_omni_plugin.models.bagel.autoencoder.FluxDecoder`.
* **Memory profile.** vLLM profiles only engines with a KV cache, and this model has
  none: the plugin's worker runs vLLM's profiling forward itself at start-up
  (``OmniWorkerMixin.compile_or_warm_up_model``) with ``stage_profiling`` set, the model
  holds the contexts of ``max_num_seqs`` images of the largest size and runs one
  denoising step of them in one forward, then the decoder at that size
  (:meth:`BagelDiT.profile_peak`), and start-up fails when that peak exceeds the
  engine's share of its device.

Layers are vLLM's (``QKVParallelLinear``, ``RowParallelLinear``, Qwen2's MLP,
``RMSNorm``, ``get_rope``, ``ReplicatedLinear``, BAGEL's ``PositionEmbedding``);
attention is ``torch.nn.functional.scaled_dot_product_attention`` over the context and
the query (no paged KV cache: vLLM sees a model without attention layers).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.bagel import PositionEmbedding
from vllm.model_executor.models.qwen2 import Qwen2MLP

from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.models.bagel.autoencoder import (
    FluxDecoder,
    FluxEncoder,
    autoencoder_config,
    to_uint8_image,
)
from vllm_omni_plugin.models.bagel.editing import BagelViT, normalized
from vllm_omni_plugin.models.bagel.geometry import (
    grid_position_ids,
    latent_token_pixels,
    max_image_side,
)
from vllm_omni_plugin.models.weights import load_stacked
from vllm_omni_plugin.processors.hookspecs import RequestError

logger = init_logger(__name__)

#: CFG branches, in the order the official code combines them: the full context, the
#: text-unconditional one (without the prompt, or a negative prompt), the
#: image-unconditional one (without input images).
BRANCHES = ("cond", "text_uncond", "img_uncond")
RENORM_TYPES = ("global", "channel", "text_channel")
#: the sinusoid fed to the timestep MLP (the official ``TimestepEmbedder``: 256 values,
#: cos then sin, max period 10000, as in DiT, Peebles & Xie 2023)
TIMESTEP_FREQUENCIES = 256
TIMESTEP_MAX_PERIOD = 10000.0
#: the norm the official renormalisation adds to a guided velocity's norm
RENORM_EPS = 1e-8
#: at most this many timesteps (the official default is 50): twice the default, which
#: bounds an image's time in the DiT
MAX_TIMESTEPS = 100

# -- how long a DiT engine step takes -------------------------------------------------------
# An engine step advances each image it schedules by one Euler step (the first step of an
# image also packs its contexts, the last decodes it): at most the engine's max_num_seqs
# images, those of one size in shared forwards. The shipped BAGEL pipelines set the DiT's
# max_num_seqs to MAX_IMAGES_PER_STEP; its longest step, that many 1024x1024 images' Euler
# steps (each EULER_STEP_SECONDS on one H100) and decodes, is seconds: the default stall
# timeout (replicas/liveness.py) holds it, and the head admits max_num_seqs x replicas
# image requests to the DiT at once (more wait for admission).

#: Images one DiT engine step advances at most in the shipped BAGEL pipelines (the DiT
#: stage's ``engine_args.max_num_seqs``): four images share a forward, and four of the
#: largest keep a step (one Euler step each, 2.1 s on one H100) far under the stall
#: timeout.
MAX_IMAGES_PER_STEP = 4
#: Seconds of one Euler step of the largest image (1024x1024: 4,096 latent tokens) with
#: the three CFG branches, BAGEL-7B-MoT on one H100 (bf16, 400 TFLOP/s sustained, 40 %
#: of its dense peak): per branch 2 x 7e9 active parameters x 4,096 tokens, plus
#: attention over a context of up to 4,096 tokens, 4 x 28 layers x 4,096 x 8,192 x 3,584
#: = 7.1e13 FLOPs; three branches 2.1e14 FLOPs, 0.53 s.
EULER_STEP_SECONDS = 0.53


@dataclass(frozen=True)
class Guidance:
    """How one image is sampled; defaults are the official app's text-to-image ones.

    Attributes:
        cfg_text_scale: text guidance (1: none).
        cfg_img_scale: image guidance (1: none).
        cfg_interval: guidance applies at shifted timesteps ``lo < t <= hi``.
        cfg_renorm_min: lower clamp of the renormalisation ratio (upper: 1).
        cfg_renorm_type: ``global`` (whole tensor), ``channel`` (per token) or
            ``text_channel`` (per token, after the text guidance only).
        timestep_shift: ``s`` in ``t' = s t / (1 + (s - 1) t)``.
        num_timesteps: points from 1 to 0; ``num_timesteps - 1`` Euler steps.
    """

    cfg_text_scale: float = 4.0
    cfg_img_scale: float = 1.5
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_min: float = 0.0
    cfg_renorm_type: str = "global"
    timestep_shift: float = 3.0
    num_timesteps: int = 50

    def __post_init__(self):
        """Raises :class:`RequestError` naming the first field out of range."""
        lo, hi = self.cfg_interval
        checks = [
            ("cfg_text_scale", self.cfg_text_scale >= 0, "must be >= 0"),
            ("cfg_img_scale", self.cfg_img_scale >= 0, "must be >= 0"),
            ("cfg_interval", 0 <= lo <= hi <= 1, "must be [lo, hi] with 0 <= lo <= hi <= 1"),
            ("cfg_renorm_min", 0 <= self.cfg_renorm_min <= 1, "must be in [0, 1]"),
            ("cfg_renorm_type", self.cfg_renorm_type in RENORM_TYPES,
             f"must be one of {', '.join(RENORM_TYPES)}"),
            ("timestep_shift", self.timestep_shift > 0, "must be > 0"),
            ("num_timesteps", 2 <= self.num_timesteps <= MAX_TIMESTEPS,
             f"must be in [2, {MAX_TIMESTEPS}]"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise RequestError(name, message)

    def to_tensor(self) -> torch.Tensor:
        """``[8]`` float64: the fields in declaration order (the renorm type as its
        index in :data:`RENORM_TYPES`); that dtype holds every field exactly."""
        d = asdict(self)
        return torch.tensor([d["cfg_text_scale"], d["cfg_img_scale"], *d["cfg_interval"],
                             d["cfg_renorm_min"], RENORM_TYPES.index(d["cfg_renorm_type"]),
                             d["timestep_shift"], d["num_timesteps"]], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Guidance:
        """Inverse of :meth:`to_tensor`. Raises ValueError for a bad tensor or value.

        ``t``: 8 values in any shape (flattened), any real dtype (read as float64), on any
        device.

        Raises:
            ValueError: not 8 values, a renorm type that is no index of
                :data:`RENORM_TYPES`, or a fractional ``num_timesteps``.
            RequestError: a field out of range (a ``ValueError`` too).
        """
        v = t.detach().cpu().to(torch.float64).reshape(-1).tolist()
        if len(v) != 8 or int(v[5]) != v[5] or not 0 <= v[5] < len(RENORM_TYPES) \
                or int(v[7]) != v[7]:
            raise ValueError(f"guidance: not a Guidance tensor: {v}")
        return cls(v[0], v[1], (v[2], v[3]), v[4], RENORM_TYPES[int(v[5])], v[6], int(v[7]))

    def timesteps(self) -> torch.Tensor:
        """``[num_timesteps]`` float32 from 1 to 0, shifted."""
        t = torch.linspace(1, 0, self.num_timesteps)
        s = self.timestep_shift
        return s * t / (1 + (s - 1) * t)

    def scales_at(self, t: float) -> tuple[float, float]:
        """(text, image) scales at shifted timestep ``t`` (1 outside the interval)."""
        lo, hi = self.cfg_interval
        if lo < t <= hi:
            return self.cfg_text_scale, self.cfg_img_scale
        return 1.0, 1.0


def guided_velocity(v: torch.Tensor, v_text: torch.Tensor | None, v_img: torch.Tensor | None,
                    text_scale: float, img_scale: float, renorm_type: str,
                    renorm_min: float) -> torch.Tensor:
    """Classifier-free guidance of one image's velocity ``v`` ``[tokens, dim]`` with its
    text- and image-unconditional velocities, as the official ``_forward_flow``: none
    unless ``text_scale > 1``; then text guidance, image guidance when ``img_scale > 1``,
    and the result scaled by ``clamp(|v| / (|guided| + 1e-8), renorm_min, 1)``.

    All three velocities have the same shape and float dtype (float32 from
    :meth:`BagelDiT.velocities`); the result has it too.

    Raises:
        ValueError: a branch a scale above 1 needs is None.
    """
    if text_scale <= 1.0:
        return v
    if v_text is None or (img_scale > 1.0 and v_img is None):
        raise ValueError("guidance needs the missing unconditional velocity")
    guided = v_text + text_scale * (v - v_text)
    if renorm_type == "text_channel":
        ratio = v.norm(dim=-1, keepdim=True) / (guided.norm(dim=-1, keepdim=True) + RENORM_EPS)
        guided = guided * ratio.clamp(min=renorm_min, max=1.0)
        return v_img + img_scale * (guided - v_img) if img_scale > 1.0 else guided
    if img_scale > 1.0:
        guided = v_img + img_scale * (guided - v_img)
    if renorm_type == "global":
        ratio = v.norm() / (guided.norm() + RENORM_EPS)
    else:
        ratio = v.norm(dim=-1, keepdim=True) / (guided.norm(dim=-1, keepdim=True) + RENORM_EPS)
    return guided * ratio.clamp(min=renorm_min, max=1.0)


def branches_for(text_scale: float, img_scale: float) -> list[str]:
    """The CFG branches whose velocities :func:`guided_velocity` combines at these
    scales: ``cond``, then ``text_uncond`` when ``text_scale > 1``, then ``img_uncond``
    when both scales are above 1."""
    if text_scale <= 1.0:
        return ["cond"]
    return ["cond", "text_uncond"] + (["img_uncond"] if img_scale > 1.0 else [])


def timestep_embedding(t: torch.Tensor, dim: int = TIMESTEP_FREQUENCIES) -> torch.Tensor:
    """``[n]`` timesteps (fractions in [0, 1], not scaled) -> ``[n, dim]`` float32:
    ``cos(t * f_i)`` then ``sin(t * f_i)``, ``f_i = 10000^(-i / (dim / 2))``."""
    half = dim // 2
    freqs = torch.exp(-math.log(TIMESTEP_MAX_PERIOD)
                      * torch.arange(half, dtype=torch.float32) / half).to(t.device)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention of the DiT's query over context and query tokens, without a
    causal mask: ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        queries: ``[B, heads, n, head_dim]``.
        keys: ``[B, kv_heads, L + n, head_dim]`` (``heads`` a multiple of
            ``kv_heads``), the same dtype as ``queries``.
        values: as ``keys``.
        mask: None, or ``[B, 1, 1, L + n]`` bool (False: a padded context position), or
            ``[B, 1, n, L + n]`` (an editing context's causal instruction tokens).

    Returns:
        ``[B, heads, n, head_dim]`` in the queries' dtype.

    Without a mask, SDPA shares each key/value head among its query heads
    (``enable_gqa``), which PyTorch's flash kernel serves. With one (the CFG branches'
    contexts differ in length, the usual case), keys and values are first repeated to
    the query heads: no fused CUDA kernel takes both a mask and ``enable_gqa`` (flash
    attention takes no mask, memory-efficient attention no GQA), so SDPA would fall back
    to its math kernel, which materialises float32 ``[B, heads, n, L + n]`` scores
    (GiBs per layer at 1024x1024); repeated heads with a mask run memory-efficient
    attention. The repeat costs ``B * heads * (L + n) * head_dim`` elements each for
    keys and values, a ``head_dim / n`` fraction of those scores.
    """
    if mask is None:
        return F.scaled_dot_product_attention(queries, keys, values, enable_gqa=True)
    groups = queries.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)


class _Attention(nn.Module):
    def __init__(self, config, prefix: str):
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = h // heads
        self.qkv_proj = QKVParallelLinear(h, self.head_dim, heads, config.num_key_value_heads,
                                          bias=True, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(heads * self.head_dim, h, bias=False,
                                        prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.q_size = heads * self.head_dim
        self.kv_size = config.num_key_value_heads * self.head_dim

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[n, hidden]`` -> q ``[n, q_size]``, k, v ``[n, kv_size]`` (q/k normed per head),
        in the model's dtype."""
        q, k, v = self.qkv_proj(x)[0].split([self.q_size, self.kv_size, self.kv_size], -1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(k.shape)
        return q, k, v


class _Expert(nn.Module):
    """One expert's half of a decoder layer (the understanding one, or the generation
    one whose checkpoint names end in ``_moe_gen``)."""

    def __init__(self, config, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = _Attention(config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen2MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            prefix=f"{prefix}.mlp")


class _Layer(nn.Module):
    def __init__(self, config, prefix: str):
        super().__init__()
        self.und = _Expert(config, f"{prefix}.und")
        self.gen = _Expert(config, f"{prefix}.gen")

    def forward(self, x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor],
                positions: torch.Tensor, rotary, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[B * n, hidden]`` (B branches of n query tokens each), ``rows`` the
        int64 row indices of the understanding expert's tokens and of the generation
        expert's (:attr:`_Packed.experts`; either may be empty), ``positions`` ``[B *
        n]``; ``ctx_k``/``ctx_v`` ``[B, L, kv_heads, head_dim]``; ``mask`` ``[B, 1, 1 or n,
        L + n]`` (False: not attended) or None.

        Returns:
            The layer's output ``[B * n, hidden]``, and the query tokens' keys (after
            RoPE) and values ``[B * n, kv_heads * head_dim]``, in the model's dtype.
        """
        experts = tuple((e, index) for e, index in zip((self.und, self.gen), rows, strict=True)
                        if index.numel())
        attn = self.und.self_attn
        q = x.new_empty(x.shape[0], attn.q_size)
        k = x.new_empty(x.shape[0], attn.kv_size)
        v = x.new_empty(x.shape[0], attn.kv_size)
        for expert, index in experts:
            q[index], k[index], v[index] = expert.self_attn.qkv(
                expert.input_layernorm(x.index_select(0, index)))
        q, k = rotary(positions, q, k)
        b, length = ctx_k.shape[:2]
        n = x.shape[0] // b
        hd = attn.head_dim
        keys = torch.cat([ctx_k, k.reshape(b, n, -1, hd)], dim=1).transpose(1, 2)
        values = torch.cat([ctx_v, v.reshape(b, n, -1, hd)], dim=1).transpose(1, 2)
        queries = q.reshape(b, n, -1, hd).transpose(1, 2)
        out = attend(queries, keys, values, mask).transpose(1, 2).reshape(b * n, -1)
        y = torch.empty_like(x)
        for expert, index in experts:
            y[index] = expert.self_attn.o_proj(out.index_select(0, index))[0]
        x = x + y
        for expert, index in experts:
            y[index] = expert.mlp(expert.post_attention_layernorm(x.index_select(0, index)))
        return x + y, k, v


class _Packed(NamedTuple):
    """CFG branches' contexts as one padded batch (:meth:`BagelDiT.pack`)."""

    ctx_k: torch.Tensor      # [layers, branches, L, kv_heads, head_dim]
    ctx_v: torch.Tensor
    mask: torch.Tensor | None  # [branches, 1, 1, L + n], False at padding; None: none
    #: int64 row indices of the markers (the understanding expert's) and of the latent
    #: tokens (the generation expert's): gathers by index, where boolean masks each
    #: waited for the device (a nonzero per use, a dozen per layer and step)
    experts: tuple[torch.Tensor, torch.Tensor]
    positions: torch.Tensor  # [branches * n] each branch's RoPE position


@dataclass(eq=False)
class DenoisingImage:
    """One image being denoised (:meth:`BagelDiT.start`), advanced by
    :meth:`BagelDiT.advance` one Euler step at a time.

    Attributes:
        x: ``[h*w, latent_dim]`` float32, the latent at ``timesteps[step]``.
        height: image height in pixels.
        width: image width in pixels.
        guidance: its sampling.
        timesteps: its shifted timesteps, from 1 to 0.
        pos_embed: ``[h*w, hidden]`` its latent tokens' rows of the position table.
        branches: ``{branch: (k, v, rope)}`` its CFG contexts (see :meth:`BagelDiT.pack`).
        serial: its number among the model's images (keys its packed contexts).
        same_as_cond: the branches whose context is the ``cond`` one (text to image's
            ``img_uncond``: there is no input image to leave out): not computed, their
            velocity is ``cond``'s.
        step: Euler steps taken.
    """

    x: torch.Tensor
    height: int
    width: int
    guidance: Guidance
    timesteps: list[float]
    pos_embed: torch.Tensor
    branches: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]
    serial: int
    same_as_cond: frozenset[str] = frozenset()
    step: int = 0

    @property
    def done(self) -> bool:
        """Whether every Euler step was taken (``x`` is the final latent)."""
        return self.step >= len(self.timesteps) - 1

    def names(self) -> tuple[str, ...]:
        """The CFG branches its next Euler step computes: those :func:`branches_for` reads,
        but for those in :attr:`same_as_cond`."""
        return tuple(b for b in branches_for(*self.guidance.scales_at(
            self.timesteps[self.step])) if b not in self.same_as_cond)


class BagelDiT(nn.Module):
    """The generation path of BAGEL: velocity of latent tokens given CFG branches'
    contexts, Euler sampling and the autoencoder's decoder.

    Args:
        config: vLLM's ``BagelConfig`` (``llm_config``, ``vae_config``,
            ``latent_patch_size``, ``max_latent_size``).
        marker_ids: the ids of ``<|vision_start|>`` and ``<|vision_end|>``.
    """

    def __init__(self, config, marker_ids: tuple[int, int], prefix: str = ""):
        super().__init__()
        llm = config.llm_config
        self.config = config
        h = llm.hidden_size
        self.hidden_size = h
        self.patch = int(config.latent_patch_size)
        self.z_channels = int(config.vae_config.get("z_channels", 16))
        self.downsample = latent_token_pixels(config)
        self.max_latent_size = int(config.max_latent_size)
        self.latent_dim = self.patch * self.patch * self.z_channels
        self.marker_ids = marker_ids
        #: the two marker tokens' input embeddings (rows of embed_tokens)
        self.register_buffer("marker_embeds", torch.zeros(2, h), persistent=False)
        self.layers = nn.ModuleList(_Layer(llm, f"{prefix}layers.{i}")
                                    for i in range(llm.num_hidden_layers))
        self.norm_gen = RMSNorm(h, eps=llm.rms_norm_eps)
        self.rotary = get_rope(h // llm.num_attention_heads,
                               max_position=llm.max_position_embeddings,
                               is_neox_style=True, rope_parameters=dict(llm.rope_parameters))
        self.time_embedder = nn.ModuleDict({
            "0": ReplicatedLinear(TIMESTEP_FREQUENCIES, h, bias=True),
            "2": ReplicatedLinear(h, h, bias=True)})
        self.vae2llm = ReplicatedLinear(self.latent_dim, h, bias=True)
        self.llm2vae = ReplicatedLinear(h, self.latent_dim, bias=True)
        self.latent_pos_embed = PositionEmbedding(self.max_latent_size, h)
        self.vae = FluxDecoder(config.vae_config)
        # image editing: the input image's context blocks and the instruction's tokens
        self.vae_encoder = FluxEncoder(config.vae_config)
        self.vit = BagelViT(config, prefix=f"{prefix}vit.")
        self.embed_tokens = VocabParallelEmbedding(llm.vocab_size, h,
                                                   prefix=f"{prefix}embed_tokens")
        self._serials = itertools.count()

    # -- velocity ------------------------------------------------------------------------
    def _latent_pos_embed(self, height: int, width: int, device) -> torch.Tensor:
        """``[h*w, hidden]`` the latent tokens' rows of the position table for a ``height``
        x ``width`` image, on ``device`` in the model's dtype (vLLM's
        ``PositionEmbedding`` keeps its table where numpy made it, the CPU)."""
        positions = grid_position_ids(height, width, self.downsample, self.max_latent_size)
        return self.latent_pos_embed(positions).to(device=device,
                                                   dtype=self.marker_embeds.dtype)

    def _framed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` tokens between ``<|vision_start|>`` and ``<|vision_end|>``:
        ``[n + 2, hidden]``."""
        return torch.cat([self.marker_embeds[:1], tokens, self.marker_embeds[1:]])

    def _embed_time(self, t: torch.Tensor) -> torch.Tensor:
        x = self.time_embedder["0"](timestep_embedding(t).to(self.marker_embeds.dtype))[0]
        return self.time_embedder["2"](F.silu(x))[0]

    def pack(self, contexts: list[tuple[torch.Tensor, torch.Tensor, int]], hw: int,
             device) -> _Packed:
        """The branches' contexts as one padded batch for :meth:`velocities` (built once
        per set of branches, not per step).

        Args:
            contexts: per branch ``(k, v, rope)``: ``[layers, L, kv_heads, head_dim]``
                keys and values, and the RoPE position of the query.
            hw: latent tokens of the image.
            device: where the batch (contexts in the model's dtype, mask, row indices and
                positions) is built.
        """
        dtype = self.marker_embeds.dtype
        n = hw + 2
        b = len(contexts)
        first = torch.arange(b, device=device) * n  # each branch's first row
        markers = torch.stack((first, first + n - 1), dim=1).reshape(-1)
        latent = (first[:, None] + torch.arange(1, n - 1, device=device)).reshape(-1)
        rope = torch.tensor([c[2] for c in contexts], device=device)
        longest = max(c[0].shape[1] for c in contexts)
        kv_heads, hd = contexts[0][0].shape[2:]
        ctx_k = torch.zeros(len(self.layers), b, longest, kv_heads, hd, dtype=dtype,
                            device=device)
        ctx_v = torch.zeros_like(ctx_k)
        mask = torch.ones(b, 1, 1, longest + n, dtype=torch.bool, device=device)
        for i, (k, v, _) in enumerate(contexts):
            length = k.shape[1]
            ctx_k[:, i, :length] = k.to(dtype)
            ctx_v[:, i, :length] = v.to(dtype)
            mask[i, ..., length:longest] = False
        return _Packed(ctx_k, ctx_v, None if bool(mask.all()) else mask, (markers, latent),
                       rope.repeat_interleave(n))

    def velocities(self, xs: list[torch.Tensor], ts: list[float],
                   pos_embeds: list[torch.Tensor], counts: list[int],
                   packed: _Packed) -> torch.Tensor:
        """The latent tokens' velocities of images of one size, each under its packed
        contexts.

        Args:
            xs: per image ``[h*w, latent_dim]``, its latent at its shifted timestep.
            ts: per image its shifted timestep, a fraction in ``[0, 1]`` (1: pure noise).
            pos_embeds: per image ``[h*w, hidden]``, its latent tokens' rows of the
                position table.
            counts: per image how many consecutive contexts of ``packed`` are its own.
            packed: the images' contexts in order (:meth:`pack`), ``sum(counts)``.

        Returns:
            ``[sum(counts), h*w, latent_dim]`` float32, in the order of ``packed``.
        """
        dtype = self.marker_embeds.dtype
        hw = xs[0].shape[0]
        latents = self.vae2llm(torch.cat(xs).to(dtype))[0].split(hw)
        times = self._embed_time(torch.tensor(ts, device=xs[0].device))
        hidden = torch.cat([
            self._framed(latent + times[i] + pos_embeds[i]).repeat(count, 1)
            for i, (latent, count) in enumerate(zip(latents, counts, strict=True))])
        for i, layer in enumerate(self.layers):
            hidden, _, _ = layer(hidden, packed.experts, packed.positions, self.rotary,
                                 packed.ctx_k[i], packed.ctx_v[i], packed.mask)
        out = self.llm2vae(self.norm_gen(hidden.index_select(0, packed.experts[1])))[0]
        return out.reshape(sum(counts), hw, -1).float()

    def forward_budget(self, images: int) -> tuple[int, int]:
        """What one forward of :meth:`advance` holds at most, the memory profile's forward
        (:meth:`profile_peak`) of ``images`` images: ``(query rows, attention rows)``, the
        three CFG branches of ``images`` images of the largest size (its latent tokens
        and two markers each) and their keys (the contexts of :func:`profile_contexts`,
        and the query)."""
        n = self.max_latent_size ** 2 + 2
        return (images * len(BRANCHES) * n,
                images * (sum(profile_contexts(self.config)) + len(BRANCHES) * n))

    # -- editing contexts -----------------------------------------------------------------
    def _extend(self, hidden: torch.Tensor, gen: torch.Tensor | None, position: int,
                context: tuple[torch.Tensor, torch.Tensor, int], causal: bool
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``context`` extended by the keys and values of the tokens ``hidden`` ``[n,
        hidden]`` (the model's dtype): the rows ``gen`` through the generation expert, the
        others through the understanding one, at RoPE positions from ``position`` (each
        token its own when ``causal``, else all of them ``position``), attending to the
        context and to each other (causally, or all to all)."""
        n, device = hidden.shape[0], hidden.device
        k_ctx, v_ctx, _ = context
        length = k_ctx.shape[1]
        rows = torch.arange(n, device=device)
        gen_rows = rows[gen] if gen is not None else rows[:0]
        und_rows = rows[~torch.isin(rows, gen_rows)]
        positions = position + rows if causal else torch.full_like(rows, position)
        mask = None
        if causal:
            mask = torch.ones(1, 1, n, length + n, dtype=torch.bool, device=device)
            mask[..., length:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            hidden, k, v = layer(hidden, (und_rows, gen_rows), positions, self.rotary,
                                 k_ctx[i][None], v_ctx[i][None], mask)
            keys.append(k.reshape(n, *k_ctx.shape[2:]))
            values.append(v.reshape(n, *v_ctx.shape[2:]))
        return (torch.cat([k_ctx, torch.stack(keys)], dim=1),
                torch.cat([v_ctx, torch.stack(values)], dim=1),
                int(positions[-1]) + 1)

    @torch.inference_mode()
    def edit_contexts(self, vae_pixels: list[torch.Tensor], vit_pixels: list[torch.Tensor],
                      eps: list[torch.Tensor], text_ids: torch.Tensor
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor, int],
                                 tuple[torch.Tensor, torch.Tensor, int]]:
        """An editing request's image context and full context, as the official
        ``update_context_image`` (per image) then ``update_context_text`` build them:
        each input image through the autoencoder (``<|vision_start|>``, its latent tokens
        at timestep 0 through the generation expert, ``<|vision_end|>``; one RoPE
        position, all to all), then through the ViT (the same markers around its ViT
        tokens, the understanding expert; the next RoPE position); then the
        instruction's tokens (causal, the understanding expert).

        Args:
            vae_pixels: per image ``[H, W, 3]`` uint8, at the autoencoder's size
                (:func:`~vllm_omni_plugin.models.bagel.editing.edit_images`).
            vit_pixels: per image ``[h, w, 3]`` uint8, at the ViT's size.
            eps: per image ``[z_channels, H / 8, W / 8]`` standard normal, the posterior
                draw of its latent (:meth:`FluxEncoder.latent`), any float dtype.
            text_ids: ``[T]`` int64, the instruction's token ids
                (``<|im_start|> instruction <|im_end|>``).

        Returns:
            ``(k, v, rope)`` of the image context (the text-unconditional CFG branch) and
            of the full one (``cond``): ``[layers, tokens, kv_heads, head_dim]`` keys
            (after RoPE) and values in the model's dtype, and the next RoPE position.

        Raises:
            RequestError: an image side that is not whole latent tokens or above the
                checkpoint's largest (field ``image``).
        """
        device, dtype = self.marker_embeds.device, self.marker_embeds.dtype
        attn = self.layers[0].und.self_attn
        empty = torch.zeros(len(self.layers), 0, attn.kv_size // attn.head_dim,
                            attn.head_dim, dtype=dtype, device=device)
        image = (empty, empty, 0)
        for vae, vit, draw in zip(vae_pixels, vit_pixels, eps, strict=True):
            image = self._image_blocks(vae, vit, draw, image)
        full = self._extend(self.embed_tokens(text_ids.to(device)).to(dtype), None,
                            image[2], image, causal=True)
        return image, full

    def _image_blocks(self, vae_pixels: torch.Tensor, vit_pixels: torch.Tensor,
                      eps: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor, int]
                      ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``context`` extended by one input image's autoencoder block and ViT block (see
        :meth:`edit_contexts`)."""
        device, dtype = self.marker_embeds.device, self.marker_embeds.dtype
        height, width = vae_pixels.shape[:2]
        try:
            check_image_size(self.config, width, height)
        except RequestError as exc:
            raise RequestError("image", exc.message) from None
        # the autoencoder's block: the latent (a posterior draw), patchified as decode
        # reads it, at timestep 0
        z = self.vae_encoder.latent(normalized(vae_pixels.to(device)).to(dtype),
                                    eps[None].to(device))[0]
        h, w, p = height // self.downsample, width // self.downsample, self.patch
        latent = z[:, :h * p, :w * p].reshape(self.z_channels, h, p, w, p)
        latent = latent.permute(1, 3, 2, 4, 0).reshape(h * w, self.latent_dim)
        tokens = (self.vae2llm(latent.to(dtype))[0]
                  + self._embed_time(torch.zeros(1, device=device))
                  + self._latent_pos_embed(height, width, device))
        context = self._extend(self._framed(tokens), torch.arange(1, h * w + 1, device=device),
                               context[2], context, causal=False)
        # the ViT's block
        tokens = self.vit(normalized(vit_pixels.to(device))).to(dtype)
        return self._extend(self._framed(tokens), None, context[2], context, causal=False)

    # -- sampling ------------------------------------------------------------------------
    def start(self, noise: torch.Tensor, height: int, width: int, guidance: Guidance,
              branches: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]
              ) -> DenoisingImage:
        """An image to denoise, for :meth:`advance`.

        Args:
            noise: ``[h*w, latent_dim]`` the initial latent, any float dtype (kept as
                float32), on the model's device.
            height: image height in pixels.
            width: image width in pixels.
            guidance: the CFG scales, interval, renormalisation and timesteps.
            branches: ``{branch: (k, v, rope)}`` for the names in :data:`BRANCHES`
                (``[layers, tokens, kv_heads, head_dim]`` keys and values in any float
                dtype, an int RoPE position), on the model's device.

        Raises:
            RequestError: a size not made of whole latent tokens (see
                :func:`check_image_size`).
            ValueError: ``noise`` does not have the image's shape, or a branch that a
                scale above 1 needs is missing (named).
        """
        check_image_size(self.config, width, height)
        hw = (height // self.downsample) * (width // self.downsample)
        if tuple(noise.shape) != (hw, self.latent_dim):
            raise ValueError(f"noise has shape {tuple(noise.shape)}, a {height}x{width} image "
                             f"needs ({hw}, {self.latent_dim})")
        needed = branches_for(guidance.cfg_text_scale, guidance.cfg_img_scale)
        missing = [name for name in needed if name not in branches]
        if missing:
            raise ValueError(f"the {', '.join(missing)} CFG branch is missing (guidance "
                             f"{guidance.cfg_text_scale}/{guidance.cfg_img_scale} needs it)")
        pos_embed = self._latent_pos_embed(height, width, noise.device)
        cond = branches.get("cond")
        same = frozenset(name for name, (k, v, rope) in branches.items()
                         if name != "cond" and cond is not None and rope == cond[2]
                         and k.shape == cond[0].shape and torch.equal(k, cond[0])
                         and torch.equal(v, cond[1]))
        return DenoisingImage(noise.float(), height, width, guidance,
                              guidance.timesteps().tolist(), pos_embed,
                              {n: b for n, b in branches.items() if n not in same},
                              next(self._serials), same)

    @torch.inference_mode()
    def advance(self, images: list[DenoisingImage], packs: dict, budget: int = 1) -> None:
        """One Euler step ``x <- x - v * (t_k - t_{k+1})`` of each image not done, each at
        its own timestep and guidance, images of one size sharing forwards up to
        :meth:`forward_budget` of ``budget`` images (in order; a longer context alone).

        Args:
            images: the images to advance (:meth:`start`).
            packs: the packed contexts of the previous call's forwards, by their images
                and branches (a dict this method keeps): a forward of the same images and
                branches reuses its pack; the others are dropped.
            budget: the images of the largest size a forward may hold (what the memory
                profile ran: the engine's ``max_num_seqs``).
        """
        rows, keys = self.forward_budget(budget)
        used = {}
        by_size: dict[tuple[int, int], list[DenoisingImage]] = {}
        for image in images:
            if not image.done:
                by_size.setdefault((image.height, image.width), []).append(image)
        for same_size in by_size.values():
            n = same_size[0].x.shape[0] + 2
            batch: list[tuple[DenoisingImage, tuple[str, ...]]] = []
            longest = 0
            for image in same_size:
                names = image.names()
                length = max(int(image.branches[b][0].shape[1]) for b in names)
                branches = sum(len(b) for _, b in batch) + len(names)
                if batch and (branches * n > rows
                              or branches * (max(longest, length) + n) > keys):
                    self._euler_step(batch, packs, used)
                    batch, longest = [], 0
                batch.append((image, names))
                longest = max(longest, length)
            self._euler_step(batch, packs, used)
        packs.clear()
        packs.update(used)

    def _euler_step(self, batch: list[tuple[DenoisingImage, tuple[str, ...]]], packs: dict,
                    used: dict) -> None:
        """One forward: the velocities of ``batch`` (images of one size, each with the
        branches it reads), then each image's guided velocity and Euler step."""
        key = tuple((image.serial, names) for image, names in batch)
        packed = packs.get(key) or self.pack(
            [image.branches[b] for image, names in batch for b in names],
            batch[0][0].x.shape[0], batch[0][0].x.device)
        used[key] = packed
        counts = [len(names) for _, names in batch]
        ts = [image.timesteps[image.step] for image, _ in batch]
        vs = self.velocities([image.x for image, _ in batch], ts,
                             [image.pos_embed for image, _ in batch], counts, packed)
        first = 0
        for (image, names), t, count in zip(batch, ts, counts, strict=True):
            v = dict(zip(names, vs[first:first + count], strict=True))
            v.update(dict.fromkeys(image.same_as_cond, v["cond"]))
            first += count
            text_scale, img_scale = image.guidance.scales_at(t)
            guided = guided_velocity(v["cond"], v.get("text_uncond"), v.get("img_uncond"),
                                     text_scale, img_scale, image.guidance.cfg_renorm_type,
                                     image.guidance.cfg_renorm_min)
            image.x = image.x - guided * (t - image.timesteps[image.step + 1])
            image.step += 1

    @torch.inference_mode()
    def generate(self, noise: torch.Tensor, height: int, width: int, guidance: Guidance,
                 branches: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one image: :meth:`start`, :meth:`advance` to its last timestep,
        :meth:`decode` (same arguments and errors as :meth:`start`).

        Returns:
            The final latent ``[h*w, latent_dim]`` float32 and the image ``[height, width,
            3]`` uint8.
        """
        image = self.start(noise, height, width, guidance, branches)
        packs: dict = {}
        while not image.done:
            self.advance([image], packs)
        return image.x, self.decode(image.x, height, width)

    @torch.inference_mode()
    def profile_peak(self, images: int = 1) -> None:
        """What the engine's memory profile must count: an editing request's contexts
        built at the largest sizes (:meth:`edit_contexts`); then the contexts of
        ``images`` images held at once, three CFG branches each as long as
        :func:`profile_contexts` says (the text-unconditional one a token shorter than it
        could be, so that the step runs masked attention, as with real contexts of
        different lengths: :func:`attend`); one denoising step of all of them in one
        forward (the most :meth:`advance` puts in one: :meth:`forward_budget`); then the
        decoder on one image."""
        side = max_image_side(self.config)
        hw = (side // self.downsample) ** 2
        device, dtype = self.marker_embeds.device, self.marker_embeds.dtype
        attn = self.layers[0].und.self_attn
        kv_heads = attn.kv_size // attn.head_dim
        lengths = profile_contexts(self.config)
        vit_side = self.vit.patch * self.vit.max_side
        logger.info("DiT: memory profile builds an editing context of a %dx%d image, then "
                    "holds %d images' contexts and runs a denoising step and the decoder "
                    "at %dx%d with %d CFG branches", side, side, images, side, side,
                    len(BRANCHES))
        down = int(autoencoder_config(self.config.vae_config)["downsample"])
        self.edit_contexts([torch.zeros(side, side, 3, dtype=torch.uint8)],
                           [torch.zeros(vit_side, vit_side, 3, dtype=torch.uint8)],
                           [torch.zeros(self.z_channels, side // down, side // down)],
                           torch.zeros(lengths[2], dtype=torch.int64))
        contexts = []  # each image's three, held until the step ran
        for _ in range(images):
            for i, length in enumerate(lengths):
                k, v = (torch.zeros(len(self.layers), length, kv_heads, attn.head_dim,
                                    dtype=dtype, device=device) for _ in range(2))
                short = int(i == 1)
                contexts.append((k[:, short:], v[:, short:], length - short))
        packed = self.pack(contexts, hw, device)
        pos_embed = self._latent_pos_embed(side, side, device)
        x = torch.zeros(hw, self.latent_dim, device=device)
        self.velocities([x] * images, [1.0] * images, [pos_embed] * images,
                        [len(BRANCHES)] * images, packed)
        self.decode(x, side, side)

    def decode(self, latent: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """``[h*w, p*p*z]`` latent -> ``[height, width, 3]`` uint8."""
        h, w, p = height // self.downsample, width // self.downsample, self.patch
        z = latent.reshape(h, w, p, p, self.z_channels).permute(4, 0, 2, 1, 3)
        z = z.reshape(1, self.z_channels, h * p, w * p)
        dtype = self.vae.conv_in.weight.dtype
        # channels-last, as its weights (load_weights): oneDNN's and cuDNN's faster
        # convolution layout, the same values (equal bytes on the CPU)
        z = z.to(dtype).contiguous(memory_format=torch.channels_last)
        return to_uint8_image(self.vae(z)[0])

    # -- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load BAGEL's ``ema.safetensors`` and ``ae.safetensors`` names (the
        understanding expert's final norm and ``lm_head`` are skipped; the ViT and its
        connector go to :class:`~vllm_omni_plugin.models.bagel.editing.BagelViT`).

        Raises:
            ValueError: a parameter has no weight, or the marker rows are missing.
        """
        own: list[tuple[str, torch.Tensor]] = []
        vit: list[tuple[str, torch.Tensor]] = []
        markers = None
        for name, tensor in weights:
            mapped = _map_weight(name)
            if mapped == "embed_tokens.weight":
                markers = tensor[list(self.marker_ids)]
            if mapped is not None and mapped.startswith("vit."):
                vit.append((mapped[len("vit."):], tensor))
            elif mapped is not None:
                own.append((mapped, tensor))
        if markers is None:
            raise ValueError("the checkpoint lacks language_model.model.embed_tokens.weight")
        self.marker_embeds.copy_(markers.to(self.marker_embeds.dtype))
        loaded = load_stacked(self, own, [n for n, _ in self.named_parameters()
                                          if not n.startswith("vit.")],
                              owner=type(self).__name__)
        loaded |= {f"vit.{name}" for name in self.vit.load_weights(vit)}
        self.vae.to(memory_format=torch.channels_last)
        self.vae_encoder.to(memory_format=torch.channels_last)
        return loaded


def _map_weight(name: str) -> str | None:
    """A BAGEL checkpoint name -> :class:`BagelDiT`'s (``vit.*`` for the ViT and its
    connector, in their checkpoint names), or None for a weight the DiT does not use."""
    if name.startswith("decoder."):
        return "vae." + name[len("decoder."):]
    if name.startswith("encoder."):
        return "vae_encoder." + name[len("encoder."):]
    if name.startswith(("vit_model.", "connector.")):
        return "vit." + name
    for keep in ("time_embedder.mlp.", "vae2llm.", "llm2vae."):
        if name.startswith(keep):
            return name.replace("time_embedder.mlp.", "time_embedder.")
    prefix = "language_model.model."
    if not name.startswith(prefix):
        return None  # lm_head, the position tables (fixed sin-cos, computed)
    name = name[len(prefix):]
    if name == "embed_tokens.weight":
        return name
    if name.startswith("norm_moe_gen."):
        return "norm_gen." + name[len("norm_moe_gen."):]
    if not name.startswith("layers."):
        return None  # the understanding expert's final norm
    layer, _, rest = name[len("layers."):].partition(".")
    expert = "gen" if "_moe_gen" in rest else "und"
    return f"layers.{layer}.{expert}.{rest.replace('_moe_gen', '')}"


def profile_contexts(config) -> tuple[int, int, int]:
    """The context tokens the memory profile gives an image's CFG branches (``cond``,
    ``text_uncond``, ``img_uncond``): an editing request's at the largest sizes, its
    input image through the autoencoder and the ViT (``max_latent_size ** 2`` and
    ``vit_max_num_patch_per_side ** 2`` tokens, two markers each) and an instruction as
    long as the image's latent tokens (the allowance a text-to-image context gets too);
    the image alone; the instruction alone."""
    latents = int(config.max_latent_size) ** 2
    image = latents + 2 + int(config.vit_max_num_patch_per_side) ** 2 + 2
    return image + latents, image, latents


def check_image_size(config, width: int, height: int) -> None:
    """Raises :class:`RequestError` (field ``size``) unless both sides are multiples of
    the latent token (16 px for BAGEL) between one token and :func:`max_image_side`."""
    token, biggest = latent_token_pixels(config), max_image_side(config)
    for side in (width, height):
        if side % token or not token <= side <= biggest:
            raise RequestError("size", f"{width}x{height}: each side must be a multiple of "
                               f"{token} between {token} and {biggest}")


def initial_noise(seed: int, height: int, width: int, config) -> torch.Tensor:
    """``[h*w, p*p*z]`` float32 standard normal noise, drawn on the CPU from
    ``torch.Generator().manual_seed(seed)``: the official code's first draw after
    ``torch.manual_seed(seed)``, so a seed gives the official image, on any replica and
    device."""
    return _latent_noise(torch.Generator().manual_seed(seed), height, width, config)


def edit_noise(seed: int, image_sizes: list[tuple[int, int]], height: int, width: int,
               config) -> tuple[list[torch.Tensor], torch.Tensor]:
    """An editing request's draws from ``seed``, in the official code's order: the
    autoencoder's posterior draw for each input image (``image_sizes``: ``(H, W)`` pixels
    at the autoencoder's size), ``[z, H / 8, W / 8]`` each, then the initial latent of
    the ``height`` x ``width`` image, as :func:`initial_noise`; all float32, on the
    CPU."""
    generator = torch.Generator().manual_seed(seed)
    down = int(config.vae_config.get("downsample", 8))
    z = int(config.vae_config.get("z_channels", 16))
    eps = [torch.randn(z, h // down, w // down, generator=generator) for h, w in image_sizes]
    return eps, _latent_noise(generator, height, width, config)


def _latent_noise(generator: torch.Generator, height: int, width: int, config
                  ) -> torch.Tensor:
    patch = int(config.latent_patch_size)
    token = latent_token_pixels(config)
    dim = patch * patch * int(config.vae_config.get("z_channels", 16))
    return torch.randn((height // token) * (width // token), dim, generator=generator)


def generation_payload(noise: torch.Tensor, height: int, width: int, guidance: Guidance,
                       branches: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]],
                       edit: Mapping[str, torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
    """The DiT stage's input payload (see the module docstring); ``branches`` maps names
    of :data:`BRANCHES` to ``(k, v, rope)``; ``edit`` an editing request's input
    (``vae.{i}``, ``vit.{i}``, ``eps.{i}`` per image and ``text_ids``: see the module
    docstring), stored as ``edit.<name>``.

    ``noise`` ``[h*w, p*p*z]`` and each ``k``, ``v`` ``[layers, tokens, kv_heads,
    head_dim]`` may be any float dtype: they are stored as float32 copies; ``size`` and
    each ``{branch}.rope`` are int64, ``guidance`` ``[8]`` float64.

    Raises:
        ValueError: a branch name not in :data:`BRANCHES`.
    """
    payload = {"noise": noise.detach().to(torch.float32).clone(),
               "size": torch.tensor([height, width]),
               "guidance": guidance.to_tensor()}
    for name, (k, v, rope) in branches.items():
        if name not in BRANCHES:
            raise ValueError(f"unknown CFG branch {name!r}; expected one of {BRANCHES}")
        # copies: branches may share one context (safetensors refuses shared storage)
        payload[f"{name}.k"] = k.detach().to(torch.float32).clone()
        payload[f"{name}.v"] = v.detach().to(torch.float32).clone()
        payload[f"{name}.rope"] = torch.tensor([int(rope)])
    for name, tensor in (edit or {}).items():
        payload[f"edit.{name}"] = tensor
    return payload


class BagelDiTStage(nn.Module):
    """The DiT stage as a vLLM model (a BAGEL checkpoint; see the module docstring).

    The model works only inside an engine step the plugin's worker binds to
    :attr:`stage_step`; vLLM's own dummy and profiling forwards return zeros, after
    running :meth:`BagelDiT.profile_peak` in the engine's memory profile
    (``stage_profiling``, set by the worker). A request whose payload is unusable fails
    alone (its error names what is wrong).
    """

    uses_stage_step = True

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from transformers import AutoTokenizer

        model_config = vllm_config.model_config
        config = model_config.hf_config
        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, revision=model_config.tokenizer_revision,
            trust_remote_code=model_config.trust_remote_code)
        markers = tuple(tokenizer.convert_tokens_to_ids(t)
                        for t in ("<|vision_start|>", "<|vision_end|>"))
        if any(m is None or m == tokenizer.unk_token_id for m in markers):
            raise ValueError("the tokenizer lacks <|vision_start|> / <|vision_end|>")
        self.dit = BagelDiT(config, markers)
        #: images one step advances at most: the engine's max_num_seqs (one a request)
        self.max_images_per_step = int(vllm_config.scheduler_config.max_num_seqs)
        self.vocab_size = config.llm_config.vocab_size
        self.stage_step = None
        self.stage_profiling = False
        self._outputs: dict[str, dict[str, torch.Tensor]] = {}
        #: the images being denoised, by request id, and their packed contexts
        self._images: dict[str, DenoisingImage] = {}
        self._packs: dict = {}

    @classmethod
    def plan_profile(cls, vllm_config) -> tuple[int, int]:
        """What vLLM's memory profile runs here (:meth:`BagelDiT.profile_peak`), for
        :mod:`vllm_omni_plugin.tools.plan`: ``(tokens, extra_bytes)``, the tokens one
        denoising step of ``max_num_seqs`` images of the largest size feeds the
        transformer at once (per image its three contexts, :func:`profile_contexts`, and
        three times its latents); beyond them those images' contexts (keys and values of
        every layer) and the FLUX decoder's widest activations at full resolution (four
        ``side ** 2 x ch`` tensors), at the model's dtype."""
        model_config = vllm_config.model_config
        config = model_config.hf_config
        llm = config.llm_config
        latents = int(config.max_latent_size) ** 2
        side = max_image_side(config)
        ch = int(autoencoder_config(config.vae_config)["ch"])
        head_dim = llm.hidden_size // llm.num_attention_heads
        images = int(vllm_config.scheduler_config.max_num_seqs)
        context = sum(profile_contexts(config))
        contexts = (images * 2 * llm.num_hidden_layers * context
                    * llm.num_key_value_heads * head_dim)
        return (images * (context + len(BRANCHES) * latents),
                (contexts + 4 * side * side * ch) * model_config.dtype.itemsize)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` placeholder ids (any dtype; only their count is read) -> ``[n, hidden]``
        zeros in the model's dtype (the prompt carries nothing)."""
        return self.dit.marker_embeds.new_zeros(input_ids.shape[0], self.dit.hidden_size)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        """Advance the image of every request this step schedules by one Euler step
        (starting the images of the requests it prefills, decoding those it finishes);
        returns ``[num_tokens, 1]`` zeros in the model's dtype. ``input_ids``
        ``[num_tokens]`` (int32 from vLLM's runner) and ``inputs_embeds`` are not read;
        ``positions`` ``[num_tokens]`` int64 gives only the count and device.

        At most :attr:`max_images_per_step` images (the engine's ``max_num_seqs``, which
        vLLM's scheduler keeps to); a request beyond it fails with an error naming the
        bound rather than lengthening the step. A request that fails (a bad payload, a
        ``max_tokens`` that is not its Euler steps) fails alone; one whose forward fails
        fails with the images it shared that forward with."""
        self._outputs = {}
        out = torch.zeros(positions.shape[-1], 1, dtype=self.dit.marker_embeds.dtype,
                          device=positions.device)
        step = self.stage_step
        if step is None:
            if self.stage_profiling:
                self.dit.profile_peak(self.max_images_per_step)
            return out
        for req_id in step.finished:  # finished or aborted meanwhile
            self._images.pop(req_id, None)
        scheduled = [r for r in step.requests()
                     if r.num_prompt_tokens and not step.failed(r.req_id)]
        for r in scheduled[self.max_images_per_step:]:
            step.fail(r.req_id, RuntimeError(
                f"the DiT step holds {len(scheduled)} images, more than its max_num_seqs "
                f"({self.max_images_per_step}), which bounds its time"))
        active: dict[str, DenoisingImage] = {}
        for r in scheduled[:self.max_images_per_step]:
            image = self._images.get(r.req_id)
            if image is None and r.num_computed < r.num_prompt_tokens:  # its first step
                try:
                    image = self._start(step.inputs(r.req_id), step.params(r.req_id))
                except Exception as exc:
                    step.fail(r.req_id, exc)
                    continue
                self._images[r.req_id] = image
            if image is not None:  # (None: a step vLLM scheduled after its last)
                active[r.req_id] = image
        try:
            self.dit.advance(list(active.values()), self._packs, self.max_images_per_step)
        except Exception as exc:
            for req_id in active:
                self._images.pop(req_id)
                step.fail(req_id, exc)
            return out
        for req_id, image in active.items():
            if not image.done:
                continue
            del self._images[req_id]
            try:
                self._outputs[req_id] = {
                    "latent": image.x.cpu(),
                    "image": self.dit.decode(image.x, image.height, image.width).cpu()}
            except Exception as exc:
                step.fail(req_id, exc)
        return out

    def _start(self, payload: Mapping[str, torch.Tensor], params) -> DenoisingImage:
        """A request's image from its input payload (see the module docstring) and its
        ``SamplingParams`` (None: not checked).

        Raises:
            ValueError: a payload entry is missing or malformed, or ``max_tokens`` is not
                the image's Euler steps.
            RequestError: a field of the guidance or the size is out of range.
        """
        for name in ("noise", "size", "guidance"):
            if name not in payload:
                raise ValueError(f"DiT input payload lacks {name!r}")
        height, width = (int(v) for v in payload["size"].reshape(-1)[:2])
        guidance = Guidance.from_tensor(payload["guidance"])
        steps = guidance.num_timesteps - 1
        if params is not None and params.max_tokens != steps:
            raise ValueError(f"max_tokens is {params.max_tokens}; an image of "
                             f"{guidance.num_timesteps} timesteps takes {steps} engine "
                             "steps (one per Euler step), its max_tokens")
        device = self.dit.marker_embeds.device
        layers = len(self.dit.layers)
        branches = {}
        for name in BRANCHES:
            if f"{name}.k" not in payload:
                continue
            k, v = payload[f"{name}.k"], payload[f"{name}.v"]
            if k.dim() != 4 or k.shape[0] != layers or k.shape != v.shape:
                raise ValueError(f"DiT input {name}.k/{name}.v: shapes {tuple(k.shape)} / "
                                 f"{tuple(v.shape)}, expected [{layers}, tokens, kv_heads, "
                                 "head_dim] each")
            branches[name] = (k.to(device), v.to(device), int(payload[f"{name}.rope"][0]))
        images = next(i for i in itertools.count() if f"edit.vae.{i}" not in payload)
        if images:  # editing: cond and text_uncond from the input images
            branches["text_uncond"], branches["cond"] = self.dit.edit_contexts(
                *([payload[f"edit.{name}.{i}"] for i in range(images)]
                  for name in ("vae", "vit", "eps")), payload["edit.text_ids"])
        return self.dit.start(payload["noise"].to(device), height, width, guidance, branches)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` float32 zeros: the sampled token is a dummy that ends the
        request."""
        return torch.zeros(hidden_states.shape[0], self.vocab_size, dtype=torch.float32,
                           device=hidden_states.device)

    def stage_output_requests(self) -> dict[str, dict[str, torch.Tensor]]:
        """Outputs of the last forward by request id, for the images it finished:
        ``latent`` ``[h*w, p*p*z]`` float32, ``image`` ``[H, W, 3]`` uint8."""
        return self._outputs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """See :meth:`BagelDiT.load_weights`."""
        return {f"dit.{name}" for name in self.dit.load_weights(weights)}
