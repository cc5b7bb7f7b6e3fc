"""The Qwen3-Omni pipeline driven in-process through OmniEngineClient (real EngineCores:
the thinker on vLLM's worker, talker and code2wav on the reference worker): exact
codec-code parity with HF, abort and client-disconnect propagation to every stage."""

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


def _yaml(root, talker_max_tokens) -> str:
    with open(QWEN3_OMNI_YAML) as f:
        pipeline = yaml.safe_load(f)
    pipeline["stages"][1]["default_sampling_params"]["max_tokens"] = talker_max_tokens
    path = root / f"pipeline-{talker_max_tokens}.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    return str(path)


def _run(ckpt, yaml_path, out_dir, *scenarios) -> dict:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
    proc = subprocess.run([PYTHON, SCRIPT, ckpt, yaml_path, str(out_dir), *scenarios],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_codes_and_waveform_match_hf(tiny_qwen3_omni, tmp_path):
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    from vllm_omni_plugin.models.qwen3_omni import talker_inputs as ti

    report = _run(tiny_qwen3_omni, _yaml(tmp_path, TALKER_FRAMES), tmp_path, "parity")
    assert report["client_class"] == "OmniEngineClient"
    served = np.load(tmp_path / "served.npz")

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_qwen3_omni, dtype=torch.float32).eval()
    recorded = {}
    original = model.code2wav.chunked_decode

    def record(codes, *args, **kwargs):
        recorded["codes"] = codes.clone()
        return original(codes, *args, **kwargs)

    model.code2wav.chunked_decode = record
    prompt = report["prompt_ids"]
    with torch.no_grad():
        sequences, wav = model.generate(
            # speaker: HF's default, which the served request (no voice given) also uses
            input_ids=torch.tensor([prompt]), speaker="Ethan", return_audio=True,
            thinker_max_new_tokens=12, thinker_do_sample=False,
            thinker_eos_token_id=GenerationConfig.from_pretrained(tiny_qwen3_omni).eos_token_id,
            talker_max_new_tokens=TALKER_FRAMES + 1, talker_do_sample=False,
        )
    assert report["thinker_tokens"] == sequences[0, len(prompt):].tolist()
    hf_codes = recorded["codes"][0].T.numpy()  # [T, 16]
    assert served["codes"].shape == hf_codes.shape and hf_codes.shape[1] == 16
    assert len(np.unique(hf_codes)) > 10  # non-trivial codes
    diff = np.argwhere(served["codes"] != hf_codes)
    assert diff.size == 0, f"first differing (frame, group): {diff[:5].tolist()}"
    hf_wav = wav.reshape(-1).numpy()
    err = float(np.abs(served["waveform"] - hf_wav).max())
    assert served["waveform"].shape == hf_wav.shape and err <= 1e-5, err
    assert report["sample_rate"] == 24000
    assert ti.codes_for_code2wav(torch.from_numpy(served["codes"]).T).shape[1] == 16
    print(f"parity: thinker {len(report['thinker_tokens'])} tokens equal; codes "
          f"{hf_codes.shape} equal; waveform {hf_wav.size} samples max abs diff {err:.2e}")


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
