"""End to end: a real `vllm serve` in omni mode (three real EngineCores on vLLM's
worker and model runner) answering real HTTP chat requests.

One server for the module. Killed stage engines, admission control and the
closed ``vllm_xargs`` boundary are in ``test_hardening_serve.py``.
"""

from __future__ import annotations

import base64
import io
import os
import shutil

import pytest
import yaml

from plugin_tests.conftest import QWEN3_OMNI_YAML
from plugin_tests.serve_utils import ServeProcess

pytestmark = pytest.mark.e2e

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
#: the talker's max_tokens (code-0 tokens, as HF's talker_max_new_tokens: 15 frames)
TALKER_MAX_TOKENS = 16
SAMPLE_RATE = 24000


def _write_test_plugin(root) -> str:
    """Install fixtures/omni_test_plugin.py as a package with a real entry point."""
    site = root / "site"
    site.mkdir()
    shutil.copy(os.path.join(FIXTURES, "omni_test_plugin.py"), site / "omni_test_plugin.py")
    dist = site / "omni_test_plugin-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: omni-test-plugin\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm_omni_plugin.stage_input_processors]\nomni_test = omni_test_plugin\n")
    return str(site)


@pytest.fixture(scope="module")
def server(tiny_qwen3_omni, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    with open(QWEN3_OMNI_YAML) as f:
        pipeline = yaml.safe_load(f)
    pipeline["stages"][1]["default_sampling_params"]["max_tokens"] = TALKER_MAX_TOKENS
    pipeline["stages"][2]["input_processor"] = "faulty_talker2code2wav"
    yaml_path = root / "pipeline.yaml"
    yaml_path.write_text(yaml.safe_dump(pipeline))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_write_test_plugin(root),
                                                      env.get("PYTHONPATH")]))
    proc = ServeProcess([tiny_qwen3_omni, "--stage-configs-path", str(yaml_path),
                         "--max-model-len", "2048", "--dtype", "float32",
                         "--omni-replica-wait-timeout", "3"],
                        str(root / "serve.log"), env=env)
    try:
        proc.wait_ready()
        proc.model = tiny_qwen3_omni
        yield proc
    finally:
        proc.stop()


def _decode_wav(message):
    import soundfile as sf

    data, rate = sf.read(io.BytesIO(base64.b64decode(message["audio"]["data"])), dtype="float32")
    return data, rate


def test_stages_run_on_the_workers_the_yaml_names(server):
    """Every stage on vLLM's own worker (OmniWorker over the platform's worker)."""
    from vllm.platforms import current_platform

    log = server.log()
    base = "CPUWorker" if current_platform.is_cpu() else "Worker"
    for stage in (0, 1, 2):
        assert f"stage {stage}: OmniWorker (vLLM's {base} with the stage payload channel)" \
            in log


def test_chat_returns_text_and_wav(server):
    r = server.chat(server.audio_body())
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"]
    audio = message["audio"]
    assert set(audio) >= {"id", "data", "expires_at", "transcript"}
    assert audio["transcript"] == message["content"]
    data, rate = _decode_wav(message)
    assert rate == SAMPLE_RATE
    assert 0 < len(data) <= TALKER_MAX_TOKENS * 1920
    assert float(abs(data).max()) > 0


@pytest.mark.parametrize("extra", [{}, {"modalities": ["text"]}])
def test_text_only_chat_is_plain_vllm(server, extra):
    r = server.chat(server.chat_body(**extra))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] and message.get("audio") is None


@pytest.mark.parametrize("extra, field", [
    ({"modalities": ["text", "video"]}, "modalities"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"modalities": "text,audio"}, "modalities"),
    ({"modalities": ["text", "audio"], "audio": {"format": "mp3"}}, "audio.format"),
    ({"audio": {"voice": "ethan"}}, "audio"),
    ({"modalities": ["text", "audio"], "stream": True}, "stream"),
])
def test_bad_request_is_rejected_and_server_keeps_serving(server, extra, field):
    r = server.chat(server.chat_body(**extra))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"'{field}'" in error["message"]
    ok = server.chat(server.audio_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["audio"]["data"]


def test_unknown_voice_names_stage_and_voices(server):
    r = server.chat(server.audio_body(audio={"voice": "nobody"}))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "stage 1 (talker)" in message and "'nobody'" in message and "ethan" in message
    assert server.chat(server.audio_body(audio={"voice": "Ethan"})).status_code == 200


def test_worker_failure_fails_only_that_request(server):
    r = server.chat(server.audio_body(vllm_xargs={"omni_test_fault": "code2wav"}))
    assert r.status_code == 500, r.text
    assert "stage 2 (code2wav)" in r.json()["error"]["message"]
    assert "request" in server.log() and "failed" in server.log()
    ok = server.chat(server.audio_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["audio"]["data"]


def test_repeated_long_prompt_gives_same_audio(server):
    """A prompt spanning several KV blocks, twice: a prefix-cache hit on the
    second request would drop thinker hidden states (regression test)."""
    long_text = " ".join(["tell me a story about the sea and the stars"] * 6)
    body = server.audio_body(messages=[{"role": "user", "content": long_text}],
                       return_token_ids=True)
    first, second = server.chat(body), server.chat(body)
    assert first.status_code == 200 and second.status_code == 200, second.text
    assert len(first.json()["prompt_token_ids"]) >= 3 * 16  # three full KV blocks
    a, b = (r.json()["choices"][0]["message"] for r in (first, second))
    assert a["content"] == b["content"]
    assert a["audio"]["data"] == b["audio"]["data"]


def test_parity_with_hf_reference(server):
    """Greedy in every stage: served thinker tokens == HF's, served WAV == HF's
    waveform within 16-bit quantisation (1/32768) plus float noise."""
    import numpy as np
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    r = server.chat(server.audio_body(return_token_ids=True, audio={"voice": "ethan"}))
    assert r.status_code == 200, r.text
    response = r.json()
    prompt_ids = response["prompt_token_ids"]
    served_tokens = response["choices"][0]["token_ids"]
    served_wav, _ = _decode_wav(response["choices"][0]["message"])

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(server.model,
                                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        sequences, wav = model.generate(
            input_ids=torch.tensor([prompt_ids]), speaker="ethan", return_audio=True,
            thinker_max_new_tokens=12, thinker_do_sample=False,
            # vLLM stops the thinker on the generation config's eos ids; so does HF here.
            thinker_eos_token_id=GenerationConfig.from_pretrained(server.model).eos_token_id,
            talker_max_new_tokens=TALKER_MAX_TOKENS, talker_do_sample=False,
        )
    hf_tokens = sequences[0, len(prompt_ids):].tolist()
    assert served_tokens == hf_tokens
    hf_wav = np.clip(wav.reshape(-1).numpy(), -1, 1)
    assert served_wav.shape == hf_wav.shape
    err = float(np.abs(served_wav - hf_wav).max())
    assert err <= 1.5 / 32768, err
    print(f"parity: {len(served_tokens)} thinker tokens equal, waveform {len(hf_wav)} samples, "
          f"max abs diff {err:.2e}")

