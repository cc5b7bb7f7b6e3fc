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

from plugin_tests.conftest import PYTHON, QWEN3_OMNI_YAML

pytestmark = pytest.mark.engine

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "omni_pipeline.py")
TALKER_FRAMES = 24
#: the talker's max_tokens counts code-0 tokens like HF's talker_max_new_tokens: N -> N - 1 frames
TALKER_MAX_TOKENS = TALKER_FRAMES + 1


def _yaml(root, talker_max_tokens, talker_engine_args=None) -> str:
    with open(QWEN3_OMNI_YAML) as f:
        pipeline = yaml.safe_load(f)
    talker = pipeline["stages"][1]
    talker["default_sampling_params"]["max_tokens"] = talker_max_tokens
    talker["engine_args"].update(talker_engine_args or {})
    path = root / f"pipeline-{talker_max_tokens}-{len(talker_engine_args or ())}.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    return str(path)


def _run(ckpt, yaml_path, out_dir, *scenarios, log: list | None = None) -> dict:
    """The script's report; its output lines are appended to ``log`` when given."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
    proc = subprocess.run([PYTHON, SCRIPT, ckpt, yaml_path, str(out_dir), *scenarios],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    if log is not None:
        log.extend((proc.stdout + proc.stderr).splitlines())
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: float32 waveforms: HF's code2wav and the stage's (vLLM's linear layers, SDPA) differ by
#: rounding only; observed max |diff| about 1e-7 on the tiny checkpoint.
WAVEFORM_ATOL = 1e-5


def _hf_reference(ckpt, prompts):
    """HF ``generate`` (greedy) per prompt: (thinker tokens, codes [T, 16], waveform)."""
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32).eval()
    recorded = {}
    original = model.code2wav.chunked_decode

    def record(codes, *args, **kwargs):
        recorded["codes"] = codes.clone()
        return original(codes, *args, **kwargs)

    model.code2wav.chunked_decode = record
    eos = GenerationConfig.from_pretrained(ckpt).eos_token_id
    out = []
    for prompt in prompts:
        with torch.no_grad():
            sequences, wav = model.generate(
                # speaker: HF's default, which the served request (no voice given) also uses
                input_ids=torch.tensor([prompt]), speaker="Ethan", return_audio=True,
                thinker_max_new_tokens=12, thinker_do_sample=False, thinker_eos_token_id=eos,
                talker_max_new_tokens=TALKER_MAX_TOKENS, talker_do_sample=False)
        out.append((sequences[0, len(prompt):].tolist(), recorded["codes"][0].T.numpy(),
                    wav.reshape(-1).numpy()))
    return out


def _assert_served_equal_hf(report, served, reference):
    """Every request alone and in the concurrent batch: thinker tokens and all 16
    codebooks equal HF's, waveform within WAVEFORM_ATOL; concurrent equal to solo."""
    assert report["sample_rate"] == 24000
    n = len(reference)
    for kind, count in (("solo", n), ("concurrent", len(report["thinker_tokens"]) - n)):
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
            if kind == "concurrent":
                np.testing.assert_array_equal(codes, served[f"solo_codes_{i % n}"])
                np.testing.assert_allclose(wav, served[f"solo_waveform_{i % n}"],
                                           rtol=0, atol=WAVEFORM_ATOL)


def test_codes_and_waveform_match_hf_alone_and_batched(tiny_qwen3_omni, tmp_path):
    report = _run(tiny_qwen3_omni, _yaml(tmp_path, TALKER_MAX_TOKENS), tmp_path, "parity")
    assert report["client_class"] == "OmniEngineClient"
    served = np.load(tmp_path / "served.npz")
    reference = _hf_reference(tiny_qwen3_omni, report["prompt_ids"])
    assert len({len(np.unique(codes)) for _, codes, _ in reference}) > 1  # distinct prompts
    assert all(len(np.unique(codes)) > 10 for _, codes, _ in reference)  # non-trivial codes
    _assert_served_equal_hf(report, served, reference)


def test_talker_chunked_prefill_and_preemption_keep_parity(tiny_qwen3_omni, tmp_path):
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
    _assert_served_equal_hf(report, served, _hf_reference(tiny_qwen3_omni,
                                                          report["prompt_ids"]))


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
