r"""Stateless pieces of HF ``Qwen3OmniMoeForConditionalGeneration.generate`` for the talker stage.

HF transformers (5.19, ``models/qwen3_omni_moe/modeling_qwen3_omni_moe.py``) runs thinker ->
talker -> code2wav inside one ``generate`` call. Our stages are separate processes with a paged KV
cache, so this module writes the HF glue down: the talker prompt as pure functions
(``build_talker_prompt``, checked bit-for-bit against HF ``generate`` in
``plugin_tests/unit/test_talker_inputs.py``, greedy and sampled with the same global torch seed)
and the decode loop as a description, which ``models/qwen3_omni/talker.py`` serves.

Thinker outputs the talker needs
--------------------------------
HF calls ``thinker.generate(..., output_hidden_states=True, return_dict_in_generate=True)`` and
concatenates, over generation steps, ``hidden_states[0]`` (``thinker_embed``) and
``hidden_states[talker_config.accept_hidden_layer]`` (``thinker_hidden``). Step 0 covers the
``P`` prompt positions and every later step covers one position: the token sampled at the
previous step. ``G`` generated tokens take ``G`` forwards, so the LAST generated token (normally
``<|im_end|>``) is never fed: ``T_fed = P + G - 1 = T_seq - 1`` rows for ``T_seq = P + G``
``sequence_ids``. Row ``p`` belongs to token ``sequence_ids[p]``.

* ``hidden_states[0]`` is the decoder input: ``embed_tokens(id)`` at text positions, the
  audio/image/video encoder features at multimodal positions.
* ``hidden_states[k]`` (k >= 1) is the full residual stream after decoder layer ``k - 1`` (HF
  layers return ``residual + mlp_out``; in vLLM's fused-residual layers that is
  ``hidden_states + residual`` *before* the next layer's input norm). If ``k`` equals the number
  of layers it is the final, normed, state.
* Only multimodal USER positions read ``thinker_hidden`` (through ``hidden_projection``); every
  other position reads ``thinker_embed`` (through ``text_projection``). For a text-only request the
  talker prompt is therefore a function of token ids and the thinker's input-embedding table only.

Talker prompt (``build_talker_prompt``)
---------------------------------------
``prompt_embeds = [user part ; assistant part]``:

* user part: every prompt position whose turn is a user turn (role token right after the most
  recent ``<|im_start|>`` is ``user_token_id``; this includes ``<|im_start|>``, ``user``, the
  content, ``<|im_end|>`` and the ``\n`` after it), in order, projected as above.
* assistant part (9 rows), ``a`` = index of the last ``<|im_start|> assistant`` pair in the prompt,
  ``E = text_projection(thinker_embed[a:])``::

      row  : 0     1     2     3        4          5          6        7          8
      text : E[0]  E[1]  E[2]  pad      pad        pad        pad      bos        E[3]
      codec: -     -     -     nothink  think_bos  think_eos  speaker  codec_pad  codec_bos

  (``pad/bos`` = ``text_projection(thinker_embed_tokens(tts_pad/tts_bos))``; codec row =
  ``talker.get_input_embeddings()(id)``, ``-`` = zeros; each row is text + codec.) ``E[0:3]`` is
  ``<|im_start|>assistant\n`` and ``E[3]`` the first generated text token.
* ``trailing_text_hidden = [E[4:] ; tts_eos]`` (generated tokens 1 .. G-2, i.e. the fed ones, then
  the tts_eos embedding); HF then moves the tts_eos marker to just after the first thinker eos,
  which is a no-op for a single sequence that stopped at eos or at max_new_tokens.
* A prompt without any user turn is not supported by HF (it slices ``[:, -0:]`` and keeps every
  position); here the user part is then empty.
* ``talker_input_ids = [user token ids ; tts_pad_token_id x 9]``; only used by HF for the 3D rope
  index when audio/image/video inputs are present (``audio_feature_lengths`` / grid kwargs).

Talker decode (``models/qwen3_omni/talker.py`` serves it; the test's ``reference_talker_generate``
re-runs it on HF's modules)
----------------------------------------------------------------------------------------------
Prefill: feed ``prompt_embeds`` ([L, H]) at positions ``0 .. L-1``. Decode step ``s`` (0-based)
feeds one embedding at position ``L + s``. Text-only: HF builds 4-row position ids
``[text; t; h; w]`` with all rows equal to ``0..L-1`` (attention mask cumsum - 1) and then
``past_len + rope_delta`` with ``rope_delta = 0``; interleaved M-RoPE with t == h == w == p is
exactly 1-D RoPE at ``p``, so plain 1-D positions give identical results (verified by the test,
which calls ``talker.model`` without position ids). With image or video in the prompt the
positions come from ``talker.get_rope_index(talker_input_ids, ...)`` and are NOT plain:
:func:`talker_mrope_positions` derives them from the thinker's own M-RoPE positions (audio
positions are consecutive, so an audio-only prompt stays plain).

Per frame ``f`` (one talker position gives one 16-code frame):

1. ``h = talker.model(...).last_hidden_state[:, -1]`` (after the final norm) at the last fed
   position; ``logits = talker.codec_head(h)`` in float32.
2. logits processors, in HF order: repetition penalty over the code-0
   tokens generated so far (HF default ``talker_repetition_penalty=1.05``, applied EVEN when
   greedy; the prompt is excluded because HF generates from ``inputs_embeds``), the min-new-tokens
   eos mask (only if requested), then ``talker_logits_mask``: ids ``[V-1024, V)`` minus
   ``codec_eos_token_id`` are set to ``-inf`` (codec special / speaker ids). Greedy: argmax.
   Sampled (HF defaults): temperature 0.9, top_k 50, top_p 1.0, multinomial.
3. ``code0 == codec_eos_token_id`` -> stop; the eos frame is not emitted (HF never computes its
   residual codes).
4. residual codes: code predictor prefill over
   ``[h, talker.codec_embedding(code0)]`` (positions 0, 1, ``lm_head[0]``), then 14 single-token
   steps feeding ``code_predictor.model.codec_embedding[j-1](code_j)`` at position ``j+1`` and
   reading ``lm_head[j]``. Fresh cache per frame. Greedy argmax, or HF sampling (top_k 50,
   top_p 0.8, temperature 1) when the talker samples.
5. Next talker input for decode step ``s = f``:
   ``talker.codec_embedding(code0) + sum_j code_predictor.codec_embedding[j-1](code_j)
   + (trailing_text_hidden[s] if s < len(trailing_text_hidden) else tts_pad_embed)``.

HF ``talker_max_new_tokens = N`` yields at most ``N - 1`` frames: the N-th code 0 is sampled but
its residual codes are never computed (they would be computed by the following forward). So a
loop of ``N - 1`` frames reproduces HF exactly and never runs that wasted forward. HF's
``talker_min_new_tokens = m`` masks eos while fewer than ``m`` code-0 tokens exist.

Code2wav
--------
HF stacks the per-step residual codes into ``[1, 16, T]`` (T = emitted frames; for a single
sequence no eos column ever exists, so nothing is trimmed) and calls
``code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25)``, returning
``wav.float()`` of shape ``[1, 1, samples]``. (For batches HF zeroes codes past each row's eos
and cuts each waveform; not needed per request.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from vllm_omni_plugin.processors.hookspecs import Voices

__all__ = [
    "HF_CODE2WAV_CHUNK_SIZE",
    "HF_CODE2WAV_LEFT_CONTEXT",
    "HF_CODE_PREDICTOR_TOP_K",
    "HF_CODE_PREDICTOR_TOP_P",
    "PromptGrowth",
    "TalkerPrompt",
    "build_talker_prompt",
    "extend_talker_prompt",
    "sample_from_logits",
    "talker_logits_mask",
    "talker_mrope_positions",
    "tts_token_embeds_from",
]

# ``Qwen3OmniMoeTalkerForConditionalGeneration.prepare_inputs_for_generation`` when sampling.
HF_CODE_PREDICTOR_TOP_K = 50
HF_CODE_PREDICTOR_TOP_P = 0.8
# ``Qwen3OmniMoeForConditionalGeneration.generate`` -> ``code2wav.chunked_decode``.
HF_CODE2WAV_CHUNK_SIZE = 300
HF_CODE2WAV_LEFT_CONTEXT = 25
# Number of trailing talker vocab ids HF suppresses (all except codec eos).
_SUPPRESSED_TAIL = 1024
#: Positions HF's talker prompt adds for the assistant turn: 3 text positions
#: ("<|im_start|>assistant\n"), 4 tts_pad, 1 tts_bos, 1 first text token
#: (``Qwen3OmniMoeForConditionalGeneration._get_talker_assistant_parts``).
ASSISTANT_PREFIX_LEN = 9
#: Fed thinker rows from the assistant turn's start that HF's talker prompt reads: 3 of
#: ``<|im_start|>assistant\n`` and 1 of the first generated token (fed with the second's
#: step), ``Qwen3OmniMoeForConditionalGeneration._get_talker_assistant_parts``. A reply of
#: one token has no such row: there is nothing to speak.
ASSISTANT_ROWS = 4
#: HF ``Qwen3OmniMoeForConditionalGeneration.generate``'s default speaker.
DEFAULT_SPEAKER = "ethan"


def voices(talker_config) -> Voices | None:
    """The checkpoint's voices (``talker_config.speaker_id``'s names), None when it has
    none. The default is :data:`DEFAULT_SPEAKER`, or the alphabetically first
    (lower-cased) name when the checkpoint lacks it."""
    names = sorted(getattr(talker_config, "speaker_id", None) or {}, key=str.lower)
    if not names:
        return None
    lower = sorted(name.lower() for name in names)
    return Voices(names=names,
                  default=DEFAULT_SPEAKER if DEFAULT_SPEAKER in lower else lower[0])


def resolve_speaker(talker_config, voice: str | None) -> int:
    """A request's voice (case-insensitive; None: the default, see :func:`voices`) ->
    the talker's speaker codec id, checked by :meth:`Voices.resolve`.

    Raises:
        ValueError: unknown voice (the message lists the known ones), or the
            checkpoint defines none.
    """
    known = voices(talker_config)
    if known is None:
        raise ValueError("the checkpoint's talker_config defines no speakers")
    name = known.resolve(voice).lower()
    return next(v for k, v in talker_config.speaker_id.items() if k.lower() == name)


@dataclass
class TalkerPrompt:
    """Talker inputs derived from one finished thinker request (batch of one).

    prompt_embeds: ``[L, H_talker]`` prefill embeddings (positions ``0..L-1``).
    trailing_text_hidden: ``[K, H_talker]``; decode step ``s`` adds row ``s`` while ``s < K``.
    tts_pad_embed: ``[1, H_talker]``; added at decode steps ``s >= K``.
    talker_input_ids: ``[L]`` what HF passes as ``talker_input_ids`` (user token ids, then
        ``tts_pad_token_id``); only used for the multimodal 3D rope index.
    user_index: ``[L - 9]`` int64, the thinker prompt position of each user-part row.
    growth: what :func:`extend_talker_prompt` needs to take more thinker rows (built with
        ``growable=True``); None otherwise.
    """

    prompt_embeds: torch.Tensor
    trailing_text_hidden: torch.Tensor
    tts_pad_embed: torch.Tensor
    talker_input_ids: torch.Tensor
    user_index: torch.Tensor
    growth: PromptGrowth | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """``L``, the talker prompt's length (rows of ``prompt_embeds``)."""
        return int(self.prompt_embeds.shape[0])


@dataclass
class PromptGrowth:
    """The part of a talker prompt's inputs that :func:`extend_talker_prompt` reads again
    when the thinker's output grows; everything else in the prompt stays as built.

    assistant_rows: ``[capacity, H_thinker]`` buffer (the talker's device and dtype) whose
        first ``fed - assistant_start`` rows are the thinker rows of the assistant turn
        (``thinker_embed[assistant_start:fed]``); its capacity doubles when full.
    fed: ``T_fed``, the thinker rows the prompt holds.
    assistant_start: thinker position of the assistant turn's ``<|im_start|>``.
    prompt_len: thinker prompt tokens (``P``).
    tts: ``[1, 3, H_talker]`` the projected tts_bos, tts_eos, tts_pad rows.
    assistant_codec: ``[1, 9, H_talker]`` the codec half of the assistant prefix.
    thinker_eos_token_id: as given to :func:`build_talker_prompt`.
    """

    assistant_rows: torch.Tensor
    fed: int
    assistant_start: int
    prompt_len: int
    tts: torch.Tensor
    assistant_codec: torch.Tensor
    thinker_eos_token_id: int | Sequence[int] | None


def _talker_dtype(talker: nn.Module) -> torch.dtype:
    return talker.get_input_embeddings().weight.dtype


def tts_token_embeds_from(thinker_embed_tokens: nn.Module | torch.Tensor, config) -> torch.Tensor:
    """THINKER input-embedding rows of (tts_bos, tts_eos, tts_pad): ``[3, H_thinker]``.

    ``thinker_embed_tokens`` is the thinker's ``embed_tokens`` module
    (``thinker.get_input_embeddings()``) or its weight ``[V_thinker, H_thinker]``. The talker
    stage must hold these 3 rows: the tts tokens never appear in the thinker's sequence.
    The rows have the table's dtype (the thinker's) and device.
    """
    ids = torch.tensor(
        [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id],
        dtype=torch.long,
    )
    if isinstance(thinker_embed_tokens, torch.Tensor):
        return thinker_embed_tokens[ids.to(thinker_embed_tokens.device)]
    weight = thinker_embed_tokens.weight
    return thinker_embed_tokens(ids.to(weight.device))


@torch.no_grad()
def build_talker_prompt(
    talker: nn.Module,
    config,
    sequence_ids: torch.Tensor,
    thinker_embed: torch.Tensor,
    thinker_hidden: torch.Tensor | None,
    speaker: str,
    *,
    tts_token_embeds: torch.Tensor,
    prompt_len: int | None = None,
    thinker_eos_token_id: int | Sequence[int] | None = -1,
    growable: bool = False,
) -> TalkerPrompt:
    """Build the talker prompt exactly like HF ``Qwen3OmniMoeForConditionalGeneration.generate``.

    Args:
        talker: HF ``Qwen3OmniMoeTalkerForConditionalGeneration`` (text/hidden projections,
            codec embedding).
        config: top-level ``Qwen3OmniMoeConfig``.
        sequence_ids: ``[T_seq]`` prompt ids + generated ids (HF ``thinker_result.sequences[0]``),
            any integer dtype (flattened, read as int64).
        thinker_embed: ``[T_fed, H_thinker]`` thinker ``hidden_states[0]`` per fed position,
            ``T_fed = T_seq - 1`` (extra trailing rows are ignored, as HF never has them).
            Float, in the dtype of the talker's projections (as are the other thinker rows).
        thinker_hidden: ``[T_fed, H_thinker]`` thinker ``hidden_states[accept_hidden_layer]``.
            Only read at multimodal user positions; may be ``None`` for text-only prompts.
        speaker: speaker name (case-insensitive key of ``talker_config.speaker_id``).
        tts_token_embeds: ``[3, H_thinker]`` thinker input embeddings of tts_bos, tts_eos,
            tts_pad (see ``tts_token_embeds_from``).
        prompt_len: number of prompt tokens in ``sequence_ids``. If ``None`` it is inferred as
            "last ``<|im_start|> assistant`` pair + 3" (the chat template's generation prompt),
            which is wrong if the prompt pre-fills assistant text: pass it when known.
        thinker_eos_token_id: ids HF uses to relocate the tts_eos marker (HF default
            ``thinker_eos_token_id``); ``-1`` means ``config.im_end_token_id``, ``None`` disables.
        growable: keep what :func:`extend_talker_prompt` needs (:class:`PromptGrowth`: a
            copy of the assistant turn's thinker rows) for a thinker output that grows.

    Returns:
        The :class:`TalkerPrompt` (shapes there): embeddings in the talker's dtype, ids and
        ``user_index`` int64, on ``thinker_embed``'s device.

    Raises:
        ValueError: no ``<|im_start|>assistant`` in the prompt, ``prompt_len`` outside the
            sequence, fewer than ``T_seq - 1`` rows of ``thinker_embed``, fewer than 4 fed
            rows of the assistant turn, ``thinker_hidden`` None for a prompt with media, or
            an unknown speaker.
    """
    tcfg = config.talker_config
    speaker_id = resolve_speaker(tcfg, speaker)

    seq = sequence_ids.reshape(-1).to(torch.long)
    t_seq = int(seq.shape[0])
    dev = thinker_embed.device
    seq = seq.to(dev)

    # Assistant turn start: last `<|im_start|> assistant` pair inside the prompt.
    search = seq if prompt_len is None else seq[:prompt_len]
    pair = (search[:-1] == config.im_start_token_id) & (search[1:] == config.assistant_token_id)
    starts = torch.nonzero(pair, as_tuple=False).flatten()
    if starts.numel() == 0:
        raise ValueError(
            "The thinker sequence has no assistant turn (`<|im_start|>assistant`, ids "
            f"{config.im_start_token_id}, {config.assistant_token_id}) in its prompt; the talker "
            "prompt cannot be built."
        )
    assistant_start = int(starts[-1])
    if prompt_len is None:
        prompt_len = assistant_start + 3
    if not 0 < prompt_len <= t_seq:
        raise ValueError(f"prompt_len={prompt_len} is outside the sequence (length {t_seq})")

    t_fed = t_seq - 1
    if thinker_embed.shape[0] < t_fed:
        raise ValueError(
            f"thinker_embed has {thinker_embed.shape[0]} rows; need T_seq - 1 = {t_fed} (every "
            "position except the last generated token)"
        )
    if t_fed - assistant_start < ASSISTANT_ROWS:
        raise ValueError(
            "The assistant turn needs `<|im_start|>assistant\\n` plus at least one fed generated "
            f"token; got {t_fed - assistant_start} fed rows from position {assistant_start}"
        )
    embed = thinker_embed[:t_fed].unsqueeze(0)  # [1, T_fed, Ht]
    dtype = _talker_dtype(talker)
    h_talker = tcfg.text_config.hidden_size
    prompt = seq[:prompt_len].unsqueeze(0)  # [1, P]

    # ---- user part (HF `_get_talker_user_parts(0, P, ...)` + gather) -----------------------
    tcfg_thinker = config.thinker_config
    mm_mask = (
        (seq == tcfg_thinker.audio_token_id)
        | (seq == tcfg_thinker.image_token_id)
        | (seq == tcfg_thinker.video_token_id)
    ).unsqueeze(0)[:, :prompt_len]
    positions = torch.arange(prompt_len, device=dev).unsqueeze(0)
    im_start_pos = torch.where(
        prompt == config.im_start_token_id, positions, positions.new_full((), -1)
    )
    prev_im_start = torch.cummax(im_start_pos, dim=-1).values.clamp_min(0)
    role_ids = prompt.gather(1, (prev_im_start + 1).clamp_max(prompt_len - 1))
    user_mask = role_ids == config.user_token_id
    n_user = int(user_mask.sum())

    user_part = torch.empty((1, prompt_len, h_talker), device=dev, dtype=dtype)
    if mm_mask.any():
        if thinker_hidden is None:
            raise ValueError("thinker_hidden is required: the prompt has audio/image/video tokens")
        hidden = thinker_hidden[:t_fed].unsqueeze(0)[:, :prompt_len][mm_mask]
        user_part[mm_mask] = talker.hidden_projection(hidden).to(dtype)
    user_part[~mm_mask] = talker.text_projection(embed[:, :prompt_len][~mm_mask]).to(dtype)
    if n_user > 0:
        user_idx = torch.where(user_mask, prompt_len + positions, positions).argsort(dim=-1)
        user_idx = user_idx[:, -n_user:]
    else:
        # HF slices `[:, -0:]` here (i.e. keeps every position); a prompt without a user turn is
        # not something HF supports, so use an empty user part.
        user_idx = positions[:, :0]
    user_embeds = user_part.gather(1, user_idx.unsqueeze(-1).expand(-1, -1, h_talker))
    user_ids = prompt.gather(1, user_idx)

    # ---- tts special embeddings ---------------------------------------------------------
    tts = talker.text_projection(tts_token_embeds.to(dev).reshape(1, 3, -1))

    # ---- assistant part (HF `_get_talker_assistant_parts`) -------------------------------
    codec_ids = torch.tensor(
        [
            [
                tcfg.codec_nothink_id,
                tcfg.codec_think_bos_id,
                tcfg.codec_think_eos_id,
                speaker_id,
                tcfg.codec_pad_id,
                tcfg.codec_bos_id,
            ]
        ],
        device=dev,
        dtype=torch.long,
    )
    assistant_codec = torch.cat(
        (
            torch.zeros((1, 3, h_talker), device=dev, dtype=dtype),
            talker.get_input_embeddings()(codec_ids),
        ),
        dim=1,
    )
    assistant_embeds, trailing = _assistant_part(
        talker, config, embed[:, assistant_start:], tts, assistant_codec, seq[prompt_len:],
        thinker_eos_token_id)

    prompt_embeds = torch.cat((user_embeds, assistant_embeds), dim=1)[0]
    talker_input_ids = torch.cat(
        (
            user_ids[0],
            torch.full((ASSISTANT_PREFIX_LEN,), config.tts_pad_token_id, device=dev),
        )
    ).to(torch.long)
    growth = None
    if growable:
        rows = embed[0, assistant_start:]
        buffer = rows.new_empty((_capacity(rows.shape[0]), rows.shape[1]))
        buffer[:rows.shape[0]] = rows
        growth = PromptGrowth(assistant_rows=buffer, fed=t_fed, assistant_start=assistant_start,
                              prompt_len=prompt_len, tts=tts, assistant_codec=assistant_codec,
                              thinker_eos_token_id=thinker_eos_token_id)
    return TalkerPrompt(
        prompt_embeds=prompt_embeds,
        trailing_text_hidden=trailing[0],
        tts_pad_embed=tts[:, 2],
        talker_input_ids=talker_input_ids,
        user_index=user_idx[0],
        growth=growth,
    )


def _capacity(rows: int) -> int:
    """Rows a growing buffer holding ``rows`` gets: room to double."""
    return max(2 * rows, 16)


def _assistant_part(talker: nn.Module, config, rows: torch.Tensor, tts: torch.Tensor,
                    assistant_codec: torch.Tensor, generated: torch.Tensor,
                    thinker_eos_token_id) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's assistant prefix ``[1, 9, H]`` and trailing text ``[1, M - 3, H]`` from the
    assistant turn's thinker rows ``rows`` ``[1, M, H_thinker]`` (``M >= 4``), all projected
    in one batch as HF does (a row projected in another batch may differ by float
    rounding), ``tts`` ``[1, 3, H]``, ``assistant_codec`` ``[1, 9, H]`` and the generated
    ids ``generated`` ``[G]`` (for the tts_eos relocation)."""
    dev = rows.device
    tts_bos, tts_eos, tts_pad = tts.chunk(3, dim=1)  # 3 x [1, 1, H]
    assistant_hidden = talker.text_projection(rows)
    assistant_text = torch.cat(
        (assistant_hidden[:, :3], tts_pad.expand(1, 4, -1), tts_bos, assistant_hidden[:, 3:4]),
        dim=1,
    )
    assistant_embeds = assistant_text + assistant_codec
    trailing = torch.cat((assistant_hidden[:, 4:], tts_eos), dim=1)

    # ---- tts_eos relocation after the first thinker eos (no-op for a single request) -----
    if thinker_eos_token_id is not None:
        eos_ids = config.im_end_token_id if thinker_eos_token_id == -1 else thinker_eos_token_id
        gen = generated.to(dev)
        is_eos = (gen.unsqueeze(-1) == torch.as_tensor(eos_ids, device=dev).flatten()).any(-1)
        gen_pos = torch.arange(gen.shape[0], device=dev)
        first_eos = int(torch.where(is_eos, gen_pos, gen.shape[0]).min()) if gen.numel() else 0
        trail_pos = torch.arange(trailing.shape[1], device=dev).unsqueeze(0).unsqueeze(-1)
        trailing = torch.where(trail_pos > first_eos, tts_pad.to(trailing.dtype), trailing)
        trailing = torch.where(trail_pos == first_eos, tts_eos.to(trailing.dtype), trailing)
    return assistant_embeds, trailing


@torch.no_grad()
def extend_talker_prompt(talker: nn.Module, config, prompt: TalkerPrompt,
                         sequence_ids: torch.Tensor, new_embed: torch.Tensor) -> TalkerPrompt:
    """``prompt`` (built with ``growable=True``) for a thinker output that grew: equal, bit
    for bit, to :func:`build_talker_prompt` on the whole output, at a cost that does not
    grow with the thinker's prompt. The user part stays; ``new_embed`` is appended to the
    assistant turn's thinker rows, which are projected again in one batch (as HF projects
    them: projecting only the new rows gave rows that differ by float rounding), and the
    assistant prefix (the last 9 rows of ``prompt_embeds``, updated in place) and the
    trailing text are made from them.

    Args:
        talker: the talker whose ``text_projection`` built ``prompt``.
        config: top-level ``Qwen3OmniMoeConfig``.
        prompt: the prompt so far; its ``prompt_embeds`` and ``growth`` are updated.
        sequence_ids: ``[T_seq]`` the grown output's prompt and generated ids (any integer
            dtype; only the generated ones are read).
        new_embed: ``[T_seq - 1 - growth.fed, H_thinker]`` the thinker's ``hidden_states[0]``
            of the positions fed since ``prompt`` was built, in the talker's device and
            dtype.

    Returns:
        ``prompt`` with the new ``trailing_text_hidden`` and prefix rows; its ``growth``
        holds the new rows.

    Raises:
        ValueError: ``prompt`` was not built growable, the output shrank, or the number of
            new rows differs from what the ids say.
    """
    growth = prompt.growth
    if growth is None:
        raise ValueError("the talker prompt was not built to grow (growable=False)")
    seq = sequence_ids.reshape(-1)
    t_fed = int(seq.shape[0]) - 1
    if t_fed < growth.fed or new_embed.shape[0] != t_fed - growth.fed:
        raise ValueError(
            f"the thinker output grew from {growth.fed} to {t_fed} fed rows, but "
            f"{new_embed.shape[0]} new rows came")
    begin, end = growth.fed - growth.assistant_start, t_fed - growth.assistant_start
    rows = growth.assistant_rows
    if end > rows.shape[0]:
        grown = rows.new_empty((_capacity(end), rows.shape[1]))
        grown[:begin] = rows[:begin]
        growth.assistant_rows = rows = grown
    rows[begin:end] = new_embed
    growth.fed = t_fed
    assistant_embeds, trailing = _assistant_part(
        talker, config, rows[None, :end], growth.tts, growth.assistant_codec,
        seq[growth.prompt_len:].to(torch.long), growth.thinker_eos_token_id)
    prompt.prompt_embeds[-ASSISTANT_PREFIX_LEN:] = assistant_embeds[0]
    return replace(prompt, trailing_text_hidden=trailing[0])


def talker_mrope_positions(thinker_positions: torch.Tensor, user_index: torch.Tensor,
                           length: int) -> tuple[torch.Tensor, int]:
    r"""The talker prompt's M-RoPE positions, as HF's ``talker.get_rope_index`` computes them.

    HF runs ``get_rope_index`` over ``talker_input_ids`` (the user turns' ids, then 9
    ``tts_pad``). That index is built left to right from "largest position so far + 1", so
    dropping whole text turns (system, earlier assistant turns) shifts every later position by
    a constant: each run of consecutive user positions keeps the thinker's positions, minus
    the offset that makes its first token (``<|im_start|>``, text) follow the previous run's
    last token (``\n``, text). This reuses the thinker's own positions (vLLM's M-RoPE index
    of the thinker prompt) instead of repeating the media grids to the talker; it assumes the
    talker config's ``position_id_per_seconds`` and ``spatial_merge_size`` equal the thinker's,
    as in the released checkpoints.

    Args:
        thinker_positions: ``[P', 3]`` int (``P' >=`` the thinker prompt length) the thinker's
            ``(t, h, w)`` position of each fed thinker position.
        user_index: ``[n_user]`` :attr:`TalkerPrompt.user_index`.
        length: the talker prompt length ``L = n_user + 9``.

    Returns:
        ``([3, L]`` int64 positions, ``delta``): a position ``p >= L`` (decode) is ``p + delta``
        in all three rows.
    """
    src = thinker_positions.to("cpu", torch.long)[user_index.to("cpu")]  # [n_user, 3]
    out = torch.empty_like(src)
    index = user_index.tolist()
    next_start, run_start = 0, 0
    for k in range(1, len(index) + 1):
        if k == len(index) or index[k] != index[k - 1] + 1:  # run [run_start, k) ends
            offset = int(src[run_start, 0]) - next_start
            out[run_start:k] = src[run_start:k] - offset
            next_start = int(out[k - 1].max()) + 1
            run_start = k
    tail = torch.arange(next_start, next_start + length - len(index))
    positions = torch.cat((out.T, tail.expand(3, -1)), dim=1)
    return positions, next_start - len(index)


def sample_from_logits(
    logits: torch.Tensor,
    *,
    greedy: bool,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """HF warpers (temperature -> top_k -> top_p) + multinomial, or argmax. ``logits``: [1, V].

    ``logits`` may be any float dtype (warped in float32); returns ``[1]`` int64 ids
    (``[B]`` for ``[B, V]`` logits: rows are sampled independently).
    """
    logits = logits.float()
    if greedy:
        return torch.argmax(logits, dim=-1)
    if temperature is not None and temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k != 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k)[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def talker_logits_mask(config, vocab_size: int | None = None) -> torch.Tensor:
    """``BoolTensor[V]``, True = suppressed (logit set to ``-inf``) for the talker's code 0.

    HF passes ``suppress_tokens = [V-1024, V) minus codec_eos_token_id`` with
    ``V = talker_config.text_config.vocab_size``: the codec special / speaker ids above the
    codebook can never be generated; eos stays allowed. The mask is ``[vocab_size]`` (default:
    that ``V``), dtype bool, on the CPU.
    """
    tcfg = getattr(config, "talker_config", config)
    v_cfg = tcfg.text_config.vocab_size
    v = v_cfg if vocab_size is None else vocab_size
    mask = torch.zeros(v, dtype=torch.bool)
    mask[max(v_cfg - _SUPPRESSED_TAIL, 0) : min(v_cfg, v)] = True
    if 0 <= tcfg.codec_eos_token_id < v:
        mask[tcfg.codec_eos_token_id] = False
    return mask
