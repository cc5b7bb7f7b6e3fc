"""Qwen3-Omni talker stage on vLLM's model runner: codec frames from the thinker's output.

The talker decoder is vLLM's own ``Qwen3MoeModel`` (its attention on the paged KV cache,
q/k norms, M-RoPE, fused MoE with the sigmoid-gated shared expert) built on the talker's
text config; the code predictor, the codec head and the two projections are built here
from vLLM's linear, norm, rotary and embedding layers. vLLM's scheduler batches, chunks
and preempts talker requests like any other, and vLLM's sampler draws code 0.

One talker request (input payload from ``thinker2talker``, a prompt of ``L`` placeholder
ids) runs as in HF ``Qwen3OmniMoeForConditionalGeneration.generate`` (written out in
:mod:`.talker_inputs`):

* prompt position ``p < L`` takes row ``p`` of :func:`.talker_inputs.build_talker_prompt`;
* the token vLLM samples at position ``L + s - 1`` is code 0 of frame ``s``; when it is fed
  back (position ``L + s``), the code predictor turns it and the talker hidden state at
  ``L + s - 1`` into the frame's 15 residual codes, and the row's embedding is the sum of
  the 16 codebook embeddings plus trailing text row ``s`` (or ``tts_pad``);
* positions are plain (``0 .. L-1``, then ``L + s``) unless the thinker prompt held an image
  or a video: then they are HF's 3-D M-RoPE positions of the talker prompt, derived from the
  thinker's (:func:`.talker_inputs.talker_mrope_positions`), and decode position ``p`` is
  ``p + delta``;
* the frame is published as ``codes`` ``[1, 16]`` int64 when it is computed, so a frame
  exists only for code-0 tokens that were fed: never for ``codec_eos`` (the stop token;
  async scheduling feeds it back once, and that row makes no frame), and, as in HF, not
  for the last code 0 of a request cut by ``max_tokens``.

Frames and the last hidden state are kept per request until it finishes, keyed by
position, so a recompute after preemption reuses them instead of re-predicting.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.qwen3_moe import Qwen3MoeMLP, Qwen3MoeModel

from vllm_omni_plugin.compat.internals import text_model_config
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.models.qwen3_omni import talker_inputs as ti
from vllm_omni_plugin.models.qwen3_omni.code2wav import MAX_FRAMES
from vllm_omni_plugin.models.weights import OwnShards, load_stacked

logger = init_logger(__name__)

#: vLLM's sampler treats a temperature below this as greedy (``vllm.v1.sample``).
_GREEDY_TEMPERATURE = 1e-5
def plain_mrope_positions(num_tokens: int) -> torch.Tensor:
    """``[3, num_tokens]`` int64 M-RoPE positions of a text-only sequence (t == h == w)."""
    return torch.arange(num_tokens, dtype=torch.long).expand(3, -1).clone()


class _ResizeMLP(nn.Module):
    """HF ``Qwen3OmniMoeTalkerResizeMLP``: thinker width -> talker width
    (``linear_fc2(act(linear_fc1(x)))``, both with bias)."""

    def __init__(self, in_size: int, mid_size: int, out_size: int, act: str, prefix: str):
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(in_size, mid_size, bias=True,
                                           prefix=f"{prefix}.linear_fc1")
        self.act = get_act_fn(act)
        self.linear_fc2 = ReplicatedLinear(mid_size, out_size, bias=True,
                                           prefix=f"{prefix}.linear_fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_size]`` (thinker width) -> ``[..., out_size]`` (talker width), in the
        model's dtype (``x`` must have it: the projections' weights')."""
        return self.linear_fc2(self.act(self.linear_fc1(x)[0]))[0]


class _CodePredictorAttention(nn.Module):
    """Qwen3 attention (q/k RMSNorm, RoPE) over a per-call cache: the code predictor
    attends within one frame (at most ``num_code_groups`` positions), so it keeps no
    paged KV cache."""

    def __init__(self, config, prefix: str):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
            bias=config.attention_bias, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, max_position=config.num_code_groups + 1,
                                   rope_parameters=config.rope_parameters)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cache: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``x`` ``[B, n, H]`` (the model's dtype) at ``positions`` ``[n]`` int64; ``cache``
        holds the earlier positions' keys and values ``[B, kv_heads, t, head_dim]`` (None at
        the start). Returns ``[B, n, H]`` and the keys and values ``[B, kv_heads, t + n,
        head_dim]``, all in the model's dtype."""
        b, n, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x)[0].split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(b, n, self.num_heads, self.head_dim)).reshape(b * n, q_size)
        k = self.k_norm(k.reshape(b, n, self.num_kv_heads, self.head_dim)).reshape(b * n,
                                                                                  kv_size)
        q, k = self.rotary_emb(positions.repeat(b), q, k)
        q = q.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=cache is None and n > 1,
            enable_gqa=self.num_heads != self.num_kv_heads)
        out = self.o_proj(out.transpose(1, 2).reshape(b, n, q_size))[0]
        return out, [k, v]


class _CodePredictorLayer(nn.Module):
    def __init__(self, config, prefix: str):
        super().__init__()
        self.self_attn = _CodePredictorAttention(config, f"{prefix}.self_attn")
        self.mlp = Qwen3MoeMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                               prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, positions, cache):
        attn, cache = self.self_attn(self.input_layernorm(x), positions, cache)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class _CodePredictorModel(nn.Module):
    def __init__(self, config, prefix: str):
        super().__init__()
        self.layers = nn.ModuleList(
            _CodePredictorLayer(config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.codec_embedding = nn.ModuleList(
            VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                   prefix=f"{prefix}.codec_embedding.{j}")
            for j in range(config.num_code_groups - 1))


class Qwen3OmniCodePredictor(nn.Module):
    """HF ``Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration``, batched:
    codes 1..15 of a frame from the talker's hidden state and code 0."""

    def __init__(self, config, prefix: str = "code_predictor"):
        super().__init__()
        self.config = config
        self.model = _CodePredictorModel(config, f"{prefix}.model")
        self.lm_head = nn.ModuleList(
            ReplicatedLinear(config.hidden_size, config.vocab_size, bias=False,
                             prefix=f"{prefix}.lm_head.{j}")
            for j in range(config.num_code_groups - 1))

    def get_input_embeddings(self) -> nn.ModuleList:
        """The embeddings of codes 1..15 (``num_code_groups - 1`` tables, HF
        ``code_predictor.model.codec_embedding``): table ``j`` embeds code ``j + 1``."""
        return self.model.codec_embedding

    @torch.no_grad()
    def predict(self, hidden: torch.Tensor, code0_embeds: torch.Tensor,
                greedy: list[bool], generators: list[torch.Generator | None]) -> torch.Tensor:
        """Residual codes ``[B, num_code_groups - 1]`` int64.

        Args:
            hidden: ``[B, H]`` talker hidden states (after the final norm) at the positions
                whose logits gave code 0.
            code0_embeds: ``[B, H]`` the talker's codec embedding of each code 0.
            greedy: per row, argmax (else HF's sampling: top-k 50, top-p 0.8).
            generators: per row, the request's generator (None: torch's global RNG).
        """
        x = torch.stack((hidden.to(code0_embeds.dtype), code0_embeds), dim=1)  # [B, 2, H]
        caches: list = [None] * len(self.model.layers)
        start, codes = 0, []
        for j, head in enumerate(self.lm_head):
            positions = torch.arange(start, start + x.shape[1], device=x.device)
            for i, layer in enumerate(self.model.layers):
                x, caches[i] = layer(x, positions, caches[i])
            logits = head(self.model.norm(x[:, -1]))[0]
            code = self._sample(logits, greedy, generators)
            codes.append(code)
            start += x.shape[1]
            if j + 1 < len(self.lm_head):
                x = self.model.codec_embedding[j](code).unsqueeze(1)
        return torch.stack(codes, dim=1)

    @staticmethod
    def _sample(logits: torch.Tensor, greedy: list[bool],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        if all(greedy):
            return logits.argmax(dim=-1)
        return torch.cat([
            ti.sample_from_logits(logits[i:i + 1], greedy=g, top_k=ti.HF_CODE_PREDICTOR_TOP_K,
                                  top_p=ti.HF_CODE_PREDICTOR_TOP_P, generator=gen)
            for i, (g, gen) in enumerate(zip(greedy, generators, strict=True))])


@dataclass
class _Request:
    prompt: ti.TalkerPrompt
    greedy: bool
    generator: torch.Generator | None
    #: thinker sequence ids the prompt was built from (more arrive for a growing input)
    sequence_len: int = 0
    #: frames[s]: the 16 codes fed at position L + s
    frames: list[torch.Tensor] = field(default_factory=list)
    #: talker hidden state at position ``hidden_pos`` (the last one fed)
    hidden: torch.Tensor | None = None
    hidden_pos: int = -1
    #: image/video prompts: ``[3, L]`` M-RoPE positions and the decode delta (None: plain)
    mrope: tuple[torch.Tensor, int] | None = None

    def positions(self, first: int, end: int) -> torch.Tensor:
        """``[3, end - first]`` int64 positions of fed positions ``first .. end - 1`` (for a
        request with :attr:`mrope` set)."""
        table, delta = self.mrope
        length = table.shape[1]
        head = table[:, first:min(end, length)]
        tail = torch.arange(max(first, length), end) + delta
        return torch.cat((head, tail.expand(3, -1)), dim=1)


#: Fields of a text config that size a vLLM engine (``ModelConfig``'s vocabulary, hidden
#: size, layers, heads, head size; the MoE config's experts): the talker engine's are
#: the talker's (:meth:`Qwen3OmniTalkerStage.engine_hf_overrides`).
ENGINE_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "intermediate_size",
                       "moe_intermediate_size", "num_experts", "num_experts_per_tok")


def talker_context(hf_config) -> int:
    """Positions a talker request may reach: its user turn (at most the thinker's
    context, ``thinker_config.text_config.max_position_embeddings``), the assistant
    prefix (:data:`~.talker_inputs.ASSISTANT_PREFIX_LEN`) and up to
    :data:`~.code2wav.MAX_FRAMES` frames; at least the talker's own
    ``max_position_embeddings``. The talker engine's default ``max_model_len``."""
    thinker = hf_config.thinker_config.text_config.max_position_embeddings
    return max(int(hf_config.talker_config.text_config.max_position_embeddings),
               int(thinker) + ti.ASSISTANT_PREFIX_LEN + MAX_FRAMES)


class Qwen3OmniTalkerStage(OwnShards, nn.Module, SupportsMRoPE):
    """The talker (checkpoint prefix ``talker.``) as a vLLM model; see the module docstring.

    Reads each request's input payload (``thinker2talker``) and row map from the
    :class:`~vllm_omni_plugin.worker.stage_io.StageStep` the plugin's worker binds to
    :attr:`stage_step`; a request whose payload is unusable fails alone.
    """

    uses_stage_step = True
    checkpoint_prefixes = ("talker.",)

    @classmethod
    def engine_hf_overrides(cls, hf_config) -> dict:
        """``hf_overrides`` this stage's engine needs (nested, over the checkpoint's config).

        vLLM sizes every engine of a Qwen3-Omni checkpoint from
        ``thinker_config.text_config`` (HF's ``get_text_config``): the vocabulary it
        validates prompt and stop ids against, the layers, heads and widths its
        attention backends and KV cache size from, the context it derives
        ``max_model_len`` from. For the talker those are the talker text config's
        (:data:`ENGINE_SHAPE_FIELDS`: codec ids, the talker's decoder) and
        :func:`talker_context`, which the talker's own rotary tables get too. The
        decoder itself is built on ``talker_config.text_config``.
        """
        talker = hf_config.talker_config.text_config
        shapes = {name: getattr(talker, name) for name in ENGINE_SHAPE_FIELDS
                  if getattr(talker, name, None) is not None}
        context = talker_context(hf_config)
        return {"thinker_config": {"text_config": {**shapes,
                                                   "max_position_embeddings": context}},
                "talker_config": {"text_config": {"max_position_embeddings": context}}}

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        self.omni_config = hf_config
        talker_config = hf_config.talker_config
        text_config = talker_config.text_config
        decoder_config = text_model_config(vllm_config, text_config, ["Qwen3MoeForCausalLM"])
        self.model = Qwen3MoeModel(vllm_config=decoder_config, prefix="model")
        self.codec_head = ParallelLMHead(text_config.vocab_size, text_config.hidden_size,
                                         prefix="codec_head")
        self.logits_processor = LogitsProcessor(text_config.vocab_size)
        resize = (talker_config.thinker_hidden_size, text_config.intermediate_size,
                  text_config.hidden_size, text_config.hidden_act)
        self.text_projection = _ResizeMLP(*resize, prefix="text_projection")
        self.hidden_projection = _ResizeMLP(*resize, prefix="hidden_projection")
        self.code_predictor = Qwen3OmniCodePredictor(talker_config.code_predictor_config)
        #: code-0 ids below it are codebook entries; the codec specials follow
        self.codebook_size = int(talker_config.code_predictor_config.vocab_size)
        self.register_buffer("suppress", ti.talker_logits_mask(hf_config), persistent=False)
        self.speakers = {v: k for k, v in (talker_config.speaker_id or {}).items()}
        self.stage_step = None
        self._requests: dict[str, _Request] = {}
        self._outputs: dict[str, dict[str, torch.Tensor]] = {}

    # -- vLLM model interface -----------------------------------------------------------
    def get_input_embeddings(self) -> nn.Module:
        """The talker's codec embedding (HF ``talker.model.codec_embedding``)."""
        return self.model.embed_tokens

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` int32 ids (vLLM's runner; int64 works too) -> ``[num_tokens,
        hidden_size]`` codec embeddings in the model's dtype (the decoder's
        ``embed_tokens``); inside a step :meth:`forward` replaces them with the request's
        prompt rows and frame embeddings."""
        return self.model.embed_input_ids(input_ids)

    def get_mrope_input_positions(self, input_tokens, mm_features):
        """Plain ``[3, len(input_tokens)]`` int64 positions and rope delta 0 (the prompt
        holds no media); :meth:`forward` substitutes HF's positions for image and video
        requests."""
        # The prompt is placeholder ids without media: plain positions (rope delta 0). A
        # prompt built from an image or video request gets HF's positions in forward().
        return plain_mrope_positions(len(input_tokens)), 0

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        """The talker decoder's hidden states ``[num_tokens, hidden_size]``. Inside a step
        it first builds the input rows itself (prompt rows, or a fed code 0's frame
        embeddings after running the code predictor, whose frames become
        :meth:`stage_output_requests`) and HF's M-RoPE positions for image and video
        requests, then keeps each request's last hidden state for its next frame."""
        self._outputs = {}
        if self.stage_step is not None:
            inputs_embeds = self._step_embeds(self.stage_step, input_ids)
            positions = self._step_positions(self.stage_step, positions)
        hidden = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        if self.stage_step is not None:
            for r in self.stage_step.requests():
                state = self._requests.get(r.req_id)
                last = r.num_computed + r.num_tokens - 1
                # a recompute after preemption re-feeds earlier positions: keep the newest
                if state is not None and last >= state.hidden_pos:
                    # a copy: the runner may reuse its output buffer next step
                    state.hidden = hidden[r.start + r.num_tokens - 1].clone()
                    state.hidden_pos = last
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Code-0 logits ``[num_tokens, vocab_size]`` from the codec head, with the codec
        special and speaker ids set to ``-inf`` as HF suppresses them (``codec_eos`` stays
        allowed); None where vLLM's logits processor returns none. ``hidden_states``
        ``[num_tokens, hidden_size]`` in the model's dtype; the logits in vLLM's head dtype
        (the model's dtype unless ``head_dtype`` is overridden, e.g. to float32)."""
        logits = self.logits_processor(self.codec_head, hidden_states)
        if logits is None:
            return None
        # HF suppresses the codec special and speaker ids for code 0 (eos stays allowed).
        return logits.masked_fill(self.suppress[:logits.shape[-1]], float("-inf"))

    def stage_output_requests(self) -> dict[str, dict[str, torch.Tensor]]:
        """Frames computed by the last forward: req id -> ``{"codes": [k, 16] int64}``."""
        return self._outputs

    # -- per-step inputs ----------------------------------------------------------------
    def _step_embeds(self, step, input_ids: torch.Tensor) -> torch.Tensor:
        for req_id in step.finished:
            self._requests.pop(req_id, None)
        embed = self.get_input_embeddings()
        rows = torch.zeros((input_ids.shape[0], embed.weight.shape[1]),
                           dtype=embed.weight.dtype, device=input_ids.device)
        pending: list[tuple[str, _Request, int, int]] = []  # (req id, state, row, frame)
        for r in step.requests():
            if step.failed(r.req_id):
                continue
            try:
                state = self._state(step, r)
                length = state.prompt.num_prompt_tokens
                first, end = r.num_computed, r.num_computed + r.num_tokens
                if first < length:  # prompt rows
                    rows[r.start:r.start + min(end, length) - first] = \
                        state.prompt.prompt_embeds[first:min(end, length)]
                for pos in range(max(first, length), end):
                    row = r.start + pos - first
                    if pos - length < len(state.frames):  # recomputed after preemption
                        if pos == length:
                            logger.info("talker request %s resumed after preemption: its %d "
                                        "frames are reused, not predicted again", r.req_id,
                                        len(state.frames))
                        frame = state.frames[pos - length]
                        rows[row] = self._frame_embeds(frame[None], [state], [pos - length])[0]
                    elif pos - 1 != state.hidden_pos:
                        raise RuntimeError(
                            f"talker request {r.req_id}: position {pos} needs the hidden "
                            f"state at {pos - 1}, which was not kept")
                    else:
                        pending.append((r.req_id, state, row, pos - length))
            except Exception as exc:
                step.fail(r.req_id, exc)
        if pending:
            self._predict_frames(pending, input_ids, rows)
        return rows

    def _step_positions(self, step, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` with the rows of image/video requests replaced by HF's."""
        out = positions
        for r in step.requests():
            state = self._requests.get(r.req_id)
            if state is None or state.mrope is None or step.failed(r.req_id):
                continue
            if out is positions:
                out = positions.clone()
            out[:, r.start:r.start + r.num_tokens] = state.positions(
                r.num_computed, r.num_computed + r.num_tokens).to(out.device)
        return out

    def _state(self, step, r) -> _Request:
        state = self._requests.get(r.req_id)
        payload = step.inputs(r.req_id)
        if state is not None:
            if len(payload.get("sequence_ids", ())) != state.sequence_len:
                self._extend(state, r.req_id, payload)
            return state
        for name in ("sequence_ids", "thinker_embed", "tts_embed", "speaker_id"):
            if name not in payload:
                raise ValueError(f"talker request {r.req_id}: input payload lacks {name!r}")
        speaker_id = int(payload["speaker_id"][0])
        if speaker_id not in self.speakers:
            raise ValueError(f"unknown talker speaker id {speaker_id}")
        prompt = self._prompt(payload, growable=step.grows(r.req_id))
        if prompt.num_prompt_tokens != r.num_prompt_tokens:
            raise ValueError(
                f"talker request {r.req_id}: the prompt has {r.num_prompt_tokens} ids but "
                f"the thinker's output makes {prompt.num_prompt_tokens} talker positions")
        params = step.params(r.req_id)
        greedy = params is None or params.temperature < _GREEDY_TEMPERATURE
        seed = getattr(params, "seed", None)
        embed = self.get_input_embeddings().weight
        generator = torch.Generator(embed.device).manual_seed(seed) \
            if seed is not None and not greedy else None
        state = _Request(prompt, greedy, generator, sequence_len=len(payload["sequence_ids"]))
        if "thinker_positions" in payload:
            table, delta = ti.talker_mrope_positions(
                payload["thinker_positions"], prompt.user_index, prompt.num_prompt_tokens)
            if delta != 0 or not torch.equal(table, plain_mrope_positions(table.shape[1])):
                state.mrope = (table, delta)
        self._requests[r.req_id] = state
        return state

    def _prompt(self, payload: dict[str, torch.Tensor], growable: bool) -> ti.TalkerPrompt:
        embed = self.get_input_embeddings().weight

        def tensor(name):  # the thinker's float rows, in the talker's device and dtype
            value = payload.get(name)
            return None if value is None else value.to(embed.device, embed.dtype)

        return ti.build_talker_prompt(
            self, self.omni_config, payload["sequence_ids"], tensor("thinker_embed"),
            tensor("thinker_hidden"), self.speakers[int(payload["speaker_id"][0])],
            tts_token_embeds=tensor("tts_embed"),
            prompt_len=int(payload["prompt_len"][0]) if "prompt_len" in payload else None,
            growable=growable)

    def _extend(self, state: _Request, req_id: str, payload: dict[str, torch.Tensor]) -> None:
        """Take the thinker rows appended to a growing input (the request is fed in
        chunks while the thinker runs): only the new rows go to the device, the user part
        of the prompt stays, and the assistant turn's rows are projected again
        (:func:`.talker_inputs.extend_talker_prompt`: the prompt equals the one built on
        the whole output). The orchestrator lets the request decode only as far as final
        trailing rows go."""
        embed = self.get_input_embeddings().weight
        sequence = payload["sequence_ids"]
        growth = state.prompt.growth
        new_rows = payload["thinker_embed"][growth.fed if growth else 0:len(sequence) - 1]
        try:
            state.prompt = ti.extend_talker_prompt(
                self, self.omni_config, state.prompt, sequence,
                new_rows.to(embed.device, embed.dtype))
        except ValueError as exc:
            raise ValueError(f"talker request {req_id}: {exc}") from exc
        state.sequence_len = len(sequence)

    def _predict_frames(self, pending, input_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Run the code predictor for the newest decode row of each request in ``pending``."""
        states = [p[1] for p in pending]
        index = torch.tensor([p[2] for p in pending], device=input_ids.device)
        code0 = input_ids[index]
        residual = self.code_predictor.predict(
            torch.stack([s.hidden for s in states]), self.get_input_embeddings()(code0),
            [s.greedy for s in states], [s.generator for s in states])
        frames = torch.cat((code0[:, None], residual), dim=1).to(torch.long)
        rows[index] = self._frame_embeds(frames, states, [p[3] for p in pending])
        on_host = frames.cpu()  # one device-to-host copy for the step's frames
        for (req_id, state, _, _), frame, codes in zip(pending, frames, on_host, strict=True):
            if codes[0] >= self.codebook_size:
                # Not a frame: a code 0 outside the codebook is the stop token
                # (codec_eos), fed back once under async scheduling (vLLM's GPU default
                # schedules the next step before the sampled token is checked).
                continue
            state.frames.append(frame)
            self._outputs[req_id] = {"codes": codes[None]}

    def _frame_embeds(self, frames: torch.Tensor, states: list[_Request],
                      steps: list[int]) -> torch.Tensor:
        """``[B, H]`` decode inputs: the sum of a frame's 16 codebook embeddings plus
        trailing text row ``s`` (``tts_pad`` once the text is exhausted)."""
        out = self.get_input_embeddings()(frames[:, 0])
        for j, table in enumerate(self.code_predictor.get_input_embeddings()):
            out = out + table(frames[:, j + 1])
        text = [s.prompt.trailing_text_hidden[k] if k < s.prompt.trailing_text_hidden.shape[0]
                else s.prompt.tts_pad_embed.reshape(-1) for s, k in zip(states, steps,
                                                                        strict=True)]
        return out + torch.stack(text).to(out.dtype)

    # -- weights ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the checkpoint's ``talker.*`` weights (others are skipped).

        Raises:
            ValueError: a ``talker.`` weight has no parameter here, or a parameter of the
                talker outside its decoder has no weight in the checkpoint.
        """
        decoder, own = [], []
        for name, tensor in weights:
            if self.is_unused_checkpoint_weight(name):
                continue
            name = name.removeprefix(self.checkpoint_prefixes[0])
            if name == "model.codec_embedding.weight":
                name = "model.embed_tokens.weight"
            (decoder if name.startswith("model.") else own).append((name, tensor))
        # vLLM's decoder loader raises on a name it does not know; the names it reports
        # for fused experts differ between vLLM releases, so only the talker's own
        # parameters are checked here.
        loaded = {f"model.{n}" for n in self.model.load_weights(
            (n[len("model."):], t) for n, t in decoder)}
        own_loaded = load_stacked(
            self, own, [n for n, _ in self.named_parameters() if not n.startswith("model.")],
            owner="the talker")
        return loaded | own_loaded
