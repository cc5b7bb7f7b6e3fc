"""Qwen3-Omni code2wav stage: codec codes -> waveform, as a vLLM model on vLLM's model runner.

The stage is non-autoregressive: a request's whole input arrives as its prompt and one
forward turns it into audio. The request is served by vLLM's own engine, scheduler and
model runner (the plugin's ``OmniWorker``), batched across requests like any model:

* **Prompt.** The talker's codes ``[T, num_quantizers]`` are sent frame-major as token ids
  ``q * codebook_size + codes[t, q]`` (:func:`code2wav_prompt_ids`; prompt length
  ``num_quantizers * T``). These are exactly the rows of HF's ``code_embedding`` table
  that HF looks up (``codes + code_offset``), so vLLM validates them against the
  vocabulary ``num_quantizers * codebook_size``
  (:meth:`Qwen3OmniCode2WavStage.engine_hf_overrides`).
* **Forward.** For every request of the step (read from the ``StageStep`` the worker binds
  to ``model.stage_step``), the waveform HF ``Qwen3OmniMoeCode2Wav.chunked_decode(codes,
  chunk_size=300, left_context_size=25)`` returns, computed here: the step's chunks of all
  requests in one right-padded batch (code2wav is causal, so padding after a chunk does
  not change its samples), each request's chunks then cut and joined as HF does. A request
  whose input payload has ``left_context`` ``c`` (one chunk of a streamed request) starts
  that loop at frame ``c``: it returns the samples of its frames after the first ``c``,
  computed with up to 25 of those as left context, as HF's loop does for a chunk, plus the
  context's last samples that a decode ending there drops (HF's loop leaves that gap,
  555 samples at 24 kHz, at each chunk boundary): a request's chunks, joined, have the
  samples of the whole request decoded at once.
* **Output.** :meth:`Qwen3OmniCode2WavStage.stage_output_requests` gives each request's
  ``waveform`` ``[num_samples]`` float32 in ``[-1, 1]`` and ``sample_rate`` ``[1]`` int64
  (Hz, :func:`sample_rate`); the worker publishes them. The token vLLM samples (logits are
  all zero) is a dummy; with ``max_tokens=1`` it ends the request.

The model has no paged attention layer (vLLM sees no KV cache) and no autoregressive
state. The pre-transformer is built from vLLM's layers (parallel linear layers, RMSNorm,
rotary embedding, activation) with a causal sliding-window attention computed in one shot
by ``torch.nn.functional.scaled_dot_product_attention``; the convolutional upsampler and
decoder, which vLLM has no layers for, are transformers' own modules.

Engine settings: ``enable_chunked_prefill: false``, ``enable_prefix_caching: false``,
``max_tokens=1``. vLLM's engine core turns chunked prefill off by itself for a model
without KV cache, whatever the engine args say, so a prompt longer than
``max_num_batched_tokens`` would never be scheduled (its request waits forever); with
``enable_chunked_prefill: false`` vLLM defaults ``max_num_batched_tokens`` to
``max_model_len`` and refuses a smaller one. Prefix caching would skip prompt positions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import get_act_and_mul_fn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsMRoPE

from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.models.qwen3_omni.talker_inputs import (
    HF_CODE2WAV_CHUNK_SIZE,
    HF_CODE2WAV_LEFT_CONTEXT,
)
from vllm_omni_plugin.models.weights import load_stacked

logger = init_logger(__name__)

#: Qwen3-Omni's codec decodes to 24 kHz audio (1920 samples per code frame,
#: 12.5 frames/s). HF's code2wav config has no rate field; checkpoints may set
#: ``code2wav_config.output_sample_rate`` (the tiny-checkpoint tool does).
SAMPLE_RATE = 24000

#: Longest code sequence (frames) an engine accepts by default: HF ``generate``'s
#: ``talker_max_new_tokens`` default. Sets the engine's ``max_model_len`` (see
#: :meth:`Qwen3OmniCode2WavStage.engine_hf_overrides`); a stage's ``max_model_len``
#: engine arg can lower it.
MAX_FRAMES = 4096

#: Prefix of this stage's weights in a Qwen3-Omni checkpoint.
WEIGHT_PREFIX = "code2wav."

#: Input payload of a request that is one chunk of a streamed request: ``[1]`` int64, its
#: leading frames that are left context only (decoded, their samples dropped).
LEFT_CONTEXT_INPUT = "left_context"


def sample_rate(hf_config) -> int:
    """Output sample rate in Hz of the checkpoint's code2wav."""
    return int(getattr(hf_config.code2wav_config, "output_sample_rate", SAMPLE_RATE) or SAMPLE_RATE)


def _code2wav_config(config):
    """The code2wav config of a Qwen3-Omni config, or ``config`` itself if it is one."""
    return getattr(config, "code2wav_config", config)


# -- prompt encoding ---------------------------------------------------------------
def code2wav_prompt_ids(codes: torch.Tensor, config) -> list[int]:
    """The code2wav request's prompt: codes as token ids, frame-major.

    Args:
        codes: ``[T, num_quantizers]`` integer codec codes (the talker's frames), each in
            ``[0, codebook_size)``; ``T >= 1``.
        config: the Qwen3-Omni config (or its ``code2wav_config``).

    Returns:
        ``num_quantizers * T`` ids, ``id = q * codebook_size + codes[t, q]`` for ``t`` in
        ``0..T-1`` (outer), ``q`` in ``0..num_quantizers-1`` (inner); each in
        ``[0, num_quantizers * codebook_size)``.

    Raises:
        ValueError: ``codes`` is not a non-empty ``[T, num_quantizers]`` integer tensor, or
            a code is outside ``[0, codebook_size)``.
    """
    cfg = _code2wav_config(config)
    nq, cb = int(cfg.num_quantizers), int(cfg.codebook_size)
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.shape[1] != nq \
            or codes.shape[0] == 0:
        shape = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise ValueError(f"code2wav codes must be [T >= 1, {nq}], got {shape}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ValueError(f"code2wav codes must be integers, got {codes.dtype}")
    codes = codes.to(torch.long)
    low, high = int(codes.min()), int(codes.max())
    if low < 0 or high >= cb:
        raise ValueError(f"code2wav codes must be in [0, {cb}), got values in [{low}, {high}]")
    offsets = torch.arange(nq, dtype=torch.long, device=codes.device) * cb
    return (codes + offsets).reshape(-1).tolist()


def codes_from_prompt_ids(ids: torch.Tensor, config) -> torch.Tensor:
    """Inverse of :func:`code2wav_prompt_ids`.

    Args:
        ids: ``[num_quantizers * T]`` integer token ids (a request's prompt).
        config: the Qwen3-Omni config (or its ``code2wav_config``).

    Returns:
        ``[T, num_quantizers]`` int64 codes in ``[0, codebook_size)``, on ``ids``'s device.

    Raises:
        ValueError: the length is not a positive multiple of ``num_quantizers``, or an id is
            not ``q * codebook_size + code`` for its quantizer ``q = index % num_quantizers``.
    """
    cfg = _code2wav_config(config)
    nq, cb = int(cfg.num_quantizers), int(cfg.codebook_size)
    ids = ids.reshape(-1).to(torch.long)
    n = ids.numel()
    if n == 0 or n % nq:
        raise ValueError(f"a code2wav prompt holds {nq} ids per codec frame; got {n} ids "
                         f"(not a positive multiple of {nq})")
    frames = ids.view(-1, nq)
    quantizer = torch.div(frames, cb, rounding_mode="floor")
    expected = torch.arange(nq, dtype=torch.long, device=ids.device)
    bad = (quantizer != expected) | (frames < 0)
    if bool(bad.any()):
        t, q = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"code2wav prompt id {int(frames[t, q])} at frame {t}, quantizer {q} is not in "
            f"[{q * cb}, {(q + 1) * cb}) (ids are q * {cb} + code)")
    return frames - expected * cb


# -- HF's chunked decode schedule ----------------------------------------------------
@dataclass(frozen=True)
class _Segment:
    """One forward of HF ``chunked_decode``: frames ``[begin, end)`` of a request, of
    which the first ``context`` are left context whose samples are dropped. ``refill``: keep
    the context's last samples that a decode ending at ``begin + context`` cannot compute
    (its convolutions drop them; see :meth:`Qwen3OmniCode2Wav.num_samples`), so that the
    chunks of a streamed request tile the waveform without gaps."""

    begin: int
    end: int
    context: int
    refill: bool = False


def chunk_schedule(num_frames: int, chunk_size: int = HF_CODE2WAV_CHUNK_SIZE,
                   left_context: int = HF_CODE2WAV_LEFT_CONTEXT,
                   first: int = 0) -> list[_Segment]:
    """The forwards HF ``Qwen3OmniMoeCode2Wav.chunked_decode`` runs on ``num_frames``
    frames, in order (its loop, without the model), starting at frame ``first``: the
    frames before it are context only (a chunk of a streamed request, see
    :data:`LEFT_CONTEXT_INPUT`), and the first forward refills what the previous chunk's
    decode dropped."""
    segments, start = [], first
    while start < num_frames:
        end = min(start + chunk_size, num_frames)
        context = left_context if start - left_context > 0 else start
        segments.append(_Segment(start - context, end, context,
                                 refill=start == first and first > 0))
        start = end
    return segments


# -- the pre-transformer, on vLLM's layers ---------------------------------------------
class Code2WavAttention(nn.Module):
    """Causal sliding-window self-attention over right-padded sequences (no KV cache).

    Input and output: ``[batch * frames, hidden]`` rows, sequence-major; positions restart
    at 0 for every sequence.
    """

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        total_heads, total_kv = config.num_attention_heads, config.num_key_value_heads
        if total_heads % tp or (total_kv % tp if total_kv >= tp else tp % total_kv):
            raise ValueError(f"code2wav: {total_heads} attention / {total_kv} kv heads do "
                             f"not split over tensor parallel size {tp}")
        self.num_heads = total_heads // tp
        self.num_kv_heads = max(1, total_kv // tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.sliding_window = config.sliding_window
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads,
                                          total_kv, bias=config.attention_bias,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings,
                                   is_neox_style=True,
                                   rope_parameters=dict(config.rope_parameters))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: int,
                mask: torch.Tensor | None) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        frames = x.shape[0] // batch

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.reshape(batch, frames, n, self.head_dim).transpose(1, 2)

        q, k, v = heads(q, self.num_heads), heads(k, self.num_kv_heads), \
            heads(v, self.num_kv_heads)
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(batch * frames, self.q_size)
        out, _ = self.o_proj(out)
        return out


class Code2WavMLP(nn.Module):
    def __init__(self, config, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=False, prefix=f"{prefix}.down_proj")
        self.act_fn = get_act_and_mul_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


class Code2WavTransformerLayer(nn.Module):
    """HF ``Qwen3OmniMoeCode2WavTransformerLayer``: pre-norm attention and MLP, each
    residual branch scaled by a learnt per-channel layer scale."""

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        self.self_attn = Code2WavAttention(config, prefix=f"{prefix}.self_attn")
        self.mlp = Code2WavMLP(config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn_layer_scale = hf.Qwen3OmniMoeCode2WavLayerScale(config)
        self.mlp_layer_scale = hf.Qwen3OmniMoeCode2WavLayerScale(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: int,
                mask: torch.Tensor | None) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, batch, mask)
        x = x + self.self_attn_layer_scale(h)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + self.mlp_layer_scale(h)


class Code2WavTransformer(nn.Module):
    """HF ``Qwen3OmniMoeCode2WavTransformerModel`` (sliding-window layers, final norm)."""

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        if any(t != "sliding_attention" for t in getattr(config, "layer_types", ())):
            raise ValueError(f"code2wav: only sliding-attention layers are supported, "
                             f"got layer_types {config.layer_types}")
        self.sliding_window = config.sliding_window
        self.layers = nn.ModuleList(
            Code2WavTransformerLayer(config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, frames, hidden]`` -> ``[batch, frames, hidden]`` (causal: frame ``t``
        of the output depends on input frames ``<= t`` only)."""
        batch, frames, hidden = x.shape
        idx = torch.arange(frames, device=x.device)
        distance = idx[:, None] - idx[None, :]  # query - key
        mask = (distance >= 0)
        if self.sliding_window is not None:
            mask &= distance < self.sliding_window
        positions = idx.repeat(batch)
        h = x.reshape(batch * frames, hidden)
        for layer in self.layers:
            h = layer(h, positions, batch, mask)
        return self.norm(h).view(batch, frames, hidden)


# -- the whole codec decoder -----------------------------------------------------------
def _length_after(module: nn.Module, n: int) -> int:
    """Time steps out of ``module`` (an HF code2wav block) for ``n`` in."""
    if isinstance(module, hf.Qwen3OmniMoeCausalTransConvNet):
        conv = module.conv
        full = ((n - 1) * conv.stride[0] + conv.dilation[0] * (conv.kernel_size[0] - 1) + 1
                + conv.output_padding[0])
        return full - module.left_pad - module.right_pad
    if isinstance(module, hf.Qwen3OmniMoeCausalConvNet):
        # HF pads to a whole number of strides: ceil((n - kernel + padding) / stride) + 1
        return -(-(n - module.kernel_size + module.padding) // module.stride) + 1
    for child in module.children():  # registered in forward order (residual units keep n)
        n = _length_after(child, n)
    return n


def _right_padding_is_exact(module: nn.Module) -> bool:
    """True when every convolution is causal, so frames appended after a sequence do not
    change its outputs: stride-1 causal convs (their right padding is 0) and transposed
    convs that trim at least ``kernel - stride`` samples on the right (and no other
    convolution)."""
    causal = (hf.Qwen3OmniMoeCausalConvNet, hf.Qwen3OmniMoeCausalTransConvNet)
    wrapped = {id(m.conv) for m in module.modules() if isinstance(m, causal)}
    if any(isinstance(m, nn.modules.conv._ConvNd) and id(m) not in wrapped
           for m in module.modules()):
        return False
    for m in module.modules():
        if isinstance(m, hf.Qwen3OmniMoeCausalConvNet) and m.stride != 1:
            return False
        if isinstance(m, hf.Qwen3OmniMoeCausalTransConvNet):
            kernel = m.conv.dilation[0] * (m.conv.kernel_size[0] - 1) + 1
            if m.right_pad < kernel - m.conv.stride[0]:
                return False
    return True


class Qwen3OmniCode2Wav(nn.Module):
    """HF ``Qwen3OmniMoeCode2Wav`` with the pre-transformer on vLLM's layers.

    Parameter names equal HF's (``qkv_proj`` / ``gate_up_proj`` fuse HF's q/k/v and
    gate/up projections).
    """

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        self.config = config
        self.num_quantizers = int(config.num_quantizers)
        self.codebook_size = int(config.codebook_size)
        self.total_upsample = int(math.prod(list(config.upsample_rates)
                                            + list(config.upsampling_ratios)))
        self.code_embedding = VocabParallelEmbedding(
            self.codebook_size * self.num_quantizers, config.hidden_size,
            prefix=f"{prefix}.code_embedding")
        self.register_buffer("code_offset", torch.arange(self.num_quantizers) * self.codebook_size,
                             persistent=False)
        self.pre_transformer = Code2WavTransformer(config, prefix=f"{prefix}.pre_transformer")
        # the convolutional parts are transformers' modules, built as HF builds them
        dtype = torch.get_default_dtype()
        self.upsample = nn.ModuleList(
            nn.ModuleList([
                hf.Qwen3OmniMoeCausalTransConvNet(config.hidden_size, config.hidden_size,
                                                  factor, factor),
                hf.Qwen3OmniMoeConvNeXtBlock(config.hidden_size),
            ]) for factor in config.upsampling_ratios).to(dtype)
        decoder = [hf.Qwen3OmniMoeCausalConvNet(config.hidden_size, config.decoder_dim, 7)]
        decoder += [hf.Qwen3OmniMoeCode2WavDecoderBlock(config, i)
                    for i in range(len(config.upsample_rates))]
        output_dim = config.decoder_dim // 2 ** len(config.upsample_rates)
        decoder += [hf.Qwen3OmniMoeSnakeBeta(output_dim),
                    hf.Qwen3OmniMoeCausalConvNet(output_dim, 1, 7)]
        self.decoder = nn.ModuleList(decoder).to(dtype)
        #: padding a batch on the right leaves each sequence's samples unchanged
        self.right_padding_is_exact = _right_padding_is_exact(self)

    def num_samples(self, num_frames: int) -> int:
        """Samples HF's ``forward`` returns for ``num_frames`` frames (slightly fewer than
        ``num_frames * total_upsample``: the transposed convolutions drop a few)."""
        n = num_frames
        for block in (*self.upsample, *self.decoder):
            n = _length_after(block, n)
        return n

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """HF ``Qwen3OmniMoeCode2Wav.forward`` on a batch of equal-length sequences.

        Args:
            codes: ``[batch, frames, num_quantizers]`` int64 codes in ``[0, codebook_size)``
                (HF takes ``[batch, num_quantizers, frames]``).

        Returns:
            ``[batch, num_samples(frames)]`` waveforms in ``[-1, 1]`` (model dtype).
        """
        batch, frames, nq = codes.shape
        rows = (codes + self.code_offset).reshape(-1)
        hidden = self.code_embedding(rows).view(batch, frames, nq, -1).mean(2)
        hidden = self.pre_transformer(hidden).permute(0, 2, 1)
        for blocks in self.upsample:
            for block in blocks:
                hidden = block(hidden)
        wav = hidden
        for block in self.decoder:
            wav = block(wav)
        return wav.clamp(min=-1, max=1).squeeze(1)


@dataclass
class _Job:
    """One request being decoded in a step."""

    req_id: str
    codes: torch.Tensor  # [T, num_quantizers]
    pieces: dict[int, torch.Tensor] | None  # segment index -> samples kept; None: failed
    context: int = 0  # leading frames that are left context only


def _left_context(step, req_id: str, codes: torch.Tensor) -> int:
    """The request's leading context frames (input payload :data:`LEFT_CONTEXT_INPUT`).

    Raises:
        ValueError: not fewer than the request's frames.
    """
    value = step.inputs(req_id).get(LEFT_CONTEXT_INPUT)
    context = int(value.reshape(-1)[0]) if value is not None else 0
    if not 0 <= context < codes.shape[0]:
        raise ValueError(f"{LEFT_CONTEXT_INPUT} {context} is not in [0, {codes.shape[0]}) "
                         "(the request's frames)")
    return context


class Qwen3OmniCode2WavStage(nn.Module, SupportsMRoPE):
    """The code2wav stage as a vLLM model (checkpoint prefix ``code2wav.``).

    The model does its real work only inside an engine step the plugin's worker binds to
    :attr:`stage_step` (see the module docstring); vLLM's own dummy and profiling forwards
    (``stage_step`` None) return zeros.

    Attributes:
        uses_stage_step: tells the worker to bind a ``StageStep`` around each forward.
        max_batch_frames: a bound on ``batch * frames`` of one padded decoder call (frames
            include padding); a step's chunks beyond it run in several calls.
    """

    uses_stage_step = True
    max_batch_frames = 4 * (HF_CODE2WAV_CHUNK_SIZE + HF_CODE2WAV_LEFT_CONTEXT)

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.hf_config = vllm_config.model_config.hf_config
        self.config = self.hf_config.code2wav_config
        self.vocab_size = int(self.config.num_quantizers) * int(self.config.codebook_size)
        self.sample_rate = sample_rate(self.hf_config)
        self.code2wav = Qwen3OmniCode2Wav(self.config, prefix="code2wav")
        #: the step being executed (bound by the worker), or None
        self.stage_step = None
        self._outputs: dict[str, dict[str, torch.Tensor]] = {}

    # -- engine configuration ---------------------------------------------------------
    @classmethod
    def engine_hf_overrides(cls, hf_config) -> dict:
        """``hf_overrides`` this stage's engine needs.

        vLLM reads a Qwen3-Omni checkpoint's text config from ``thinker_config.text_config``
        for every engine: it validates prompt ids against its ``vocab_size`` (here the code
        embedding rows, ``num_quantizers * codebook_size``) and derives ``max_model_len``
        from its ``max_position_embeddings`` (here a prompt of :data:`MAX_FRAMES` frames
        plus the one sampled token). Nothing else reads the thinker config in this stage.
        """
        cfg = hf_config.code2wav_config
        nq = int(cfg.num_quantizers)
        return {"thinker_config": {"text_config": {
            "vocab_size": nq * int(cfg.codebook_size),
            "max_position_embeddings": nq * MAX_FRAMES + 1,
        }}}

    # -- vLLM model interface -----------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` prompt ids -> ``[n, hidden]`` rows of the code embedding."""
        return self.code2wav.code_embedding(input_ids)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list
                                  ) -> tuple[torch.Tensor, int]:
        """vLLM treats this engine as M-RoPE (the thinker's text config has
        ``mrope_section``): plain positions ``[3, len(input_tokens)]`` int64, delta 0.
        The model ignores them (each decoder chunk numbers its own frames)."""
        positions = torch.arange(len(input_tokens), dtype=torch.long)
        return positions.unsqueeze(0).expand(3, -1).clone(), 0

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        """Decode the step's requests; returns ``[num_tokens, 1]`` zeros (model dtype).

        Each request's waveform is kept for :meth:`stage_output_requests`. A request whose
        prompt is not valid codes, or arrives split over steps (chunked prefill), is
        failed alone through the step; the other requests go on.
        """
        self._outputs = {}
        num_tokens = positions.shape[-1]
        dtype = self.code2wav.code_embedding.weight.dtype
        out = torch.zeros(num_tokens, 1, dtype=dtype, device=positions.device)
        step = self.stage_step
        if step is None or input_ids is None:
            return out
        jobs = []
        for r in step.requests():
            if r.num_prompt_tokens == 0 or step.failed(r.req_id):
                continue  # not a stage request (nothing to publish), or failed already
            if r.num_computed >= r.num_prompt_tokens:
                continue  # a decode step (max_tokens > 1): the waveform is out already
            try:
                if r.num_computed != 0 or r.num_tokens != r.num_prompt_tokens:
                    raise RuntimeError(
                        f"code2wav needs a request's whole prompt in one step, got tokens "
                        f"{r.num_computed}..{r.num_computed + r.num_tokens} of "
                        f"{r.num_prompt_tokens}: set enable_chunked_prefill: false (and a "
                        "max_num_batched_tokens >= max_model_len) in this stage's engine_args")
                codes = codes_from_prompt_ids(input_ids[r.start:r.start + r.num_tokens],
                                              self.config)
                jobs.append(_Job(r.req_id, codes, {}, _left_context(step, r.req_id, codes)))
            except Exception as exc:
                step.fail(r.req_id, exc)
        if jobs:
            self._decode(jobs)
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, num_quantizers * codebook_size]`` float32 zeros: the sampled token is a
        dummy that ends the request."""
        return torch.zeros(hidden_states.shape[0], self.vocab_size, dtype=torch.float32,
                           device=hidden_states.device)

    # -- stage outputs (read by the plugin's worker) ------------------------------------
    def stage_output_requests(self) -> dict[str, dict[str, torch.Tensor]]:
        """Outputs of the last forward, by request id: ``waveform`` ``[num_samples]``
        float32 in ``[-1, 1]`` and ``sample_rate`` ``[1]`` int64 (Hz)."""
        return self._outputs

    # -- decoding -----------------------------------------------------------------------
    def _decode(self, jobs: list[_Job]) -> None:
        """Every job's waveform into :attr:`_outputs`; a job that fails is failed alone."""
        model = self.code2wav
        work = [(job, i, seg) for job in jobs
                for i, seg in enumerate(chunk_schedule(job.codes.shape[0],
                                                       first=job.context))]
        if model.right_padding_is_exact:
            # longest first, so each padded call holds chunks of similar lengths
            work.sort(key=lambda item: item[2].end - item[2].begin, reverse=True)
            groups: list[list] = [[]]
            for item in work:
                group = groups[-1]
                longest = group[0][2].end - group[0][2].begin if group else 0
                if group and longest * (len(group) + 1) > self.max_batch_frames:
                    groups.append([])
                groups[-1].append(item)
        else:
            groups = [[item] for item in work]
        for group in groups:
            try:
                self._run(group)
            except Exception as exc:
                if len(group) == 1:
                    self._fail(group[0][0], exc)
                    continue
                logger.warning("code2wav: a padded decode of %d chunks failed (%s); "
                               "decoding them one by one", len(group), exc)
                for item in group:
                    try:
                        self._run([item])
                    except Exception as exc1:
                        self._fail(item[0], exc1)
        for job in jobs:
            if job.pieces is not None:
                wav = torch.cat([job.pieces[i] for i in sorted(job.pieces)])
                self._outputs[job.req_id] = {
                    "waveform": wav.float(),
                    "sample_rate": torch.tensor([self.sample_rate], dtype=torch.long),
                }

    def _run(self, group: list) -> None:
        """One padded decoder call on ``group``'s ``(job, index, segment)`` items (those of
        failed jobs are skipped); each keeps the samples HF keeps of that chunk."""
        model = self.code2wav
        group = [item for item in group if item[0].pieces is not None]
        if not group:
            return
        frames = max(seg.end - seg.begin for _, _, seg in group)
        batch = torch.zeros(len(group), frames, model.num_quantizers, dtype=torch.long,
                            device=group[0][0].codes.device)
        for row, (job, _, seg) in enumerate(group):
            batch[row, :seg.end - seg.begin] = job.codes[seg.begin:seg.end]
        wav = model(batch)
        for row, (job, index, seg) in enumerate(group):
            frames = seg.end - seg.begin
            end = model.num_samples(frames)
            begin = seg.context * model.total_upsample
            if seg.refill:  # the samples a decode ending at the context's end drops
                begin -= frames * model.total_upsample - end
            job.pieces[index] = wav[row, begin:end]

    def _fail(self, job: _Job, exc: Exception) -> None:
        if job.pieces is not None:
            job.pieces = None
            self.stage_step.fail(job.req_id, exc)

    # -- weights ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the ``code2wav.`` weights of a Qwen3-Omni checkpoint (others are skipped).

        Returns:
            The names of the parameters loaded (all of this model's).

        Raises:
            ValueError: a ``code2wav.`` weight has no parameter here, or a parameter has no
                weight in the checkpoint.
        """
        # the checkpoint's names are this module's: its submodule is ``code2wav``
        own = ((n, w) for n, w in weights if n.startswith(WEIGHT_PREFIX))
        return load_stacked(self, own, [n for n, _ in self.named_parameters()],
                            owner=type(self).__name__)
