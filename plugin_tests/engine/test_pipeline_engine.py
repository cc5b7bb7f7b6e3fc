"""The Qwen3-Omni pipeline driven in-process through OmniEngineClient (real EngineCores,
every stage on vLLM's worker and model runner): thinker tokens, codec codes and
waveforms equal HF's for requests alone, batched, chunked and preempted; abort and
client-disconnect propagation to every stage."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import yaml

from plugin_tests.conftest import PYTHON, QWEN3_OMNI_PD_YAML, QWEN3_OMNI_YAML
from plugin_tests.helpers import run_process_group

pytestmark = pytest.mark.engine

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "omni_pipeline.py")
TALKER_FRAMES = 24
#: the talker's max_tokens counts code-0 tokens like HF's talker_max_new_tokens: N -> N - 1 frames
TALKER_MAX_TOKENS = TALKER_FRAMES + 1


def _yaml(root, talker_max_tokens, talker_engine_args=None, source=QWEN3_OMNI_YAML) -> str:
    with open(source) as f:
        pipeline = yaml.safe_load(f)
    talker = pipeline["stages"][1]
    talker["default_sampling_params"]["max_tokens"] = talker_max_tokens
    talker["engine_args"].update(talker_engine_args or {})
    path = root / (f"pipeline-{talker_max_tokens}-{len(talker_engine_args or ())}-"
                   f"{os.path.basename(source)}")
    path.write_text(yaml.safe_dump(pipeline))
    return str(path)


def _run(ckpt, yaml_path, out_dir, *scenarios, log: list | None = None) -> dict:
    """The script's report; its output lines are appended to ``log`` when given."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
    proc = run_process_group([PYTHON, SCRIPT, ckpt, yaml_path, str(out_dir), *scenarios],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    if log is not None:
        log.extend((proc.stdout + proc.stderr).splitlines())
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: float32 waveforms: HF's code2wav and the stage's (vLLM's linear layers, SDPA) differ by
#: rounding only; observed max |diff| about 1e-7 on the tiny checkpoint.
WAVEFORM_ATOL = 1e-5


def _hf_speak(model, eos, **inputs):
    """HF ``generate`` (greedy, speaker Ethan: HF's default, which a served request without a
    voice also uses): ``(sequences, codes [T, 16], waveform, code-0 logits per frame)``."""
    import torch

    recorded, logits = {}, []
    original = model.code2wav.chunked_decode

    def record(codes, *args, **kwargs):
        recorded["codes"] = codes.clone()
        return original(codes, *args, **kwargs)

    model.code2wav.chunked_decode = record
    hook = model.talker.codec_head.register_forward_hook(
        lambda module, args, output: logits.append(output[0, -1].clone()))
    try:
        with torch.no_grad():
            sequences, wav = model.generate(
                **inputs, speaker="Ethan", return_audio=True, thinker_max_new_tokens=12,
                thinker_do_sample=False, thinker_eos_token_id=eos,
                talker_max_new_tokens=TALKER_MAX_TOKENS, talker_do_sample=False)
    finally:
        hook.remove()
        del model.code2wav.chunked_decode  # back to the class's method
    return sequences, recorded["codes"][0].T.numpy(), wav.reshape(-1).numpy(), logits


def _hf_model(ckpt):
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32).eval()
    return model, GenerationConfig.from_pretrained(ckpt).eos_token_id


@pytest.fixture(scope="module")
def hf_reference(tiny_qwen3_omni):
    """``reference(prompts)``: HF ``generate`` (greedy) per prompt, (thinker tokens, codes
    [T, 16], waveform); computed once per list of prompts (every run here serves the
    script's same prompts)."""
    import torch

    cache: dict[str, list] = {}

    def reference(prompts):
        key = json.dumps(prompts)
        if key not in cache:
            model, eos = _hf_model(tiny_qwen3_omni)
            out = []
            for prompt in prompts:
                sequences, codes, wav, _ = _hf_speak(model, eos,
                                                     input_ids=torch.tensor([prompt]))
                out.append((sequences[0, len(prompt):].tolist(), codes, wav))
            cache[key] = out
        return cache[key]

    return reference


#: 96 x 64 pixels: a 6 x 4 patch grid, 6 tokens after the 2 x 2 merge (not square, so the
#: M-RoPE height and width rows differ)
IMAGE_SIZE = (96, 64)
AUDIO_SECONDS = 1.5


@pytest.fixture(scope="module")
def default_run(tiny_qwen3_omni, tmp_path_factory):
    """One run of the script on the shipped pipeline (talker at TALKER_MAX_TOKENS) for the
    scenarios that need no other engine settings: streamed, parity and media (an image
    and an audio clip in ``OUT_DIR/media``). ``(report, OUT_DIR)``; three engine starts
    instead of one per scenario."""
    from plugin_tests import media

    out = tmp_path_factory.mktemp("pipeline")
    folder = out / "media"
    folder.mkdir()
    (folder / "image.png").write_bytes(media.png_bytes(*IMAGE_SIZE))
    (folder / "audio.wav").write_bytes(media.wav_bytes(AUDIO_SECONDS))
    report = _run(tiny_qwen3_omni, _yaml(out, TALKER_MAX_TOKENS), out, "streamed", "parity",
                  "media")
    return report, out


def _assert_served_equal_hf(report, served, reference):
    """Every request alone and in the concurrent batch: thinker tokens and all 16
    codebooks equal HF's, waveform within WAVEFORM_ATOL; concurrent equal to solo."""
    assert report["sample_rate"] == 24000
    n = len(reference)
    for kind, count in (("solo", n), ("concurrent", len(report["thinker_tokens"]) - 2 * n)):
        for i in range(count):
            tokens, hf_codes, hf_wav = reference[i % n]
            assert report["thinker_tokens"][f"{kind}_{i}"] == tokens, (kind, i)
            codes, wav = served[f"{kind}_codes_{i}"], served[f"{kind}_waveform_{i}"]
            assert codes.shape == hf_codes.shape and hf_codes.shape[1] == 16, (kind, i)
            diff = np.argwhere(codes != hf_codes)
            assert diff.size == 0, f"{kind} {i}: first differing (frame, group) {diff[:5]}"
            assert wav.shape == hf_wav.shape, (kind, i)
            err = float(np.abs(wav - hf_wav).max())
            assert err <= WAVEFORM_ATOL, (kind, i, err)
            if kind == "solo":  # the same request without audio output: the same text
                assert report["thinker_tokens"][f"text_{i}"] == tokens, i
            if kind == "concurrent":
                np.testing.assert_array_equal(codes, served[f"solo_codes_{i % n}"])
                np.testing.assert_allclose(wav, served[f"solo_waveform_{i % n}"],
                                           rtol=0, atol=WAVEFORM_ATOL)


def test_codes_and_waveform_match_hf_alone_and_batched(default_run, hf_reference):
    report, out = default_run
    assert report["client_class"] == "OmniEngineClient"
    served = np.load(out / "served.npz")
    reference = hf_reference(report["prompt_ids"])
    assert len({len(np.unique(codes)) for _, codes, _ in reference}) > 1  # distinct prompts
    assert all(len(np.unique(codes)) > 10 for _, codes, _ in reference)  # non-trivial codes
    _assert_served_equal_hf(report, served, reference)


def test_streamed_requests_feed_the_talker_while_the_thinker_runs(default_run, hf_reference):
    """Requests the API layer streams: the talker starts on the thinker's first rows and
    is fed the rest as one resumable vLLM request (``stream_input``), code2wav decodes in
    chunks, each continuing its stream's state; codes still equal HF's, alone and 8 at
    once, and the joined waveform is HF's up to float rounding."""
    from plugin_tests.engine.test_code2wav_engine import ATOL_HF

    report, out = default_run
    assert report["talker_fed"] and all(report["talker_fed"].values()), report["talker_fed"]
    served = np.load(out / "streamed.npz")
    reference = hf_reference(report["prompt_ids"])
    n = len(reference)
    for kind, count in (("solo", n), ("concurrent", 8)):
        for i in range(count):
            tokens, hf_codes, hf_wav = reference[i % n]
            assert report["streamed_thinker_tokens"][f"{kind}_{i}"] == tokens, (kind, i)
            codes, wav = served[f"{kind}_codes_{i}"], served[f"{kind}_waveform_{i}"]
            diff = np.argwhere(codes != hf_codes) if codes.shape == hf_codes.shape else None
            assert diff is not None and diff.size == 0, (kind, i, codes.shape, diff)
            assert wav.shape == hf_wav.shape, (kind, i)
            assert float(np.abs(wav - hf_wav).max()) <= ATOL_HF, (kind, i)


def test_prefill_decode_disaggregation_keeps_parity(tiny_qwen3_omni, tmp_path, hf_reference):
    """The PD pipeline (stage_configs/qwen3_omni_moe_pd.yaml: the thinker's prefill on its
    own engine, KV cache pulled by the entry engine through OmniMooncakeConnector over
    TCP): text-only and text+audio requests, alone and 8 at once, give HF's thinker tokens,
    talker codes and waveform, as without PD; every request went through the prefill
    stage."""
    pytest.importorskip("mooncake.engine", reason="the plugin's `pd` extra is not installed")
    report = _run(tiny_qwen3_omni, _yaml(tmp_path, TALKER_MAX_TOKENS, source=QWEN3_OMNI_PD_YAML),
                  tmp_path, "parity")
    served = np.load(tmp_path / "served.npz")
    _assert_served_equal_hf(report, served, hf_reference(report["prompt_ids"]))
    assert report["prefill_requests"] == len(report["thinker_tokens"])  # one per request


def test_talker_chunked_prefill_and_preemption_keep_parity(tiny_qwen3_omni, tmp_path,
                                                           hf_reference):
    """A talker engine with a 16-token budget (talker prompts of 14-25 positions are
    chunked) and 5 KV blocks of 32 (4 usable; 8 requests of about 50 positions need 16): vLLM
    preempts and recomputes talker requests; the codes still equal HF's."""
    tight = {"max_num_batched_tokens": 16, "max_num_seqs": 8, "block_size": 32,
             "num_gpu_blocks_override": 5, "max_model_len": 128}
    log: list[str] = []
    report = _run(tiny_qwen3_omni, _yaml(tmp_path, TALKER_MAX_TOKENS, tight), tmp_path,
                  "parity", log=log)
    resumed = [line for line in log if "resumed after preemption" in line]
    assert resumed, "the talker was never preempted"
    served = np.load(tmp_path / "served.npz")
    _assert_served_equal_hf(report, served, hf_reference(report["prompt_ids"]))


def _thinker_media_positions_match_hf() -> bool:
    """Whether vLLM's Qwen3-Omni thinker places media tokens where HF's ``get_rope_index``
    does. vLLM 0.30 and 0.31 place each media item one token late: their
    ``get_mrope_input_positions`` adds a position for the start token at the item's
    ``mm_position.offset``, which already points at the first placeholder (fixed in 0.32).
    The talker follows the thinker's positions, so it can only equal HF where they match."""
    from packaging.version import Version

    from vllm_omni_plugin.compat.version import vllm_version

    return Version(vllm_version()).release >= (0, 32)


def _hf_media_reference(ckpt, media_dir):
    """HF on the same files through HF's own processor: ``{kind: (prompt ids, thinker
    tokens, codes [T, 16] or None, waveform or None, frames before the first near-tie)}``.
    HF's talker cannot take an audio-input prompt (its ``get_rope_index`` reads an
    ``audio_config`` the talker config lacks, transformers 5.19), so audio gets the
    thinker's tokens only."""
    import soundfile as sf
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    from plugin_tests.engine.scripts.omni_pipeline import MEDIA_TEXT

    processor = AutoProcessor.from_pretrained(ckpt)
    model, eos = _hf_model(ckpt)
    out = {}
    for kind in ("image", "audio"):
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": kind, kind: "-"},
                                          {"type": "text", "text": MEDIA_TEXT}]}],
            add_generation_prompt=True, tokenize=False)
        if kind == "image":
            media = {"images": [Image.open(media_dir / "image.png").convert("RGB")]}
        else:
            media = {"audio": [sf.read(media_dir / "audio.wav", dtype="float32")[0]]}
        inputs = processor(text=[text], return_tensors="pt", **media)
        prompt = inputs["input_ids"][0].tolist()
        if kind == "image":
            sequences, codes, wav, logits = _hf_speak(model, eos, **inputs)
            out[kind] = (prompt, sequences[0, len(prompt):].tolist(), codes, wav,
                         _first_near_tie(logits, codes, model))
        else:
            with torch.no_grad():
                sequences = model.thinker.generate(**inputs, max_new_tokens=12,
                                                   do_sample=False, eos_token_id=eos)
            out[kind] = (prompt, sequences[0, len(prompt):].tolist(), None, None, 0)
    return out


#: A code-0 choice whose two best logits (HF's) are closer than this may flip under float32
#: rounding differences between vLLM's kernels and HF's.
NEAR_TIE = 1e-3


def _first_near_tie(logits, codes, model) -> int:
    """The first frame whose code 0 HF chose by less than :data:`NEAR_TIE` (else the
    frame count)."""
    from vllm_omni_plugin.models.qwen3_omni.talker_inputs import talker_logits_mask

    mask = talker_logits_mask(model.config)
    for frame in range(codes.shape[0]):
        top = logits[frame].masked_fill(mask, float("-inf")).topk(2).values
        if float(top[0] - top[1]) < NEAR_TIE:
            return frame
    return codes.shape[0]


def test_image_and_audio_input_match_hf(tiny_qwen3_omni, default_run):
    """An image and an audio clip through vLLM's Qwen3-Omni processor: prompt ids and
    thinker tokens equal HF's (HF's own processor on the same files). For the image, the
    talker's codes (on HF's 3-D M-RoPE positions; with plain positions they differed from
    frame 6 on) equal HF's up to the first frame whose code 0 HF picked by a near-tie
    (random weights: observed at frame 11 of 24, margin 1.6e-4), and so does the waveform
    of those frames. The audio request's speech has every frame. On vLLM 0.30/0.31 the
    thinker's own media positions are off by one token (see
    :func:`_thinker_media_positions_match_hf`); there the image's codes are only checked
    for shape."""
    report, out = default_run
    served = np.load(out / "media.npz")
    reference = _hf_media_reference(tiny_qwen3_omni, out / "media")
    for kind, (prompt, tokens, hf_codes, hf_wav, exact) in reference.items():
        got = report["media"][kind]
        assert got["prompt_ids"] == prompt, kind
        assert got["thinker_tokens"] == tokens, kind
        codes, wav = served[f"{kind}_codes"], served[f"{kind}_waveform"]
        assert codes.shape == (TALKER_FRAMES, 16) and len(np.unique(codes)) > 10, kind
        # as many samples as HF's image answer, which has as many frames
        assert wav.shape == reference["image"][3].shape and float(np.abs(wav).max()) > 0, kind
        if hf_codes is None or not _thinker_media_positions_match_hf():
            continue
        assert exact >= 8, f"HF's own code 0 is a near-tie at frame {exact}: pick another image"
        diff = np.argwhere(codes[:exact] != hf_codes[:exact])
        assert diff.size == 0, f"first differing (frame, group) {diff[:5]}"
        # code2wav is causal with a fixed lag: its waveform is `lag` samples shorter than
        # 1920 per frame, and the first k frames decide its first 1920 k - lag samples
        lag = TALKER_FRAMES * 1920 - hf_wav.shape[0]
        prefix = exact * 1920 - lag
        err = float(np.abs(wav[:prefix] - hf_wav[:prefix]).max())
        assert err <= WAVEFORM_ATOL, err


def test_abort_and_disconnect_reach_every_stage(tiny_qwen3_omni, tmp_path):
    # a long talker run so the request is still in the talker when aborted
    report = _run(tiny_qwen3_omni, _yaml(tmp_path, 200), tmp_path, "cancel", "abort")
    for scenario in ("cancel", "abort"):
        seen = report[scenario]
        assert seen["was_in_talker"], seen
        assert seen["talker_unfinished"] == 0, seen
        assert not seen["result_stored"] and not seen["inflight_left"], seen
        assert seen["payload_dirs_left"] == [], seen
    assert report["after_ok"]
