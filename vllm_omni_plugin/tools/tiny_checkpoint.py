r"""Write tiny, seeded, randomly initialised Hugging Face checkpoints for offline CPU tests.

Usage::

    python -m vllm_omni_plugin.tools.tiny_checkpoint qwen3-omni OUT_DIR [--seed N]
    python -m vllm_omni_plugin.tools.tiny_checkpoint bagel OUT_DIR [--seed N]
    vllm-omni-tiny-checkpoint qwen3-omni OUT_DIR [--seed N]      # console script

``bagel`` is described in :mod:`vllm_omni_plugin.tools.tiny_bagel`.

Nothing is downloaded: the weights come from ``torch.manual_seed(seed)`` plus the
constructor of the Hugging Face model class, and the tokenizer is built in-process with
the ``tokenizers`` library. The same seed gives byte-identical weight shards.

qwen3-omni
==========

Produces a complete ``Qwen3OmniMoeForConditionalGeneration`` checkpoint (thinker with
audio + vision encoders and an MoE text model, MoE talker, 16-group code predictor and
code2wav vocoder), ``enable_audio_output=True``, float32: 7,281,705 parameters, 29.2 MB on
disk (28 MiB). Building takes ~2 s after imports (~9 s wall for the whole CLI) on 2 CPU cores
and ~0.5 GB RAM.

Files in OUT_DIR:

* ``config.json`` - ``Qwen3OmniMoeConfig``, architectures
  ``["Qwen3OmniMoeForConditionalGeneration"]``, ``dtype`` float32.
* ``model-0000N-of-0000M.safetensors`` and ``model.safetensors.index.json`` - all weights
  (float32, no tied weights) in shards of :data:`TINY_SHARD_SIZE`, as the released
  checkpoint is sharded: the talker's and code2wav's engines read only their shards.
* ``generation_config.json`` - bos/pad ``<|endoftext|>``, eos ``[<|im_end|>, <|endoftext|>]``.
* ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja`` - a byte-level
  BPE tokenizer (Qwen2 pre-tokenizer regex, NFC, byte-level decoder, so *any* text
  encodes) trained deterministically in-process on a short built-in English text, plus
  every Qwen2.5/Qwen3-Omni special token in the upstream order, appended after the BPE
  vocabulary. ``system``, ``user`` and ``assistant`` are single tokens. The chat template
  is ChatML (``<|im_start|>{role}\n{content}<|im_end|>\n``; ``add_generation_prompt``
  appends ``<|im_start|>assistant\n``); list contents with ``image``/``audio``/``video``
  parts expand to ``<|vision_start|><|image_pad|><|vision_end|>``,
  ``<|audio_start|><|audio_pad|><|audio_end|>`` and
  ``<|vision_start|><|video_pad|><|vision_end|>`` like the upstream template.
  ``tokenizer_class`` is ``Qwen2Tokenizer`` as upstream; 725 tokens (692 BPE + 33 added).
* ``preprocessor_config.json`` - the flat file the official Qwen3-Omni repos ship
  (WhisperFeatureExtractor: 128 mel bins, 16 kHz; Qwen2VLImageProcessor: patch 16, merge 2,
  temporal patch 2). ``AutoFeatureExtractor`` / ``AutoImageProcessor`` load it offline;
  ``AutoProcessor`` (``Qwen3OmniMoeProcessor``) additionally needs torchvision for its
  Qwen2-VL video processor, as with the real checkpoint.

Sizes
-----

* thinker text (MoE): hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 32, 4 experts,
  top-2, moe_intermediate_size 32, vocab = tokenizer size padded to a multiple of 128 (768),
  max_position_embeddings 4096, interleaved M-RoPE ``mrope_section`` [8, 4, 4], theta 1e6.
  head_dim 32 everywhere: vLLM's CPU attention supports head sizes 32, 64, 80, ... only.
* audio encoder: 128 mel bins, d_model 32, 2 layers, 2 heads, ffn 64,
  downsample_hidden_size 16, output_dim 64 (n_window 50 / n_window_infer 800 as upstream).
* vision encoder: depth 2, hidden 32, 2 heads, mlp 64, patch 16, temporal patch 2,
  spatial merge 2, deepstack_visual_indexes [0, 1], out_hidden_size 64.
* talker (MoE): hidden 96, 3 layers, 2 heads, 1 KV head, head_dim 64 (M-RoPE
  ``mrope_section`` [16, 8, 8]), 6 experts, top-2, moe_intermediate_size 48, shared
  expert 96, intermediate (projection MLP) 192, vocab 3072 (= codebook 2048 + 1024 codec
  specials, as upstream: HF ``generate`` suppresses the top 1024 ids except
  ``codec_eos_token_id``), thinker_hidden_size 64, accept_hidden_layer 1 (index into the
  thinker's ``hidden_states`` tuple, which has num_hidden_layers + 1 = 3 entries).
* code predictor: hidden 96 (the talker's: HF feeds it the talker's hidden states),
  1 layer, 4 heads, 2 KV heads, head_dim 32, vocab 2048, num_code_groups 16
  (15 embeddings / lm heads).
* code2wav: codebook_size 2048, num_quantizers 16, hidden 48, 1 layer, 3 heads
  (head_dim 16), sliding_window 72, decoder_dim 64 (-> 32 -> 16 -> 8 -> 4 channels),
  upsample_rates [8, 5, 4, 3] and upsampling_ratios [2, 2] exactly as upstream.

The three stages differ in width, heads, head size, layers and experts, so a stage sized
from another stage's config (vLLM reads the thinker's text config for every engine of
the checkpoint) fails its tests.

Special ids (same *names* and relative layout as upstream; the numbers depend on the BPE
size and are recorded in config.json): top-level ``im_start_token_id``,
``im_end_token_id``, ``tts_pad_token_id`` (``<tts_pad>``), ``tts_bos_token_id``
(``<tts_text_bos>``), ``tts_eos_token_id`` (``<tts_text_eod>``), ``system_token_id``,
``user_token_id``, ``assistant_token_id``; thinker ``audio_token_id`` (``<|audio_pad|>``),
``image_token_id``, ``video_token_id``, ``audio_start_token_id``, ``audio_end_token_id``,
``vision_start_token_id``, ``vision_end_token_id``, ``user_token_id``; talker
``audio_token_id``, ``image_token_id``, ``video_token_id``, ``vision_start_token_id``,
``audio_start_token_id``, ``audio_end_token_id``. Each equals the tokenizer's id of that
token; for seed-independent reference: im_start 693, im_end 694, endoftext 692, system 260,
user 263, assistant 271, vision_start 701, vision_end 702, image_pad 704, video_pad 705,
audio_start 718, audio_end 719, tts_pad 720, tts_text_bos 721, tts_text_eod 722,
audio_pad 724. Codec ids are the upstream ones: ``codec_pad_id`` 2148, ``codec_bos_id`` 2149,
``codec_eos_token_id`` 2150, ``codec_nothink_id`` 2155, ``codec_think_bos_id`` 2156,
``codec_think_eos_id`` 2157, ``speaker_id`` {"chelsie": 2301, "ethan": 2302,
"aiden": 2303}.

Sample rate
-----------

Hugging Face's ``Qwen3OmniMoeCode2WavConfig`` has **no** sample-rate field. The vocoder
turns one 16-code frame into ``prod(upsample_rates + upsampling_ratios)`` =
8*5*4*3*2*2 = 1920 samples (``Qwen3OmniMoeCode2Wav.total_upsample``); Qwen3-Omni's
waveform is 24 kHz (12.5 code frames / s), the rate used by the upstream examples. This
tool records it as the extra, non-HF field ``code2wav_config.output_sample_rate = 24000``
(kept by ``AutoConfig``). Input audio for the audio encoder is 16 kHz (WhisperFeatureExtractor
``sampling_rate``).

Weights
-------

``torch.manual_seed(seed)``, then ``Qwen3OmniMoeForConditionalGeneration(config)`` (HF init,
std 0.02), then - in parameter order, from the same RNG - two fixes, because HF's init leaves
the *talker* MoE experts as uninitialised ``torch.empty`` memory (non-deterministic) and its
routers at zero: those are drawn from N(0, 0.02), and every parameter that is still a constant
tensor (norm weights = 1, biases = 0, SnakeBeta alpha/beta = 0, layer scales, ConvNeXt gamma)
gets noise (N(0, 0.02), or N(0, 0.1) relative for values of magnitude >= 0.1). So a loader
that drops a bias or a norm weight, or mis-routes an expert, changes the outputs. Finally the
last code2wav conv is multiplied by 32 (output gain) so the waveform peaks around 0.1 rather
than 3e-3 (still below code2wav's [-1, 1] clamp).

Greedy HF reference generation
------------------------------

``Qwen3OmniMoeForConditionalGeneration.generate`` samples in the talker by default
(``talker_do_sample=True``, top-k 50, temperature 0.9, repetition penalty 1.05) and its
``thinker_eos_token_id`` default is upstream's 151645. For fully greedy, deterministic output
in every stage use::

    model.generate(
        input_ids=ids, attention_mask=mask, speaker="ethan", return_audio=True,
        thinker_max_new_tokens=8, thinker_do_sample=False,
        thinker_eos_token_id=config.im_end_token_id,
        talker_max_new_tokens=8, talker_do_sample=False, talker_repetition_penalty=1.0,
    )

The code predictor has no kwarg of its own: the talker's ``_prepare_generation_config``
copies the talker's ``do_sample`` onto it, so ``talker_do_sample=False`` makes it greedy.
(The talker still applies ``suppress_tokens`` = ids [vocab-1024, vocab) except
``codec_eos_token_id``.) It returns ``(text_ids, waveform)`` with waveform float32 of shape
``[1, 1, num_samples]`` (8 talker steps -> ~12.9 k samples here).

Known HF limitation (transformers 5.19, same with the real checkpoint): ``return_audio=True``
with *audio input* fails in the talker's ``get_rope_index`` (``Qwen3OmniMoeTalkerConfig`` has
no ``audio_config``). Text and image inputs work with audio output; audio input works with
``return_audio=False``. Random weights can also emit thinker ids in the padded range
[725, 768) that the tokenizer does not know (as real Qwen can for 151665..152063).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllm_omni_plugin.tools.tiny_bagel import build_bagel
from vllm_omni_plugin.tools.tiny_tokenizer import (
    QWEN25_ADDED_TOKENS,
    build_qwen_tokenizer,
    set_tokenizer_class,
)

logger = logging.getLogger("vllm_omni_plugin.tools.tiny_checkpoint")

# ----------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------

# Qwen3-Omni's added tokens: Qwen2.5's, then its own (151665..151675), in upstream order.
QWEN3_OMNI_ADDED_TOKENS: tuple[tuple[str, bool], ...] = QWEN25_ADDED_TOKENS + (
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

# Named tokens the Qwen3-Omni processor reads from the tokenizer (tokenizer.image_token, ...).
QWEN3_OMNI_MODEL_SPECIFIC_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}


def build_qwen3_omni_tokenizer():
    """A Qwen-style byte-level BPE tokenizer with every Qwen3-Omni special token."""
    return build_qwen_tokenizer(QWEN3_OMNI_ADDED_TOKENS, QWEN3_OMNI_MODEL_SPECIFIC_TOKENS)


# ----------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------

QWEN3_OMNI_HIDDEN = 64
#: The talker's and code2wav's widths: each stage's shapes differ from the others' (width,
#: heads, head size, layers, experts), so a stage sized from another's config fails.
QWEN3_OMNI_TALKER_HIDDEN = 96
QWEN3_OMNI_CODE2WAV_HIDDEN = 48
QWEN3_OMNI_SAMPLE_RATE = 24000
QWEN3_OMNI_SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
QWEN3_OMNI_CODE2WAV_GAIN = 32.0


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def build_qwen3_omni_config(tokenizer):
    """Tiny Qwen3OmniMoeConfig whose special-token ids come from ``tokenizer``."""
    import torch
    from transformers import Qwen3OmniMoeConfig

    def tid(token: str) -> int:
        i = tokenizer.convert_tokens_to_ids(token)
        if i is None or i == tokenizer.unk_token_id:
            raise RuntimeError(f"token {token!r} missing from tokenizer")
        return int(i)

    def word_id(word: str) -> int:
        ids = tokenizer.encode(word, add_special_tokens=False)
        assert len(ids) == 1, (word, ids)
        return int(ids[0])

    h = QWEN3_OMNI_HIDDEN
    mrope = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [8, 4, 4],  # sums to head_dim / 2 = 16
        "interleaved": True,
        "mrope_interleaved": True,
    }
    mm_ids = {
        "audio_token_id": tid("<|audio_pad|>"),
        "image_token_id": tid("<|image_pad|>"),
        "video_token_id": tid("<|video_pad|>"),
        "vision_start_token_id": tid("<|vision_start|>"),
        "audio_start_token_id": tid("<|audio_start|>"),
        # extra (not HF dataclass fields) but present upstream
        "vision_end_token_id": tid("<|vision_end|>"),
        "audio_end_token_id": tid("<|audio_end|>"),
    }
    thinker_vocab = _round_up(len(tokenizer), 128)
    thinker = {
        "text_config": {
            "vocab_size": thinker_vocab,
            "hidden_size": h,
            "intermediate_size": 2 * h,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": dict(mrope),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
            "use_qk_norm": True,
        },
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": h,
            "downsample_hidden_size": 16,
            "n_window": 50,
            "n_window_infer": 800,
            "conv_chunksize": 500,
            "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": h,
            "num_position_embeddings": 2304,  # (image_size / patch_size) ** 2
            # Read by vLLM's vision tower (the released config carries both).
            "image_size": 768,
            "apply_vit_abs_pos_embed": True,
            "deepstack_visual_indexes": [0, 1],
            "hidden_act": "gelu_pytorch_tanh",
        },
        **mm_ids,
        "user_token_id": word_id("user"),
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
        "tie_word_embeddings": False,
    }
    codebook = 2048
    th = QWEN3_OMNI_TALKER_HIDDEN
    talker = {
        "text_config": {
            "vocab_size": codebook + 1024,
            "hidden_size": th,
            "intermediate_size": 2 * th,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {**mrope, "mrope_section": [16, 8, 8]},  # head_dim / 2
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 48,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "shared_expert_intermediate_size": th,
            "tie_word_embeddings": False,
        },
        "code_predictor_config": {
            "vocab_size": codebook,
            "hidden_size": th,  # HF feeds it the talker's hidden states as they are
            "intermediate_size": 2 * th,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "num_code_groups": 16,
            "tie_word_embeddings": False,
        },
        "num_code_groups": 16,
        "thinker_hidden_size": h,
        "accept_hidden_layer": 1,
        "codec_pad_id": 2148,
        "codec_bos_id": 2149,
        "codec_eos_token_id": 2150,
        "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "speaker_id": dict(QWEN3_OMNI_SPEAKERS),
        **mm_ids,
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
        "spatial_merge_size": 2,
        "tie_word_embeddings": False,
    }
    code2wav = {
        "codebook_size": codebook,
        "num_quantizers": 16,
        "hidden_size": QWEN3_OMNI_CODE2WAV_HIDDEN,
        "intermediate_size": 2 * QWEN3_OMNI_CODE2WAV_HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 3,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8000,
        "sliding_window": 72,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 64,
        # Not an HF field: the waveform rate implied by Qwen3-Omni (1920 samples per frame).
        "output_sample_rate": QWEN3_OMNI_SAMPLE_RATE,
    }
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=tid("<|im_start|>"),
        im_end_token_id=tid("<|im_end|>"),
        tts_pad_token_id=tid("<tts_pad>"),
        tts_bos_token_id=tid("<tts_text_bos>"),
        tts_eos_token_id=tid("<tts_text_eod>"),
        system_token_id=word_id("system"),
        user_token_id=word_id("user"),
        assistant_token_id=word_id("assistant"),
        architectures=["Qwen3OmniMoeForConditionalGeneration"],
    )
    config.dtype = torch.float32
    _check_qwen3_omni_config(config, tokenizer)
    return config


def _check_qwen3_omni_config(config, tokenizer) -> None:
    tk = config.talker_config
    vocab = tk.text_config.vocab_size
    codec_ids = {
        "codec_bos_id": tk.codec_bos_id,
        "codec_eos_token_id": tk.codec_eos_token_id,
        "codec_pad_id": tk.codec_pad_id,
        "codec_nothink_id": tk.codec_nothink_id,
        "codec_think_bos_id": tk.codec_think_bos_id,
        "codec_think_eos_id": tk.codec_think_eos_id,
        **{f"speaker_id[{k}]": v for k, v in tk.speaker_id.items()},
    }
    cb = config.code2wav_config.codebook_size
    for name, value in codec_ids.items():
        # Codec specials live above the codebook (never fed to code2wav) and below vocab.
        if not cb <= value < vocab:
            raise ValueError(f"talker {name}={value} outside [{cb}, {vocab})")
    if tk.code_predictor_config.vocab_size != cb:
        raise ValueError("code predictor vocab must equal code2wav codebook_size")
    if tk.num_code_groups != config.code2wav_config.num_quantizers:
        raise ValueError("num_code_groups must equal code2wav num_quantizers")
    if tk.num_code_groups != tk.code_predictor_config.num_code_groups:
        raise ValueError("talker and code predictor num_code_groups differ")
    if vocab - 1024 != cb:
        raise ValueError("talker vocab must be codebook_size + 1024 (HF suppresses the top 1024)")
    n_layers = config.thinker_config.text_config.num_hidden_layers
    if not 0 <= tk.accept_hidden_layer <= n_layers:
        raise ValueError("accept_hidden_layer out of range")
    if tk.thinker_hidden_size != config.thinker_config.text_config.hidden_size:
        raise ValueError("thinker_hidden_size mismatch")
    if config.thinker_config.text_config.vocab_size < len(tokenizer):
        raise ValueError("thinker vocab smaller than tokenizer")


# ----------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------


def _make_nondegenerate(model, std: float = 0.02) -> list[str]:
    """Deterministically fill what HF's init leaves uninitialised / constant. Returns names."""
    import torch

    touched: list[str] = []
    with torch.no_grad():
        # 1. Talker MoE: experts are torch.empty (garbage), routers are zeros.
        for name, param in model.named_parameters():
            if name.startswith("talker.model.layers.") and (
                ".mlp.experts." in name or name.endswith(".mlp.gate.weight")
            ):
                param.normal_(0.0, std)
                touched.append(name)
        # 2. Constant tensors (norm weights, biases, snake alpha/beta, layer scales, gamma).
        for name, param in model.named_parameters():
            if not param.is_floating_point() or param.numel() < 2:
                continue
            flat = param.detach().reshape(-1)
            if bool((flat == flat[0]).all()):
                c = float(flat[0])
                noise_std = 0.1 * abs(c) if abs(c) >= 0.1 else std
                param.add_(torch.randn_like(param) * noise_std)
                touched.append(name)
        for name, param in model.named_parameters():
            if not torch.isfinite(param).all():
                raise RuntimeError(f"non-finite parameter {name}")
            if param.numel() > 1 and float(param.float().std()) == 0.0:
                raise RuntimeError(f"degenerate parameter {name}")
    return touched


# Flat preprocessor_config.json, the shape the official Qwen3-Omni repos ship (no
# processor_config.json / video_preprocessor_config.json): the WhisperFeatureExtractor, the
# Qwen2-VL image processor and (by fallback) the Qwen2-VL video processor all read it.
QWEN3_OMNI_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "chunk_length": 300,
    "dither": 0.0,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_pixels": 12845056,
    "merge_size": 2,
    "min_pixels": 3136,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "patch_size": 16,
    "processor_class": "Qwen3OmniMoeProcessor",
    "return_attention_mask": True,
    "sampling_rate": 16000,
    "temporal_patch_size": 2,
}


#: shard size of the tiny Qwen3-Omni checkpoint (about 36 MB in float32): several shards
TINY_SHARD_SIZE = "4MB"


def _save_processor(out_dir: Path) -> None:
    """Write the upstream-shaped preprocessor_config.json.

    Not built through ``Qwen3OmniMoeProcessor.save_pretrained`` because its video processor
    (Qwen2VLVideoProcessor) needs torchvision; ``AutoFeatureExtractor`` / ``AutoImageProcessor``
    load the file offline, and ``AutoProcessor`` does too where torchvision is installed.
    """
    path = out_dir / "preprocessor_config.json"
    path.write_text(json.dumps(QWEN3_OMNI_PREPROCESSOR_CONFIG, indent=2, sort_keys=True) + "\n")


def build_qwen3_omni(out_dir: str | os.PathLike, seed: int = 0) -> dict[str, Any]:
    """Write the tiny Qwen3-Omni checkpoint to ``out_dir``; returns a summary dict."""
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    logger.info("building tokenizer")
    tokenizer = build_qwen3_omni_tokenizer()
    logger.info("tokenizer: %d tokens", len(tokenizer))
    config = build_qwen3_omni_config(tokenizer)

    logger.info("building Qwen3OmniMoeForConditionalGeneration (seed=%d)", seed)
    torch.manual_seed(seed)
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = Qwen3OmniMoeForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(prev_dtype)
    model = model.to(torch.float32).eval()
    touched = _make_nondegenerate(model)
    logger.info("re-initialised %d uninitialised/constant tensors", len(touched))
    with torch.no_grad():
        # Output gain: with std-0.02 convs the waveform would peak around 3e-3; x32 on the last
        # conv brings it to roughly 0.1 without reaching code2wav's [-1, 1] clamp.
        model.code2wav.decoder[-1].conv.weight.mul_(QWEN3_OMNI_CODE2WAV_GAIN)

    gen = GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=[config.im_end_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    model.generation_config = gen

    logger.info("saving to %s", out)
    # sharded with an index, as the released checkpoint is: the talker's and code2wav's
    # engines read only the shards holding their weights (models/weights.py OwnShards)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=TINY_SHARD_SIZE)
    gen.save_pretrained(out)
    tokenizer.save_pretrained(out)
    set_tokenizer_class(out, "Qwen2Tokenizer")
    _save_processor(out)

    n_params = sum(p.numel() for p in model.parameters())
    files = sorted(p for p in out.iterdir() if p.is_file())
    total_bytes = sum(p.stat().st_size for p in files)
    summary = {
        "model": "qwen3-omni",
        "path": str(out.resolve()),
        "seed": seed,
        "parameters": n_params,
        "bytes": total_bytes,
        "files": [p.name for p in files],
        "tokenizer_size": len(tokenizer),
        "thinker_vocab_size": config.thinker_config.text_config.vocab_size,
        "sample_rate": QWEN3_OMNI_SAMPLE_RATE,
        "speakers": sorted(config.talker_config.speaker_id),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    return summary


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------

# model name -> (builder(out_dir, seed) -> summary, help text).
BUILDERS: dict[str, tuple[Callable[..., dict[str, Any]], str]] = {
    "qwen3-omni": (
        build_qwen3_omni,
        "Qwen3-Omni (Qwen3OmniMoeForConditionalGeneration) with audio output",
    ),
    "bagel": (
        build_bagel,
        "BAGEL (official layout: ema.safetensors, ae.safetensors, llm/vit configs) plus "
        "vLLM's config.json",
    ),
}


def build(model: str, out_dir: str | os.PathLike, seed: int = 0) -> dict[str, Any]:
    """Write the tiny checkpoint of ``model`` (a key of :data:`BUILDERS`) into ``out_dir``,
    its weights drawn with ``seed``.

    Returns:
        The builder's summary (JSON-ready): path, seed, parameter and byte counts, the
        files written, and the seconds taken, among others.

    Raises:
        ValueError: ``model`` is not one of :data:`BUILDERS`.
    """
    if model not in BUILDERS:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(BUILDERS)}")
    return BUILDERS[model][0](out_dir, seed=seed)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_omni_plugin.tools.tiny_checkpoint",
        description="Write a tiny, seeded, random-weight Hugging Face checkpoint (offline).",
    )
    sub = parser.add_subparsers(
        dest="model", metavar="MODEL", required=True, help=f"one of: {', '.join(BUILDERS)}"
    )
    for name, (_, help_text) in BUILDERS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created if missing)")
        p.add_argument(
            "--seed", type=int, default=0, help="torch.manual_seed for the weights (default 0)"
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``): build the checkpoint it
    names, logging at INFO, then print a one-line summary and the summary as JSON.

    Returns:
        The exit status, 0.
    """
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    logger.setLevel(logging.INFO)
    summary = build(args.model, args.out_dir, seed=args.seed)
    print(
        f"wrote {summary['model']} checkpoint to {summary['path']}: "
        f"{summary['parameters']:,} parameters, {summary['bytes']:,} bytes on disk, "
        f"{summary['seconds']} s"
    )
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
