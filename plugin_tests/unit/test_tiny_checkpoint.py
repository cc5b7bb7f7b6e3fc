"""Tests for ``python -m vllm_omni_plugin.tools.tiny_checkpoint`` (offline, CPU, ~30 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from vllm_omni_plugin.tools import tiny_checkpoint as tc

REPO_ROOT = Path(__file__).resolve().parents[2]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _auto_image_processor():
    """``AutoImageProcessor`` imported from its module: transformers 5.17 (vLLM 0.31
    pins <5.18) marks the top-level name as needing torchvision and raises
    ImportError without it, although the class falls back to the PIL processor
    (fixed by 5.19). Inline ``transformers.AutoImageProcessor`` again once the
    lowest supported vLLM is >= 0.32."""
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    return AutoImageProcessor


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_omni_tiny") / "seed0"
    with pytest.MonkeyPatch.context() as env:
        for key, value in OFFLINE_ENV.items():
            env.setenv(key, value)
        summary = tc.build_qwen3_omni(out, seed=0)
    assert summary["parameters"] > 0 and summary["bytes"] > 0
    return out


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return transformers.AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def model(ckpt):
    model, info = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}, info
    return model.eval()


def _greedy_kwargs(config, max_new_tokens=8):
    return dict(
        speaker="ethan",
        return_audio=True,
        thinker_max_new_tokens=max_new_tokens,
        thinker_do_sample=False,
        thinker_eos_token_id=config.im_end_token_id,
        talker_max_new_tokens=max_new_tokens,
        talker_do_sample=False,
        talker_repetition_penalty=1.0,
    )


# ---------------------------------------------------------------------------- files / config


def test_files_written(ckpt):
    names = {p.name for p in ckpt.iterdir()}
    for required in (
        "config.json",
        "model.safetensors.index.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
    ):
        assert required in names


def test_config_and_tokenizer_consistent(ckpt, tokenizer):
    config = transformers.AutoConfig.from_pretrained(ckpt)
    assert type(config).__name__ == "Qwen3OmniMoeConfig"
    assert config.architectures == ["Qwen3OmniMoeForConditionalGeneration"]
    assert config.enable_audio_output is True
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["dtype"] == "float32"

    def tid(tok: str) -> int:
        return tokenizer.convert_tokens_to_ids(tok)

    def single(word: str) -> int:
        ids = tokenizer.encode(word, add_special_tokens=False)
        assert len(ids) == 1, (word, ids)
        return ids[0]

    th, tk, c2w = config.thinker_config, config.talker_config, config.code2wav_config
    expected = [
        (config, "im_start_token_id", tid("<|im_start|>")),
        (config, "im_end_token_id", tid("<|im_end|>")),
        (config, "tts_pad_token_id", tid("<tts_pad>")),
        (config, "tts_bos_token_id", tid("<tts_text_bos>")),
        (config, "tts_eos_token_id", tid("<tts_text_eod>")),
        (config, "system_token_id", single("system")),
        (config, "user_token_id", single("user")),
        (config, "assistant_token_id", single("assistant")),
        (th, "user_token_id", single("user")),
    ]
    for sub in (th, tk):
        expected += [
            (sub, "audio_token_id", tid("<|audio_pad|>")),
            (sub, "image_token_id", tid("<|image_pad|>")),
            (sub, "video_token_id", tid("<|video_pad|>")),
            (sub, "vision_start_token_id", tid("<|vision_start|>")),
            (sub, "vision_end_token_id", tid("<|vision_end|>")),
            (sub, "audio_start_token_id", tid("<|audio_start|>")),
            (sub, "audio_end_token_id", tid("<|audio_end|>")),
        ]
    for cfg, field, want in expected:
        assert getattr(cfg, field) == want, (type(cfg).__name__, field)

    # every Qwen3-Omni special token exists, as one unsplit token, in upstream order
    ids = [tid(t) for t, _ in tc.QWEN3_OMNI_ADDED_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    for tok, _ in tc.QWEN3_OMNI_ADDED_TOKENS:
        assert tokenizer.encode(tok, add_special_tokens=False) == [tid(tok)]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.image_token == "<|image_pad|>" and tokenizer.audio_token == "<|audio_pad|>"
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tid("<|im_end|>"), tid("<|endoftext|>")]
    assert gen["pad_token_id"] == tid("<|endoftext|>")

    # sizes
    assert th.text_config.vocab_size >= len(tokenizer)
    assert th.text_config.hidden_size == tk.thinker_hidden_size == 64
    # no two stages share a shape, so a stage sized from another's config fails its tests
    stages = (th.text_config, tk.text_config, c2w)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        assert len({getattr(c, field) for c in stages}) == 3, field
    head_dims = [getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
                 for c in stages]
    assert len(set(head_dims)) == 3, head_dims
    assert th.text_config.num_experts != tk.text_config.num_experts
    assert th.text_config.num_key_value_heads != tk.text_config.num_key_value_heads
    assert tk.code_predictor_config.hidden_size == tk.text_config.hidden_size
    assert tk.code_predictor_config.head_dim != tk.text_config.head_dim
    assert th.text_config.num_experts == 4 and th.text_config.num_experts_per_tok == 2
    assert 0 <= tk.accept_hidden_layer <= th.text_config.num_hidden_layers
    assert tk.num_code_groups == tk.code_predictor_config.num_code_groups == 16
    assert c2w.num_quantizers == 16
    assert tk.code_predictor_config.vocab_size == c2w.codebook_size
    assert tk.text_config.vocab_size == c2w.codebook_size + 1024
    codec = [
        tk.codec_bos_id,
        tk.codec_eos_token_id,
        tk.codec_pad_id,
        tk.codec_nothink_id,
        tk.codec_think_bos_id,
        tk.codec_think_eos_id,
        *tk.speaker_id.values(),
    ]
    assert all(c2w.codebook_size <= i < tk.text_config.vocab_size for i in codec)
    assert len(set(codec)) == len(codec)
    assert set(tk.speaker_id) == {"ethan", "chelsie", "aiden"}
    assert c2w.output_sample_rate == 24000
    assert int(torch.tensor(c2w.upsample_rates + c2w.upsampling_ratios).prod()) == 1920


def test_chat_template_and_encoding(tokenizer):
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
    ]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(msgs[1:], tokenize=False)
    assert no_prompt == "<|im_start|>user\nHello<|im_end|>\n"
    mm = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "audio"},
                    {"type": "video"},
                    {"type": "text", "text": "Hi"},
                ],
            }
        ],
        tokenize=False,
    )
    assert mm == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|audio_start|><|audio_pad|><|audio_end|><|vision_start|><|video_pad|><|vision_end|>"
        "Hi<|im_end|>\n"
    )
    ids = tokenizer(text)["input_ids"]
    toks = tokenizer.convert_ids_to_tokens(ids)
    assert toks[:2] == ["<|im_start|>", "system"] and toks[-3:] == [
        "<|im_start|>",
        "assistant",
        "Ċ",
    ]
    # byte-level: any text round-trips
    for sample in ["Hello, world!", "Héllo wörld ✓ 日本語 🙂\n\tx  y", "username 42"]:
        assert tokenizer.decode(tokenizer.encode(sample, add_special_tokens=False)) == sample


def test_preprocessor_config_loads(ckpt):
    fe = transformers.AutoFeatureExtractor.from_pretrained(ckpt)
    assert type(fe).__name__ == "WhisperFeatureExtractor"
    assert fe.sampling_rate == 16000 and fe.feature_size == 128
    ip = _auto_image_processor().from_pretrained(ckpt)
    assert ip.patch_size == 16 and ip.merge_size == 2 and ip.temporal_patch_size == 2


def test_auto_processor_loads(ckpt):
    processor = transformers.AutoProcessor.from_pretrained(ckpt)
    assert type(processor).__name__ == "Qwen3OmniMoeProcessor"


# ---------------------------------------------------------------------------- weights / model


def test_weights_not_degenerate(model):
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if param.numel() > 1:
            assert float(param.detach().std()) > 0, name
    experts = model.talker.model.layers[0].mlp.experts.gate_up_proj.detach()
    assert 0.01 < float(experts.std()) < 0.05  # HF leaves these as torch.empty


def test_generate_text_and_audio_greedy(model, tokenizer):
    config = model.config
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    input_ids = enc["input_ids"]
    kwargs = _greedy_kwargs(config)
    ids, wav = model.generate(input_ids=input_ids, attention_mask=enc["attention_mask"], **kwargs)
    assert ids.dtype == torch.long and ids.shape[0] == 1
    assert torch.equal(ids[:, : input_ids.shape[1]], input_ids)
    new = ids.shape[1] - input_ids.shape[1]
    assert 1 <= new <= 8
    assert wav.dtype == torch.float32 and wav.ndim == 3 and wav.shape[:2] == (1, 1)
    assert wav.shape[-1] > 0 and torch.isfinite(wav).all()
    assert float(wav.abs().max()) > 1e-3
    assert float(wav.abs().max()) <= 1.0

    ids2, wav2 = model.generate(input_ids=input_ids, attention_mask=enc["attention_mask"], **kwargs)
    assert torch.equal(ids, ids2) and torch.equal(wav, wav2)


def test_multimodal_thinker(model, tokenizer, ckpt):
    import numpy as np
    import PIL.Image as image_mod
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    fe = transformers.AutoFeatureExtractor.from_pretrained(ckpt)
    ip = _auto_image_processor().from_pretrained(ckpt)
    audio = fe(
        [np.sin(np.arange(16000) / 10).astype(np.float32)],
        sampling_rate=16000,
        return_attention_mask=True,
        padding=True,
        return_tensors="pt",
    )
    image = ip(images=[image_mod.new("RGB", (64, 64), (200, 30, 30))], return_tensors="pt")
    n_img = int(image["image_grid_thw"].prod() // 4)
    n_aud = int(_get_feat_extract_output_lengths(audio["attention_mask"].sum(-1))[0])
    text = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "audio"},
                    {"type": "text", "text": "Describe."},
                ],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n_img)
    text = text.replace("<|audio_pad|>", "<|audio_pad|>" * n_aud)
    enc = tokenizer(text, return_tensors="pt")
    out = model.generate(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        input_features=audio["input_features"],
        feature_attention_mask=audio["attention_mask"],
        pixel_values=image["pixel_values"],
        image_grid_thw=image["image_grid_thw"],
        return_audio=False,
        thinker_max_new_tokens=4,
        thinker_do_sample=False,
        thinker_eos_token_id=model.config.im_end_token_id,
    )
    ids = out if isinstance(out, torch.Tensor) else out.sequences
    assert ids.shape[1] > enc["input_ids"].shape[1]


# ---------------------------------------------------------------------------- determinism / CLI


def _weights(folder) -> dict[str, bytes]:
    """The bytes of every weight shard in ``folder``, by file name."""
    return {p.name: p.read_bytes() for p in sorted(folder.glob("model-*.safetensors"))}


def test_the_weights_are_sharded_with_an_index(ckpt):
    """Several shards and an index, as the released checkpoint has: what lets the
    talker's and code2wav's engines skip the shards they need nothing from."""
    import json

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = _weights(ckpt)
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert not (ckpt / "model.safetensors").exists()


def test_same_seed_identical_different_seed_differs(ckpt, tmp_path):
    tc.build_qwen3_omni(tmp_path / "again", seed=0)
    tc.build_qwen3_omni(tmp_path / "other", seed=1)
    assert _weights(tmp_path / "again") == _weights(ckpt)
    assert _weights(tmp_path / "other") != _weights(ckpt)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (ckpt / name).read_bytes()


def test_cli_subprocess(ckpt, tmp_path):
    out = tmp_path / "cli"
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_omni_plugin.tools.tiny_checkpoint",
            "qwen3-omni",
            str(out),
            "--seed",
            "0",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "parameters" in proc.stdout
    # same seed in another process: byte-identical weights
    assert _weights(out) == _weights(ckpt)


def test_cli_unknown_model(capsys):
    with pytest.raises(SystemExit) as exc:
        tc.main(["bagel-nope", "/tmp/never-written"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "qwen3-omni" in err


def test_cli_help_lists_models(capsys):
    with pytest.raises(SystemExit) as exc:
        tc.main(["--help"])
    assert exc.value.code == 0
    assert "qwen3-omni" in capsys.readouterr().out
