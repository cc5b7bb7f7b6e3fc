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
  not change its samples), each request's chunks then cut and joined as HF does.
* **Streamed requests.** A request that is one chunk of a streamed request (input payload
  ``stream``, :data:`STREAM_INPUT`; its first ``left_context`` frames are context only)
  returns the samples of its frames in the whole stream's decode (HF ``forward`` on all
  its frames at once), so the chunks, joined, are that decode with no gap or overlap.
  The engine keeps each stream's state between its chunks (least recently used dropped
  beyond :data:`STREAM_STATE_CAPACITY`): the pre-transformer's keys and values of its
  sliding window and its last output rows. A chunk then runs its new frames only, and
  each convolutional block gets only the input samples its output depends on
  (:meth:`Qwen3OmniCode2Wav.decode`): a stream costs about what its decode at once
  costs. A chunk whose stream state is not here (its previous chunk ran on another
  replica) decodes its left context again, with the pre-transformer limited to it.
* **Output.** :meth:`Qwen3OmniCode2WavStage.stage_output_requests` gives each request's
  ``waveform`` ``[num_samples]`` float32 in ``[-1, 1]`` and ``sample_rate`` ``[1]`` int64
  (Hz, :func:`sample_rate`); the worker publishes them. The token vLLM samples (logits are
  all zero) is a dummy; with ``max_tokens=1`` it ends the request.
* **Memory profile.** vLLM profiles only engines with a KV cache, and this model has
  none: the plugin's worker runs vLLM's profiling forward itself at start-up
  (``OmniWorkerMixin.compile_or_warm_up_model``) with ``stage_profiling`` set, the model
  decodes the largest padded batch a step can hold
  (:meth:`Qwen3OmniCode2WavStage.profile_decode`), and start-up fails when that peak
  (GiBs at the released checkpoint's size) exceeds the engine's share of its device.

The model has no paged attention layer (vLLM sees no KV cache); the stream state above
is the model's own (the convolutional part's context is part of it, which is not KV
cache). The pre-transformer is built from vLLM's layers (parallel linear layers,
RMSNorm, rotary embedding, activation) with a causal sliding-window attention computed
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

import hashlib
import math
from collections import OrderedDict
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
from vllm_omni_plugin.models.weights import OwnShards, load_stacked

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
#: leading frames that are left context only (their samples are not returned).
LEFT_CONTEXT_INPUT = "left_context"

#: Input payload of a chunk of a streamed request: ``[3]`` int64 ``(key, first, last)``:
#: the stream's key (:func:`stream_key`, the same for all its chunks), the stream frame
#: that the chunk's first frame after its left context is, and 1 on the stream's last
#: chunk. An engine that decoded the stream's previous chunk continues from its state
#: (see :class:`Qwen3OmniCode2WavStage`) instead of decoding the left context again.
STREAM_INPUT = "stream"

#: Streams whose decoder state one engine keeps at most; the least recently used is
#: dropped (an aborted stream's state goes that way). A state holds the pre-transformer's
#: keys and values of ``sliding_window - 1`` frames per layer (Qwen3-Omni: 8 layers x 71
#: frames x 2 x 1024 values, 2.3 MB in bf16) and a few frames of its output.
STREAM_STATE_CAPACITY = 128


def stream_key(stream_id: str) -> int:
    """The :data:`STREAM_INPUT` key of a stream id: a stable hash in ``[0, 2**63)``."""
    digest = hashlib.blake2b(stream_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


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
            ``[0, codebook_size)``; ``T >= 1``. Any integer dtype (the talker's int64;
            not bool), any device.
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
    which the first ``context`` are left context whose samples are dropped."""

    begin: int
    end: int
    context: int


def chunk_schedule(num_frames: int, chunk_size: int = HF_CODE2WAV_CHUNK_SIZE,
                   left_context: int = HF_CODE2WAV_LEFT_CONTEXT) -> list[_Segment]:
    """The forwards HF ``Qwen3OmniMoeCode2Wav.chunked_decode`` runs on ``num_frames``
    frames, in order (its loop, without the model)."""
    segments, start = [], 0
    while start < num_frames:
        end = min(start + chunk_size, num_frames)
        context = left_context if start - left_context > 0 else start
        segments.append(_Segment(start - context, end, context))
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

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """``[n, hidden]`` rows -> q ``[n, num_heads, head_dim]``, k and v ``[n,
        num_kv_heads, head_dim]`` (rotary applied at ``positions`` ``[n]``)."""
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return (q.reshape(-1, self.num_heads, self.head_dim),
                k.reshape(-1, self.num_kv_heads, self.head_dim),
                v.reshape(-1, self.num_kv_heads, self.head_dim))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """q ``[batch, queries, heads, head_dim]``, k/v ``[batch, keys, kv_heads,
        head_dim]``, mask ``[queries, keys]`` (True: attend) -> ``[batch * queries,
        hidden]``."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out, _ = self.o_proj(out.transpose(1, 2).reshape(-1, self.q_size))
        return out

    def _mask(self, queries: int, keys: int, device) -> torch.Tensor:
        """``[queries, keys]``: the queries are the last ``queries`` of ``keys`` frames;
        each attends to itself and the ``sliding_window - 1`` frames before it."""
        distance = (torch.arange(keys - queries, keys, device=device)[:, None]
                    - torch.arange(keys, device=device)[None, :])
        mask = distance >= 0
        if self.sliding_window is not None:
            mask &= distance < self.sliding_window
        return mask

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: int) -> torch.Tensor:
        """``x`` ``[batch * frames, hidden]`` rows of ``batch`` equal-length sequences at
        ``positions`` ``[batch * frames]`` -> ``[batch * frames, hidden]``, each frame
        attending causally within its sequence's sliding window. Rows in the model's
        dtype, positions int64."""
        q, k, v = self._qkv(x, positions)
        frames = x.shape[0] // batch
        q, k, v = (t.reshape(batch, frames, *t.shape[1:]) for t in (q, k, v))
        return self._attend(q, k, v, self._mask(frames, frames, x.device))

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor,
                       past: tuple[torch.Tensor, torch.Tensor] | None):
        """One sequence's next frames, after frames whose keys and values are cached.

        Args:
            x: ``[n, hidden]`` rows of the next ``n`` frames, in the model's dtype.
            positions: ``[n]`` int64 their rotary positions, following the cached frames'.
            past: keys and values ``[m, num_kv_heads, head_dim]`` (rotary applied, the
                model's dtype) of the ``m`` frames right before, or None.

        Returns:
            ``[n, hidden]``, and the keys and values of the last ``sliding_window - 1``
            frames up to these (all of them without a window): the next call's ``past``;
            all in the model's dtype.
        """
        q, k, v = self._qkv(x, positions)
        if past is not None:
            k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
        keys = k.shape[0]
        out = self._attend(q[None], k[None], v[None], self._mask(x.shape[0], keys, x.device))
        keep = keys if self.sliding_window is None else min(keys, self.sliding_window - 1)
        return out, (k[keys - keep:].clone(), v[keys - keep:].clone())


class Code2WavMLP(nn.Module):
    """HF ``Qwen3OmniMoeCode2WavMlp``: ``down_proj(act(gate_proj(x)) * up_proj(x))``, no
    biases, with gate and up fused into vLLM's ``gate_up_proj``."""

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=False, prefix=f"{prefix}.down_proj")
        self.act_fn = get_act_and_mul_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, hidden]``, in the model's dtype."""
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

    def forward(self, x: torch.Tensor, attention) -> torch.Tensor:
        """``x`` ``[n, hidden]`` rows -> ``[n, hidden]``, in the model's dtype;
        ``attention``: the normed rows ``[n, hidden]`` -> this layer's attention output
        (same shape)."""
        x = x + self.self_attn_layer_scale(attention(self.input_layernorm(x)))
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
        of the output depends on input frames ``<= t`` only), in the model's dtype."""
        batch, frames, hidden = x.shape
        positions = torch.arange(frames, device=x.device).repeat(batch)
        h = x.reshape(batch * frames, hidden)
        for layer in self.layers:
            h = layer(h, lambda a, attn=layer.self_attn: attn(a, positions, batch))
        return self.norm(h).view(batch, frames, hidden)

    def forward_cached(self, x: torch.Tensor, start: int, cache: list | None):
        """One sequence's next frames, continuing ``cache``.

        Args:
            x: ``[n, hidden]`` the frames' embeddings, in the model's dtype.
            start: the rotary position of the first of them (the frames before it).
            cache: what the previous call returned, or None (the sequence's first frames).

        Returns:
            ``[n, hidden]`` (the rows :meth:`forward` gives these frames of the whole
            sequence), and the cache for the next frames: per layer, the keys and values
            ``[m, num_kv_heads, head_dim]`` of its last ``m <= sliding_window - 1`` frames;
            all in the model's dtype.
        """
        positions = torch.arange(start, start + x.shape[0], device=x.device)
        new_cache = []
        for i, layer in enumerate(self.layers):
            def attention(a, attn=layer.self_attn, past=cache[i] if cache else None):
                out, kv = attn.forward_cached(a, positions, past)
                new_cache.append(kv)
                return out

            x = layer(x, attention)
        return self.norm(x), new_cache


# -- the whole codec decoder -----------------------------------------------------------
# The convolutional part, as a chain of blocks ("atoms": the decoder blocks expanded into
# theirs). Every block is causal: its output sample ``p`` depends on input samples
# ``<= p`` (a transposed convolution: on the inputs ``p`` covers, HF trimming the ones
# that would need the next input). So a decode of the first frames of a sequence returns
# the first samples of the whole sequence's decode, and a decode that starts inside a
# sequence returns its exact samples once each block's reach into the past is covered.
def _reach(atom: nn.Module) -> int:
    """Input samples before ``p`` that output sample ``p`` of a stride-1 block depends on.

    Raises:
        ValueError: a block these rules do not cover.
    """
    if isinstance(atom, hf.Qwen3OmniMoeCausalConvNet):
        if atom.stride != 1:
            raise ValueError(f"code2wav: a strided causal convolution ({atom.stride}) is "
                             "not supported")
        return atom.padding
    if isinstance(atom, hf.Qwen3OmniMoeConvNeXtBlock):
        return _reach(atom.dwconv)
    if isinstance(atom, hf.Qwen3OmniMoeCode2WavDecoderResidualUnit):
        return _reach(atom.conv1) + _reach(atom.conv2)
    if isinstance(atom, hf.Qwen3OmniMoeSnakeBeta):
        return 0
    raise ValueError(f"code2wav: unknown block {type(atom).__name__} in the decoder")


def _geometry(atom: nn.Module) -> tuple[int, int, int]:
    """``(stride, kernel, left_pad)``: output sample ``p`` depends on the inputs ``i``
    with ``i * stride <= p + left_pad < i * stride + kernel``. A transposed convolution's
    own; ``(1, reach + 1, 0)`` for a stride-1 block.

    Raises:
        ValueError: a block that is not causal (a transposed convolution trimming fewer
            than ``kernel - stride`` samples on the right), or an unknown one.
    """
    if isinstance(atom, hf.Qwen3OmniMoeCausalTransConvNet):
        conv = atom.conv
        stride, kernel = conv.stride[0], conv.dilation[0] * (conv.kernel_size[0] - 1) + 1
        if atom.right_pad < kernel - stride:
            raise ValueError("code2wav: a transposed convolution that is not causal")
        return stride, kernel, atom.left_pad
    return 1, _reach(atom) + 1, 0


def _conv_atoms(model: nn.Module) -> list[tuple[nn.Module, tuple[int, int, int]]]:
    """The convolutional blocks of ``model`` (a :class:`Qwen3OmniCode2Wav`) in forward
    order, each with its :func:`_geometry`."""
    atoms = [block for blocks in model.upsample for block in blocks]
    for block in model.decoder:
        atoms.extend(block.block if isinstance(block, hf.Qwen3OmniMoeCode2WavDecoderBlock)
                     else [block])
    return [(atom, _geometry(atom)) for atom in atoms]


class Qwen3OmniCode2Wav(nn.Module):
    """HF ``Qwen3OmniMoeCode2Wav`` with the pre-transformer on vLLM's layers.

    Parameter names equal HF's (``qkv_proj`` / ``gate_up_proj`` fuse HF's q/k/v and
    gate/up projections).

    Attributes:
        conv_context: frames of pre-transformer output before a sequence's frame ``b``
            that :meth:`decode` needs to return the samples of frames ``>= b`` exactly.

    Raises:
        ValueError: (init) a convolutional block that is not causal.
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
        self._atoms = _conv_atoms(self)  # (block, geometry), computed once
        self._starts: dict[int, list[int]] = {}
        self.conv_context = next(c for c in range(1, 1 << 16) if self._input_starts(c)[0] >= 0)

    def num_samples(self, num_frames: int) -> int:
        """Samples HF's ``forward`` returns for ``num_frames`` frames (slightly fewer than
        ``num_frames * total_upsample``: the transposed convolutions drop a few); 0 for 0."""
        n = num_frames
        for atom, (stride, kernel, left_pad) in self._atoms:
            if n and isinstance(atom, hf.Qwen3OmniMoeCausalTransConvNet):
                n = (n - 1) * stride + kernel - left_pad - atom.right_pad
        return n

    def _input_starts(self, skip: int) -> list[int]:
        """Per block, the first input sample (counted from the decode's first frame, in
        that block's input rate) that samples ``>= num_samples(skip)`` of the output
        depend on; negative: before the decode's first frame."""
        starts = self._starts.get(skip)
        if starts is None:
            start, starts = self.num_samples(skip), []
            for _, (stride, kernel, left_pad) in reversed(self._atoms):
                start = -(-(start + left_pad - kernel + 1) // stride)  # ceil
                starts.append(start)
            starts = self._starts[skip] = starts[::-1]
        return starts

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """``[batch, frames, num_quantizers]`` int64 codes -> ``[batch, frames, hidden]``:
        the mean of each frame's code embeddings (HF)."""
        batch, frames, nq = codes.shape
        rows = (codes + self.code_offset).reshape(-1)
        return self.code_embedding(rows).view(batch, frames, nq, -1).mean(2)

    def decode(self, hidden: torch.Tensor, skip: int = 0) -> torch.Tensor:
        """The convolutional part: pre-transformer output -> waveform.

        Args:
            hidden: ``[batch, frames, hidden]`` pre-transformer output of frames ``[a, a +
                frames)`` of each sequence (right-padded: a row's samples do not depend
                on frames after its end).
            skip: leading frames whose samples are not returned (context only).

        Returns:
            ``[batch, num_samples(frames) - num_samples(skip)]`` in ``[-1, 1]`` (model
            dtype): samples ``[num_samples(a + skip), num_samples(a + frames))`` of each
            sequence's whole decode, exact when ``a == 0`` (the sequence's start) or
            ``skip >= conv_context``. Each block gets only the input those depend on.
        """
        x = hidden.permute(0, 2, 1)
        offset = 0  # x's first sample, counted as in _input_starts
        starts = self._input_starts(skip) if skip else [0] * len(self._atoms)
        for (atom, (stride, _, _)), start in zip(self._atoms, starts, strict=True):
            if start > offset:
                x, offset = x[..., start - offset:], start
            x = atom(x)
            offset *= stride
        return x[..., self.num_samples(skip) - offset:].clamp(min=-1, max=1).squeeze(1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """HF ``Qwen3OmniMoeCode2Wav.forward`` on a batch of equal-length sequences.

        Args:
            codes: ``[batch, frames, num_quantizers]`` int64 codes in ``[0, codebook_size)``
                (HF takes ``[batch, num_quantizers, frames]``).

        Returns:
            ``[batch, num_samples(frames)]`` waveforms in ``[-1, 1]`` (model dtype).
        """
        return self.decode(self.pre_transformer(self.embed(codes)))


@dataclass
class _Chunk:
    """A request that is one chunk of a streamed request."""

    key: int | None  # the stream's key (STREAM_INPUT); None: left context only, no state
    first: int  # the stream frame of its first frame after the left context
    last: bool  # the stream's last chunk


@dataclass
class _StreamState:
    """What an engine keeps of a stream between its chunks."""

    next_frame: int  # the stream frame the next chunk starts at
    position: int  # the pre-transformer's rotary position of that frame
    cache: list  # the pre-transformer's (Code2WavTransformer.forward_cached)
    hidden: torch.Tensor  # [<= conv_context, hidden] its output for the frames before


@dataclass
class _Job:
    """One request being decoded in a step."""

    req_id: str
    codes: torch.Tensor  # [T, num_quantizers]
    pieces: dict[int, torch.Tensor] | None  # segment index -> samples kept; None: failed
    context: int = 0  # leading frames that are left context only
    chunk: _Chunk | None = None


def _chunk_inputs(step, req_id: str, codes: torch.Tensor) -> tuple[int, _Chunk | None]:
    """The request's leading context frames (:data:`LEFT_CONTEXT_INPUT`) and, for a chunk
    of a streamed request (:data:`STREAM_INPUT`, or a left context), its :class:`_Chunk`.

    Raises:
        ValueError: a context not fewer than the request's frames, or a malformed
            :data:`STREAM_INPUT`.
    """
    inputs = step.inputs(req_id)
    value = inputs.get(LEFT_CONTEXT_INPUT)
    context = int(value.reshape(-1)[0]) if value is not None else 0
    if not 0 <= context < codes.shape[0]:
        raise ValueError(f"{LEFT_CONTEXT_INPUT} {context} is not in [0, {codes.shape[0]}) "
                         "(the request's frames)")
    stream = inputs.get(STREAM_INPUT)
    if stream is None:
        return context, _Chunk(None, context, True) if context else None
    values = stream.reshape(-1).tolist()
    if len(values) != 3 or values[1] < context or values[2] not in (0, 1):
        raise ValueError(f"{STREAM_INPUT} must be [key, first frame >= {LEFT_CONTEXT_INPUT} "
                         f"({context}), last 0 or 1], got {values}")
    return context, _Chunk(int(values[0]), int(values[1]), bool(values[2]))


def _batches(items: list, frames, bound: int) -> list[list]:
    """``items`` in padded calls of at most ``bound`` ``batch * frames``, longest first
    (each call holds items of similar lengths); ``frames(item)``: its length."""
    groups: list[list] = [[]]
    for item in sorted(items, key=frames, reverse=True):
        group = groups[-1]
        if group and frames(group[0]) * (len(group) + 1) > bound:
            groups.append(group := [])
        group.append(item)
    return groups if items else []


class Qwen3OmniCode2WavStage(OwnShards, nn.Module, SupportsMRoPE):
    """The code2wav stage as a vLLM model (checkpoint prefix ``code2wav.``).

    The model does its real work only inside an engine step the plugin's worker binds to
    :attr:`stage_step` (see the module docstring); vLLM's own dummy and profiling forwards
    (``stage_step`` None) return zeros, after decoding dummy codes in the engine's memory
    profile (``stage_profiling``).

    Attributes:
        uses_stage_step: tells the worker to bind a ``StageStep`` around each forward.
        stage_profiling: set by the worker while it profiles the engine's memory.
        max_batch_frames: a bound on ``batch * frames`` of one padded decoder call (frames
            include padding); a step's chunks beyond it run in several calls.
    """

    uses_stage_step = True
    checkpoint_prefixes = (WEIGHT_PREFIX,)
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
        self.stage_profiling = False
        self._outputs: dict[str, dict[str, torch.Tensor]] = {}
        #: streamed requests' decoder state by stream key, least recently used first
        self._streams: OrderedDict[int, _StreamState] = OrderedDict()

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

    @classmethod
    def plan_profile(cls, vllm_config) -> tuple[int, int]:
        """What vLLM's memory profile runs here (:meth:`profile_decode`), for
        :mod:`vllm_omni_plugin.tools.plan`: ``(tokens, extra_bytes)``, the
        :attr:`max_batch_frames` frames of the largest decoder call through the
        pre-transformer, and its upsampling decoder's widest activations: four tensors of
        ``samples x decoder_dim / 2 ** len(upsample_rates)`` (the last block's width at
        the waveform's rate; each block halves the channels and multiplies the length by
        its rate, so the last is the largest), at the model's dtype."""
        model_config = vllm_config.model_config
        cfg = model_config.hf_config.code2wav_config
        samples = cls.max_batch_frames * int(math.prod(list(cfg.upsample_rates)
                                                       + list(cfg.upsampling_ratios)))
        width = int(cfg.decoder_dim) // 2 ** len(cfg.upsample_rates)
        return cls.max_batch_frames, 4 * samples * width * model_config.dtype.itemsize

    # -- vLLM model interface -----------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` prompt ids (int32 from vLLM's runner; int64 works too) -> ``[n, hidden]``
        rows of the code embedding, in the model's dtype."""
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
            if self.stage_profiling:
                self.profile_decode(num_tokens)
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
                jobs.append(_Job(r.req_id, codes, {}, *_chunk_inputs(step, r.req_id, codes)))
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

    def profile_decode(self, num_tokens: int) -> None:
        """vLLM's profiling forward of ``num_tokens`` prompt ids: the largest padded
        decoder call a step of that many ids makes (``num_tokens // num_quantizers``
        frames, at most :attr:`max_batch_frames`, in rows of HF's chunk plus left context,
        325 frames), on codes 0; nothing when the forward holds no whole frame."""
        model = self.code2wav
        frames = min(num_tokens // model.num_quantizers, self.max_batch_frames)
        if frames == 0:
            return
        row = min(frames, HF_CODE2WAV_CHUNK_SIZE + HF_CODE2WAV_LEFT_CONTEXT)
        codes = torch.zeros(frames // row, row, model.num_quantizers, dtype=torch.long,
                            device=model.code_embedding.weight.device)
        logger.info("code2wav: memory profile decodes %d x %d frames (the largest decoder "
                    "call of a step)", *codes.shape[:2])
        model(codes)

    # -- stage outputs (read by the plugin's worker) ------------------------------------
    def stage_output_requests(self) -> dict[str, dict[str, torch.Tensor]]:
        """Outputs of the last forward, by request id: ``waveform`` ``[num_samples]``
        float32 in ``[-1, 1]`` and ``sample_rate`` ``[1]`` int64 (Hz)."""
        return self._outputs

    # -- decoding -----------------------------------------------------------------------
    def _decode(self, jobs: list[_Job]) -> None:
        """Every job's waveform into :attr:`_outputs`; a job that fails is failed alone.

        A whole request is decoded as HF ``chunked_decode`` does; a chunk of a streamed
        request continues its stream's state (:meth:`_continue_stream`)."""
        segments = [(job, i, seg) for job in jobs if job.chunk is None
                    for i, seg in enumerate(chunk_schedule(job.codes.shape[0]))]
        self._run_batches(_batches(segments, lambda item: item[2].end - item[2].begin,
                                   self.max_batch_frames), self._run)
        chunks = []
        for job in jobs:
            if job.chunk is not None:
                try:
                    chunks.append((job, *self._continue_stream(job)))
                except Exception as exc:
                    self._fail(job, exc)
        for skip in sorted({item[2] for item in chunks}):
            self._run_batches(_batches([item for item in chunks if item[2] == skip],
                                       lambda item: item[1].shape[0], self.max_batch_frames),
                              self._run_chunks)
        for job in jobs:
            if job.pieces is not None:
                wav = torch.cat([job.pieces[i] for i in sorted(job.pieces)])
                self._outputs[job.req_id] = {
                    "waveform": wav.float(),
                    "sample_rate": torch.tensor([self.sample_rate], dtype=torch.long),
                }

    def _run_batches(self, groups: list[list], run) -> None:
        """``run(group)`` for each padded call; a failed call is retried item by item,
        and an item that fails alone fails its job."""
        for group in groups:
            try:
                run(group)
            except Exception as exc:
                if len(group) == 1:
                    self._fail(group[0][0], exc)
                    continue
                logger.warning("code2wav: a padded decode of %d chunks failed (%s); "
                               "decoding them one by one", len(group), exc)
                for item in group:
                    try:
                        run([item])
                    except Exception as exc1:
                        self._fail(item[0], exc1)

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
            job.pieces[index] = wav[row, seg.context * model.total_upsample:
                                    model.num_samples(seg.end - seg.begin)]

    def _continue_stream(self, job: _Job) -> tuple[torch.Tensor, int]:
        """The pre-transformer on a streamed request's chunk, continuing its stream.

        With the state of the stream's previous chunk (same key, ending where this chunk
        starts), only the chunk's new frames run, after the cached keys and values, and
        the decoder gets the previous chunk's last ``conv_context`` rows as its context:
        the chunks, joined, are the whole stream's decode up to float rounding. Without
        it (the stream's first chunk; or a previous chunk on another replica, or evicted)
        the chunk's left context runs too. The state is kept for the next chunk (not
        after the last).

        Returns:
            ``[frames, hidden]`` decoder input, and the leading frames of it that are
            context only.
        """
        model = self.code2wav
        chunk, context = job.chunk, job.context
        state = self._streams.pop(chunk.key, None) if chunk.key is not None else None
        if state is not None and state.next_frame == chunk.first:
            new = job.codes[context:]
            hidden, cache = model.pre_transformer.forward_cached(
                model.embed(new[None])[0], state.position, state.cache)
            hidden, skip = torch.cat([state.hidden, hidden]), state.hidden.shape[0]
            position = state.position + new.shape[0]
        else:
            if chunk.key is not None and chunk.first > 0:
                logger.info("code2wav: stream %x continues at frame %d without its state "
                            "(its previous chunk ran elsewhere, or it was evicted): "
                            "decoding %d frames of left context", chunk.key, chunk.first,
                            context)
            hidden, cache = model.pre_transformer.forward_cached(
                model.embed(job.codes[None])[0], 0, None)
            skip, position = context, job.codes.shape[0]
        keep = min(skip, model.conv_context)
        hidden, skip = hidden[skip - keep:], keep
        if chunk.key is not None and not chunk.last:
            self._streams[chunk.key] = _StreamState(
                next_frame=chunk.first + job.codes.shape[0] - context, position=position,
                cache=cache, hidden=hidden[-model.conv_context:].clone())
            while len(self._streams) > STREAM_STATE_CAPACITY:
                self._streams.popitem(last=False)
        return hidden, skip

    def _run_chunks(self, group: list) -> None:
        """One padded decoder call on ``group``'s ``(job, hidden, skip)`` items (one
        ``skip``): each job's samples after its context."""
        model = self.code2wav
        group = [item for item in group if item[0].pieces is not None]
        if not group:
            return
        skip = group[0][2]
        frames = max(hidden.shape[0] for _, hidden, _ in group)
        batch = group[0][1].new_zeros(len(group), frames, group[0][1].shape[1])
        for row, (_, hidden, _) in enumerate(group):
            batch[row, :hidden.shape[0]] = hidden
        wav = model.decode(batch, skip)
        for row, (job, hidden, _) in enumerate(group):
            job.pieces[0] = wav[row, :model.num_samples(hidden.shape[0])
                                - model.num_samples(skip)]

    def _fail(self, job: _Job, exc: Exception) -> None:
        if job.pieces is not None:
            job.pieces = None
            if job.chunk is not None and job.chunk.key is not None:
                self._streams.pop(job.chunk.key, None)
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
