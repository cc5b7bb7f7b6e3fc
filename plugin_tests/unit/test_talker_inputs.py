"""Parity of ``vllm_omni_plugin.models.qwen3_omni.talker_inputs`` with HF ``generate``.

A tiny random Qwen3-Omni (the ``tiny_checkpoint`` tool's checkpoint when it can be written and
loaded, otherwise an equivalent in-process config; seed 0, float32) runs HF
``Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)`` with greedy thinker and
talker (the code predictor follows the talker's ``do_sample``). Its codes, captured at
``code2wav.chunked_decode``, must EQUAL the codes of: HF ``thinker.generate`` -> our
``build_talker_prompt`` -> ``reference_talker_generate`` (which only uses HF's talker decoder
with a ``DynamicCache``), and the waveforms must match.

With the checkpoint's random weights the talker never picks ``codec_eos`` by itself (3072-id
vocab), so HF and the reference both stop at ``talker_max_new_tokens`` (HF: ``N`` tokens ->
``N - 1`` frames; reference: ``max_steps=N - 1``); the fallback model may emit eos on its own. The
eos path is also tested by biasing the eos logit on both sides and forcing a minimum length with
``talker_min_new_tokens`` / ``min_new_tokens`` (HF's MinNewTokensLengthLogitsProcessor).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pytest
import torch
from torch import nn
from transformers import (
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeForConditionalGeneration,
)

from vllm_omni_plugin.models.qwen3_omni import talker_inputs as ti

THINKER_MAX_NEW = 12
TALKER_MAX_NEW = 20  # HF max_new_tokens -> 19 frames


# --------------------------------------------------------------------------------------------
# HF's talker loop, re-expressed on HF's talker modules (the reference ``build_talker_prompt``
# is checked through; the served talker, ``models/qwen3_omni/talker.py``, is checked against
# HF ``generate`` directly in plugin_tests/engine/test_pipeline_engine.py)
# --------------------------------------------------------------------------------------------

# Defaults of ``Qwen3OmniMoeForConditionalGeneration.generate`` (transformers 5.19).
HF_TALKER_TEMPERATURE = 0.9
HF_TALKER_TOP_K = 50
HF_TALKER_TOP_P = 1.0
HF_TALKER_REPETITION_PENALTY = 1.05


@torch.no_grad()
def talker_step_embeds(
    talker: nn.Module,
    codes: torch.Tensor,
    step: int,
    trailing_text_hidden: torch.Tensor,
    tts_pad_embed: torch.Tensor,
) -> torch.Tensor:
    """Talker input embedding ``[1, H]`` for decode step ``step`` (0-based after the prefill).

    ``codes`` are the ``num_code_groups`` codes of frame ``step`` (the frame produced by the
    previous talker position). Mirrors HF ``prepare_inputs_for_generation``: the codec embedding
    of code 0 plus the code predictor's embedding ``j-1`` of code ``j`` (summed in that order),
    plus ``trailing_text_hidden[step]`` or, once exhausted, ``tts_pad_embed``.
    """
    codes = codes.reshape(-1).to(torch.long)
    dev = talker.get_input_embeddings().weight.device
    codes = codes.to(dev)
    cp_embeds = talker.code_predictor.get_input_embeddings()
    if codes.shape[0] != len(cp_embeds) + 1:
        raise ValueError(f"expected {len(cp_embeds) + 1} codes, got {codes.shape[0]}")
    parts = [talker.get_input_embeddings()(codes[:1])]
    parts += [cp_embeds[j - 1](codes[j : j + 1]) for j in range(1, codes.shape[0])]
    embeds = torch.cat(parts, dim=0).unsqueeze(0).sum(1)  # [1, H]
    if step < trailing_text_hidden.shape[0]:
        return embeds + trailing_text_hidden[step : step + 1].to(embeds.device)
    return embeds + tts_pad_embed.reshape(1, -1).to(embeds.device)


@torch.no_grad()
def predict_residual_codes(
    talker: nn.Module,
    last_hidden: torch.Tensor,
    code0: torch.Tensor,
    greedy: bool = True,
    generator: torch.Generator | None = None,
    *,
    top_k: int = ti.HF_CODE_PREDICTOR_TOP_K,
    top_p: float = ti.HF_CODE_PREDICTOR_TOP_P,
) -> torch.Tensor:
    """All ``num_code_groups`` codes of one frame (code0 first): ``LongTensor[num_code_groups]``.

    ``last_hidden``: ``[1, H]`` talker last-layer (post-norm) hidden state at the position whose
    ``codec_head`` logits produced ``code0``. Equivalent to HF's
    ``code_predictor.generate(inputs_embeds=[last_hidden, codec_embedding(code0)],
    max_new_tokens=num_code_groups-1)``: greedy is exact; sampled uses HF's top_k=50, top_p=0.8.
    """
    from transformers import DynamicCache

    cp = talker.code_predictor
    dev = last_hidden.device
    code0 = code0.reshape(1).to(device=dev, dtype=torch.long)
    cp_embeds = cp.get_input_embeddings()
    num_groups = len(cp_embeds) + 1
    cache = DynamicCache(config=cp.config)
    code0_embed = talker.get_input_embeddings()(code0).reshape(1, 1, -1)
    inputs = torch.cat((last_hidden.reshape(1, 1, -1).to(code0_embed.dtype), code0_embed), dim=1)
    codes = [code0]
    for j in range(num_groups - 1):
        out = cp.model(inputs_embeds=inputs, past_key_values=cache, use_cache=True)
        logits = cp.lm_head[j](out.last_hidden_state)[:, -1]
        code = ti.sample_from_logits(
            logits, greedy=greedy, top_k=top_k, top_p=top_p, generator=generator
        ).to(torch.long)
        codes.append(code)
        if j + 1 < num_groups - 1:
            inputs = cp_embeds[j](code).reshape(1, 1, -1)
    return torch.cat(codes)


def process_talker_logits(
    logits: torch.Tensor,
    generated_code0: torch.Tensor | Sequence[int],
    config,
    *,
    repetition_penalty: float = HF_TALKER_REPETITION_PENALTY,
    min_new_tokens: int = 0,
    suppress_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """HF's talker logits processors for code 0, in HF order. ``logits``: [1, V] -> float32 [1, V].

    1. repetition penalty (``RepetitionPenaltyLogitsProcessor``) over the code-0 ids generated so
       far in this request (not the prompt): ``x < 0 ? x * p : x / p`` once per distinct id;
    2. if ``len(generated_code0) < min_new_tokens``: eos -> -inf (``MinNewTokensLength``);
    3. suppress mask (``ti.talker_logits_mask``) -> -inf.
    """
    tcfg = getattr(config, "talker_config", config)
    scores = logits.float().reshape(1, -1).clone()
    prev = torch.as_tensor(generated_code0, dtype=torch.long, device=scores.device).reshape(1, -1)
    if repetition_penalty is not None and repetition_penalty != 1.0 and prev.numel() > 0:
        score = torch.gather(scores, 1, prev)
        score = torch.where(score < 0, score * repetition_penalty, score / repetition_penalty)
        scores = scores.scatter(1, prev, score)
    if prev.shape[1] < min_new_tokens:
        scores[:, tcfg.codec_eos_token_id] = -float("inf")
    if suppress_mask is None:
        suppress_mask = ti.talker_logits_mask(config, scores.shape[-1])
    return scores.masked_fill(suppress_mask.to(scores.device), -float("inf"))


@torch.no_grad()
def reference_talker_generate(
    talker: nn.Module,
    config,
    prompt: ti.TalkerPrompt,
    max_steps: int,
    *,
    repetition_penalty: float = HF_TALKER_REPETITION_PENALTY,
    min_new_tokens: int = 0,
    greedy: bool = True,
    temperature: float = HF_TALKER_TEMPERATURE,
    top_k: int = HF_TALKER_TOP_K,
    top_p: float = HF_TALKER_TOP_P,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Reference talker loop on a plain ``DynamicCache``: ``LongTensor[num_code_groups, T]``.

    Equals HF ``generate(..., talker_max_new_tokens=max_steps + 1,
    talker_repetition_penalty=repetition_penalty, talker_min_new_tokens=min_new_tokens)`` codes
    (greedy: exactly). ``T <= max_steps``; the eos frame is never included.
    """
    from transformers import DynamicCache

    tcfg = config.talker_config
    eos = tcfg.codec_eos_token_id
    dev = prompt.prompt_embeds.device
    suppress = ti.talker_logits_mask(config, tcfg.text_config.vocab_size).to(dev)
    cache = DynamicCache(config=tcfg.text_config)

    def forward(embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Positions default to cache length + arange: prefill 0..L-1, decode step s at L + s.
        out = talker.model(inputs_embeds=embeds.unsqueeze(0), past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state  # [1, n, H], post final norm
        return hidden[:, -1], talker.codec_head(hidden)[:, -1]

    hidden, logits = forward(prompt.prompt_embeds)
    frames: list[torch.Tensor] = []
    code0_history: list[int] = []
    for step in range(max_steps):
        scores = process_talker_logits(
            logits,
            code0_history,
            config,
            repetition_penalty=repetition_penalty,
            min_new_tokens=min_new_tokens,
            suppress_mask=suppress,
        )
        code0 = ti.sample_from_logits(
            scores,
            greedy=greedy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
        )
        if int(code0) == eos:
            break
        code0_history.append(int(code0))
        codes = predict_residual_codes(talker, hidden, code0, greedy=greedy, generator=generator)
        frames.append(codes)
        if len(frames) == max_steps:
            break
        embeds = talker_step_embeds(
            talker, codes, step, prompt.trailing_text_hidden, prompt.tts_pad_embed
        )
        hidden, logits = forward(embeds)
    if not frames:
        return torch.zeros((tcfg.num_code_groups, 0), dtype=torch.long, device=dev)
    return torch.stack(frames, dim=1)


def codes_for_code2wav(
    codes: torch.Tensor, codec_eos_token_id: int | None = None
) -> torch.Tensor:
    """``[num_code_groups, T]`` frames -> ``[1, num_code_groups, T']`` code2wav input.

    HF calls ``code2wav.chunked_decode(x, chunk_size=300, left_context_size=25)`` on exactly the
    emitted frames (``T' = T``). If ``codec_eos_token_id`` is given, frames from the first one whose
    code 0 is eos are dropped (for callers that record the eos step).
    """
    if codes.dim() != 2:
        raise ValueError(f"expected codes [num_code_groups, T], got shape {tuple(codes.shape)}")
    codes = codes.to(torch.long)
    if codec_eos_token_id is not None:
        hits = torch.nonzero(codes[0] == codec_eos_token_id, as_tuple=False).flatten()
        if hits.numel():
            codes = codes[:, : int(hits[0])]
    return codes.unsqueeze(0)


# --------------------------------------------------------------------------------------------
# Model fixture
# --------------------------------------------------------------------------------------------
def _fallback_config() -> Qwen3OmniMoeConfig:
    """Tiny config mirroring the upstream layout (codebook 64 + 1024 codec specials)."""
    vocab = 512
    rope = {
        "rope_type": "default",
        "rope_theta": 1e6,
        "mrope_section": [4, 2, 2],
        "interleaved": True,
        "mrope_interleaved": True,
    }
    mm = dict(audio_token_id=508, image_token_id=509, video_token_id=510, audio_start_token_id=511)
    moe = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        rope_parameters=rope,
        max_position_embeddings=512,
    )
    thinker = dict(
        audio_config=dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            d_model=16,
            output_dim=64,
            n_window=4,
            n_window_infer=8,
            conv_chunksize=8,
            downsample_hidden_size=8,
            max_source_positions=64,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=64,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
            patch_size=4,
        ),
        text_config=dict(vocab_size=vocab, **moe),
        user_token_id=506,
        vision_start_token_id=499,
        **mm,
    )
    cb = 64
    talker = dict(
        text_config=dict(vocab_size=cb + 1024, shared_expert_intermediate_size=32, **moe),
        code_predictor_config=dict(
            vocab_size=cb,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_code_groups=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            max_position_embeddings=64,
        ),
        num_code_groups=16,
        thinker_hidden_size=64,
        accept_hidden_layer=1,
        codec_pad_id=cb + 100,
        codec_bos_id=cb + 101,
        codec_eos_token_id=cb + 102,
        codec_nothink_id=cb + 107,
        codec_think_bos_id=cb + 108,
        codec_think_eos_id=cb + 109,
        speaker_id={"chelsie": cb + 253, "ethan": cb + 254, "aiden": cb + 255},
        vision_start_token_id=499,
        spatial_merge_size=2,
        **mm,
    )
    code2wav = dict(
        codebook_size=cb,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        num_quantizers=16,
        upsample_rates=[2, 2],
        upsampling_ratios=[2],
        decoder_dim=32,
        sliding_window=8,
        max_position_embeddings=512,
    )
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        im_start_token_id=500,
        im_end_token_id=501,
        tts_pad_token_id=502,
        tts_bos_token_id=503,
        tts_eos_token_id=504,
        system_token_id=505,
        user_token_id=506,
        assistant_token_id=507,
    )


@pytest.fixture(scope="session")
def talker_parity_model(tiny_qwen3_omni):
    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_qwen3_omni, dtype=torch.float32).eval()


def _prompt_ids(config) -> torch.Tensor:
    """system / user / assistant / user / generation prompt (ChatML layout, filler text ids)."""
    s, e, nl = config.im_start_token_id, config.im_end_token_id, 29
    return torch.tensor(
        [
            [s, config.system_token_id, nl, 30, 31, 32, e, nl]
            + [s, config.user_token_id, nl, 40, 41, 42, 43, 44, e, nl]
            + [s, config.assistant_token_id, nl, 50, 51, e, nl]
            + [s, config.user_token_id, nl, 45, 46, 47, e, nl]
            + [s, config.assistant_token_id, nl]
        ]
    )


def _hf_generate(model, ids, *, talker_do_sample=False, seed=None, **kwargs):
    """HF ``generate`` returning (sequences, wav, codes [16, T]) with codes captured at code2wav."""
    captured = {}
    original = model.code2wav.chunked_decode

    def capture(codes, *args, **kw):
        captured["codes"] = codes.clone()
        captured["kwargs"] = kw
        return original(codes, *args, **kw)

    model.code2wav.chunked_decode = capture
    try:
        if seed is not None:
            torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seq, wav = model.generate(
                input_ids=ids,
                return_audio=True,
                speaker="Ethan",
                thinker_do_sample=False,
                talker_do_sample=talker_do_sample,
                **kwargs,
            )
    finally:
        del model.code2wav.chunked_decode  # drop the instance attribute, back to the method
    assert captured["kwargs"] == {"chunk_size": 300, "left_context_size": 25}
    assert captured["codes"].shape[0] == 1
    return seq, wav, captured["codes"][0]


def _thinker(model, ids, eos):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.thinker.generate(
            input_ids=ids,
            max_new_tokens=THINKER_MAX_NEW,
            eos_token_id=eos,
            do_sample=False,
            output_hidden_states=True,
            return_dict_in_generate=True,
            use_audio_in_video=False,
        )
    layer = model.config.talker_config.accept_hidden_layer
    embed = torch.cat([h[0] for h in out.hidden_states], dim=1)[0]
    hidden = torch.cat([h[layer] for h in out.hidden_states], dim=1)[0]
    return out.sequences, embed, hidden


def _our_prompt(model, ids, eos, **kwargs):
    seq, embed, hidden = _thinker(model, ids, eos)
    prompt = ti.build_talker_prompt(
        model.talker,
        model.config,
        seq[0],
        embed,
        hidden,
        "Ethan",
        tts_token_embeds=ti.tts_token_embeds_from(
            model.thinker.get_input_embeddings(), model.config
        ),
        prompt_len=ids.shape[1],
        thinker_eos_token_id=eos,
        **kwargs,
    )
    return seq, embed, hidden, prompt


# --------------------------------------------------------------------------------------------
# HF parity
# --------------------------------------------------------------------------------------------
def test_thinker_rows_are_all_positions_but_the_last(talker_parity_model):
    model = talker_parity_model
    ids = _prompt_ids(model.config)
    seq, embed, hidden = _thinker(model, ids, model.config.im_end_token_id)
    t_seq = seq.shape[1]
    assert t_seq > ids.shape[1] + 1
    assert embed.shape[0] == hidden.shape[0] == t_seq - 1
    # hidden_states[0] is embed_tokens of the fed ids (text-only prompt).
    expected = model.thinker.get_input_embeddings()(seq[0, :-1])
    torch.testing.assert_close(embed, expected, rtol=0, atol=0)


@pytest.mark.parametrize("repetition_penalty", [HF_TALKER_REPETITION_PENALTY, 1.0])
def test_greedy_codes_and_waveform_match_hf(talker_parity_model, repetition_penalty):
    model, cfg = talker_parity_model, talker_parity_model.config
    ids = _prompt_ids(cfg)
    kwargs = dict(
        thinker_max_new_tokens=THINKER_MAX_NEW,
        thinker_eos_token_id=cfg.im_end_token_id,
        talker_max_new_tokens=TALKER_MAX_NEW,
    )
    if repetition_penalty != HF_TALKER_REPETITION_PENALTY:
        kwargs["talker_repetition_penalty"] = repetition_penalty
    hf_seq, hf_wav, hf_codes = _hf_generate(model, ids, **kwargs)

    seq, _, _, prompt = _our_prompt(model, ids, cfg.im_end_token_id)
    assert torch.equal(seq, hf_seq)
    codes = reference_talker_generate(
        model.talker, cfg, prompt, TALKER_MAX_NEW - 1, repetition_penalty=repetition_penalty
    )
    assert torch.equal(codes, hf_codes)
    # The checkpoint model runs to max_new_tokens (19 frames); a model may also emit eos itself.
    assert codes.shape[0] == cfg.talker_config.num_code_groups
    assert 8 <= codes.shape[1] <= TALKER_MAX_NEW - 1
    # Non-trivial: varied codes, and the decode ran past the trailing text (tts_pad path).
    assert codes[0].unique().numel() > 1
    assert codes.unique().numel() > 10
    assert prompt.trailing_text_hidden.shape[0] < codes.shape[1]

    with torch.no_grad():
        wav = model.code2wav.chunked_decode(
            codes_for_code2wav(codes),
            chunk_size=ti.HF_CODE2WAV_CHUNK_SIZE,
            left_context_size=ti.HF_CODE2WAV_LEFT_CONTEXT,
        ).float()
    assert wav.shape == hf_wav.shape
    assert hf_wav.abs().max() > 0
    torch.testing.assert_close(wav, hf_wav, rtol=0, atol=1e-5)


def test_thinker_eos_and_talker_eos_with_min_new_tokens(talker_parity_model):
    """Thinker stops on an eos id it actually emits; talker eos forced after 5 frames."""
    model, cfg = talker_parity_model, talker_parity_model.config
    ids = _prompt_ids(cfg)
    full, _, _ = _thinker(model, ids, cfg.im_end_token_id)
    generated = full[0, ids.shape[1] :].tolist()
    # An emitted token (first occurrence at index >= 2) becomes the thinker eos.
    idx = next(i for i in range(2, len(generated)) if generated[i] not in generated[:i])
    thinker_eos = generated[idx]

    eos = cfg.talker_config.codec_eos_token_id
    head = model.talker.codec_head

    class EosBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, x):
            out = self.head(x).clone()
            out[..., eos] += 1e4
            return out

    # (not monkeypatch: its undo deletes nn.Module children instead of restoring them)
    model.talker.codec_head = EosBias()
    try:
        min_new = 5
        hf_seq, hf_wav, hf_codes = _hf_generate(
            model,
            ids,
            thinker_max_new_tokens=THINKER_MAX_NEW,
            thinker_eos_token_id=thinker_eos,
            talker_max_new_tokens=40,
            talker_min_new_tokens=min_new,
        )
        assert hf_seq.shape[1] == ids.shape[1] + idx + 1 and hf_seq[0, -1] == thinker_eos

        seq, _, _, prompt = _our_prompt(model, ids, thinker_eos)
        assert torch.equal(seq, hf_seq)
        codes = reference_talker_generate(model.talker, cfg, prompt, 39, min_new_tokens=min_new)
        assert codes.shape[1] == min_new
        assert torch.equal(codes, hf_codes)
        # Without the minimum the biased talker stops at once.
        empty = reference_talker_generate(model.talker, cfg, prompt, 39)
        assert empty.shape == (cfg.talker_config.num_code_groups, 0)
        with torch.no_grad():
            wav = model.code2wav.chunked_decode(codes_for_code2wav(codes)).float()
    finally:
        model.talker.codec_head = head
    torch.testing.assert_close(wav, hf_wav, rtol=0, atol=1e-5)


def test_sampled_talker_matches_hf_with_same_seed(talker_parity_model):
    """Sampling follows HF's processors and draws in HF's order (global RNG)."""
    model, cfg = talker_parity_model, talker_parity_model.config
    ids = _prompt_ids(cfg)
    n = 8
    _, _, hf_codes = _hf_generate(
        model,
        ids,
        talker_do_sample=True,
        seed=1234,
        thinker_max_new_tokens=THINKER_MAX_NEW,
        thinker_eos_token_id=cfg.im_end_token_id,
        talker_max_new_tokens=n,
    )
    _, _, _, prompt = _our_prompt(model, ids, cfg.im_end_token_id)
    torch.manual_seed(1234)
    codes = reference_talker_generate(model.talker, cfg, prompt, n - 1, greedy=False)
    assert torch.equal(codes, hf_codes)
    model.talker.code_predictor.generation_config.do_sample = False  # HF mutates it; reset


def test_predict_residual_codes_matches_code_predictor_generate(talker_parity_model):
    model = talker_parity_model
    talker = model.talker
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, talker.config.text_config.hidden_size, generator=gen)
    code0 = torch.tensor([7])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = talker.code_predictor.generate(
            inputs_embeds=torch.cat(
                (hidden.unsqueeze(0), talker.get_input_embeddings()(code0).unsqueeze(0)), dim=1
            ),
            max_new_tokens=talker.config.num_code_groups - 1,
            do_sample=False,
        )
    ours = predict_residual_codes(talker, hidden, code0)
    assert ours.shape == (talker.config.num_code_groups,)
    assert ours[0] == 7
    assert torch.equal(ours[1:], hf[0])


# --------------------------------------------------------------------------------------------
# Unit behaviour
# --------------------------------------------------------------------------------------------
def test_prompt_layout_and_inferred_prompt_len(talker_parity_model):
    model, cfg = talker_parity_model, talker_parity_model.config
    ids = _prompt_ids(cfg)
    seq, embed, hidden, prompt = _our_prompt(model, ids, cfg.im_end_token_id)
    n_user = 10 + 8  # two user turns: <|im_start|> user \n {5|3 tokens} <|im_end|> \n
    assert prompt.prompt_embeds.shape == (n_user + 9, cfg.talker_config.text_config.hidden_size)
    assert prompt.talker_input_ids.tolist()[n_user:] == [cfg.tts_pad_token_id] * 9
    assert prompt.talker_input_ids[0] == cfg.im_start_token_id
    assert prompt.talker_input_ids[1] == cfg.user_token_id
    # trailing = generated tokens 1 .. G-2 (fed) + tts_eos
    generated = seq.shape[1] - ids.shape[1]
    assert prompt.trailing_text_hidden.shape[0] == generated - 1
    assert prompt.tts_pad_embed.shape == (1, cfg.talker_config.text_config.hidden_size)

    inferred = ti.build_talker_prompt(
        model.talker,
        cfg,
        seq[0],
        embed,
        None,  # text-only: thinker_hidden is never read
        "ETHAN",
        tts_token_embeds=ti.tts_token_embeds_from(model.thinker.get_input_embeddings().weight, cfg),
    )
    for name in ("prompt_embeds", "trailing_text_hidden", "tts_pad_embed", "talker_input_ids"):
        assert torch.equal(getattr(inferred, name), getattr(prompt, name)), name


def _media_prompt(cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A thinker prompt with images and a video in two user turns, around a system turn and
    an earlier assistant turn: ``(ids [1, P], image_grid_thw [2, 3], video_grid_thw [1, 3])``."""
    t = cfg.thinker_config
    s, e, nl = cfg.im_start_token_id, cfg.im_end_token_id, 29
    vs, ve = t.vision_start_token_id, t.vision_end_token_id

    def media(token, n):
        return [vs] + [token] * n + [ve]

    images = torch.tensor([[1, 4, 4], [1, 2, 6]])  # 4 and 3 tokens after the 2x2 merge
    videos = torch.tensor([[2, 4, 4]])  # 8 tokens
    ids = ([s, cfg.system_token_id, nl, 30, 31, e, nl]
           + [s, cfg.user_token_id, nl] + media(t.image_token_id, 4) + [40, 41]
           + media(t.video_token_id, 8) + [42, e, nl]
           + [s, cfg.assistant_token_id, nl, 50, 51, 52, e, nl]
           + [s, cfg.user_token_id, nl, 43] + media(t.image_token_id, 3) + [e, nl]
           + [s, cfg.assistant_token_id, nl])
    return torch.tensor([ids]), images, videos


def test_talker_mrope_positions_equal_hf_talker_rope_index(talker_parity_model):
    """Talker positions derived from the thinker's M-RoPE positions equal HF's
    ``talker.get_rope_index`` over ``talker_input_ids`` (images, a video, dropped system and
    assistant turns), and decode positions continue at ``p + delta``."""
    model, cfg = talker_parity_model, talker_parity_model.config
    ids, images, videos = _media_prompt(cfg)
    seconds = torch.tensor([1.0])
    mask = torch.ones_like(ids)
    thinker_pos, _ = model.thinker.get_rope_index(ids, images, videos, mask, False, None,
                                                  seconds)
    assert not torch.equal(thinker_pos[0, 0], torch.arange(ids.shape[1]).float())  # 3-D
    sequence = torch.cat((ids[0], torch.tensor([60, 61])))
    hidden = cfg.thinker_config.text_config.hidden_size
    rows = torch.randn(sequence.shape[0] - 1, hidden)
    prompt = ti.build_talker_prompt(
        model.talker, cfg, sequence, rows, rows, "ethan",
        tts_token_embeds=torch.randn(3, hidden), prompt_len=ids.shape[1])
    length = prompt.num_prompt_tokens
    ours, delta = ti.talker_mrope_positions(thinker_pos[:, 0].T.long(), prompt.user_index,
                                            length)
    hf, hf_delta = model.talker.get_rope_index(
        prompt.talker_input_ids[None], images, videos, torch.ones(1, length), False, None,
        seconds)
    assert torch.equal(ours, hf[:, 0].long())
    assert delta == int(hf_delta) and delta != 0
    assert torch.equal(ours[:, -1], torch.full((3,), length - 1 + delta))


def test_talker_mrope_positions_of_a_text_prompt_are_plain():
    positions = torch.arange(12).expand(3, -1).T
    user = torch.tensor([0, 1, 2, 3, 7, 8, 9])  # a dropped turn in between
    ours, delta = ti.talker_mrope_positions(positions, user, len(user) + 9)
    assert delta == 0
    assert torch.equal(ours, torch.arange(len(user) + 9).expand(3, -1))


def test_build_talker_prompt_errors(talker_parity_model):
    model, cfg = talker_parity_model, talker_parity_model.config
    ids = _prompt_ids(cfg)
    seq, embed, hidden = _thinker(model, ids, cfg.im_end_token_id)
    tts = ti.tts_token_embeds_from(model.thinker.get_input_embeddings(), cfg)

    with pytest.raises(ValueError, match=r"unknown voice 'Nobody'; known: .*ethan"):
        ti.build_talker_prompt(
            model.talker, cfg, seq[0], embed, hidden, "Nobody", tts_token_embeds=tts
        )
    no_assistant = seq[0].clone()
    no_assistant[no_assistant == cfg.assistant_token_id] = cfg.user_token_id
    with pytest.raises(ValueError, match="no assistant turn"):
        ti.build_talker_prompt(
            model.talker, cfg, no_assistant, embed, hidden, "Ethan", tts_token_embeds=tts
        )
    with pytest.raises(ValueError, match="rows"):
        ti.build_talker_prompt(
            model.talker, cfg, seq[0], embed[:-1], hidden[:-1], "Ethan", tts_token_embeds=tts
        )


def test_talker_logits_mask(talker_parity_model):
    tcfg = talker_parity_model.config.talker_config
    v = tcfg.text_config.vocab_size
    mask = ti.talker_logits_mask(talker_parity_model.config)
    assert mask.shape == (v,) and mask.dtype == torch.bool
    assert not mask[: v - 1024].any()
    assert mask[v - 1024 :].sum() == 1023
    assert not mask[tcfg.codec_eos_token_id]
    for special in (tcfg.codec_pad_id, tcfg.codec_bos_id, tcfg.codec_nothink_id):
        assert mask[special]
    assert all(mask[s] for s in tcfg.speaker_id.values())


def test_process_talker_logits():
    cfg = _fallback_config()
    v = cfg.talker_config.text_config.vocab_size
    eos = cfg.talker_config.codec_eos_token_id
    logits = torch.zeros(1, v)
    logits[0, 3], logits[0, 4], logits[0, eos] = 2.0, -2.0, 5.0
    out = process_talker_logits(logits, [3, 4, 3], cfg, min_new_tokens=4)
    assert out[0, 3] == pytest.approx(2.0 / 1.05) and out[0, 4] == pytest.approx(-2.0 * 1.05)
    assert out[0, eos] == -float("inf")  # 3 generated < min_new_tokens 4
    assert out[0, cfg.talker_config.codec_pad_id] == -float("inf")
    out = process_talker_logits(logits, [3, 4, 3, 5], cfg, min_new_tokens=4)
    assert out[0, eos] == 5.0


def test_talker_step_embeds_uses_trailing_then_pad(talker_parity_model):
    talker = talker_parity_model.talker
    h = talker.config.text_config.hidden_size
    codes = torch.arange(talker.config.num_code_groups) + 1
    trailing = torch.randn(3, h)
    pad = torch.randn(1, h)
    zero = talker_step_embeds(talker, codes, 5, torch.zeros(0, h), torch.zeros(1, h))
    expected = talker.get_input_embeddings()(codes[:1])
    for j, emb in enumerate(talker.code_predictor.get_input_embeddings(), start=1):
        expected = expected + emb(codes[j : j + 1])
    torch.testing.assert_close(zero, expected)
    for step in range(5):
        got = talker_step_embeds(talker, codes, step, trailing, pad)
        add = trailing[step : step + 1] if step < 3 else pad
        torch.testing.assert_close(got, zero + add)


def test_codes_for_code2wav():
    codes = torch.arange(16 * 5).reshape(16, 5) % 7
    out = codes_for_code2wav(codes)
    assert out.shape == (1, 16, 5) and out.dtype == torch.long
    assert torch.equal(out[0], codes)
    codes[0, 3] = 999
    assert codes_for_code2wav(codes, codec_eos_token_id=999).shape == (1, 16, 3)
    with pytest.raises(ValueError):
        codes_for_code2wav(codes[0])


class _GrowingStep:
    """The worker's view of one talker request whose input grows (``StageStep``'s
    ``inputs``, ``params`` and ``grows``), over a real ``GrowingPayload``."""

    def __init__(self):
        from vllm_omni_plugin.payload_store import GrowingPayload

        self.payload = GrowingPayload()

    def inputs(self, req_id):
        return self.payload.tensors()

    def params(self, req_id):
        return None

    def grows(self, req_id):
        return True


def _talker_stage(model):
    """The served talker stage's prompt path on HF's talker modules (projections and
    codec embedding; its decoder is not used here)."""
    from vllm_omni_plugin.models.qwen3_omni.talker import Qwen3OmniTalkerStage

    stage = Qwen3OmniTalkerStage.__new__(Qwen3OmniTalkerStage)
    nn.Module.__init__(stage)
    stage.model = nn.Module()
    stage.model.embed_tokens = model.talker.get_input_embeddings()
    stage.text_projection = model.talker.text_projection
    stage.hidden_projection = model.talker.hidden_projection
    stage.omni_config = model.config
    stage.speakers = {v: k for k, v in model.config.talker_config.speaker_id.items()}
    stage._requests = {}
    return stage


def test_a_growing_talker_input_costs_only_the_assistant_turn(talker_parity_model):
    """A talker fed while the thinker runs (a 600-token user turn) takes each growth of
    its input without reading the earlier thinker rows again (they are NaN here once
    taken: rebuilding read them and moved every one to the device again) or projecting
    the user turn again: the text projection takes the assistant turn's rows only, in one
    batch as HF does. After each growth the talker's inputs equal, bit for bit,
    ``build_talker_prompt`` on the whole output so far (what rebuilding gave)."""
    from types import SimpleNamespace

    model, cfg = talker_parity_model, talker_parity_model.config
    s, e, nl = cfg.im_start_token_id, cfg.im_end_token_id, 29
    prompt = [s, cfg.user_token_id, nl, *([40, 41, 42] * 200), e, nl, s, cfg.assistant_token_id,
              nl]
    p, assistant_start = len(prompt), len(prompt) - 3
    seq = torch.tensor(prompt + [60, 61, 62, 63, 64, 65, 66, 67, 68, e])
    embed = model.thinker.get_input_embeddings()(seq[:-1]).detach()  # the thinker's rows
    tts = ti.tts_token_embeds_from(model.thinker.get_input_embeddings(), cfg).detach()
    stage, step = _talker_stage(model), _GrowingStep()
    projected = []  # rows each text projection call took
    hook = model.talker.text_projection.register_forward_hook(
        lambda module, args, out: projected.append(args[0].shape[-2]))
    ends, taken = (p + 2, p + 3, p + 5, seq.shape[0]), 0  # sequence ids after each growth
    try:
        for end in ends:
            fed = end - 1
            chunk = {"sequence_ids": seq[taken + 1 if taken else 0:end],
                     "thinker_embed": embed[taken:fed].clone(),
                     "thinker_hidden": embed[taken:fed].clone()}
            if not taken:
                chunk.update(tts_embed=tts,
                             speaker_id=torch.tensor([ti.resolve_speaker(cfg.talker_config,
                                                                         "Ethan")]),
                             prompt_len=torch.tensor([p]),
                             thinker_positions=torch.arange(p)[:, None].expand(p, 3))
            else:  # the rows taken before: reading them again gives NaN
                step.payload.tensors()["thinker_embed"][:taken].fill_(float("nan"))
            step.payload.extend([chunk])
            projected.clear()
            r = SimpleNamespace(req_id="r", num_prompt_tokens=p - 3 + ti.ASSISTANT_PREFIX_LEN)
            with torch.no_grad():
                state = stage._state(step, r)
            calls = list(projected)
            whole = ti.build_talker_prompt(
                model.talker, cfg, seq[:end], embed[:fed], None, "Ethan", tts_token_embeds=tts,
                prompt_len=p)
            if taken:
                assert calls == [fed - assistant_start], (end, calls)
            for name in ("prompt_embeds", "trailing_text_hidden", "tts_pad_embed",
                         "talker_input_ids", "user_index"):
                assert torch.equal(getattr(state.prompt, name), getattr(whole, name)), \
                    (end, name)
            taken = fed
    finally:
        hook.remove()
    assert state.sequence_len == seq.shape[0]
    with pytest.raises(ValueError, match="grew from .* but 1 new rows came"):
        ti.extend_talker_prompt(model.talker, cfg, state.prompt, seq[:3], embed[:1])
