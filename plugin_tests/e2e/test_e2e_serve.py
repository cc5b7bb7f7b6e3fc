"""End to end: a real `vllm serve` in omni mode (three real EngineCores on vLLM's
worker and model runner) answering real HTTP chat requests.

One server for the module. Its pipeline is a memory plan written by the plan tool, as a
user writes one on vLLM's CPU build,

    python -m vllm_omni_plugin.tools.plan <tiny Qwen3-Omni> --pipeline qwen3_omni_moe \
        --devices cpu:3 --max-model-len 2048 --dtype float32 --write plan.yaml

with the tests' changes over it (the talker's length and core, stall timeouts, a test
processor plugin, code2wav's streaming chunks), served with no memory flag or variable:
each engine's KV cache is the size the plan wrote. Killed stage engines, admission
control and the closed ``vllm_xargs`` boundary are in ``test_hardening_serve.py``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import yaml

from plugin_tests.conftest import PYTHON, REPO
from plugin_tests.serve_utils import check_stall_recovery, serving

pytestmark = pytest.mark.e2e

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
#: the talker's max_tokens (code-0 tokens, as HF's talker_max_new_tokens: 15 frames)
TALKER_MAX_TOKENS = 16
SAMPLE_RATE = 24000
#: code2wav's streaming chunk (frames): a streamed answer's up to 15 frames in 3 chunks
STREAM_CHUNK = 5


#: --limit-mm-per-prompt of the module's server
MEDIA_LIMITS = {"image": 2, "audio": 2, "video": 1}
#: the module's server's --omni-realtime-max-sessions and --omni-realtime-idle-timeout
REALTIME_SESSIONS = 3
REALTIME_IDLE_S = 10
#: bytes of one second of the Realtime API's audio (pcm16 at 24 kHz)
RATE_BYTES = 24000 * 2
#: the talker's runtime.devices: on vLLM's CPU build, the core its worker runs on. Under
#: pytest-xdist, the core this test worker's engines are bound to (plugin_tests/conftest.py):
#: placed on the other worker's core, the talker shared it with that worker's engines, and
#: in CI the hardening server's thinker, generating its fuzzed requests' 2,048 tokens, kept
#: it from running a step for 60 s (a stall, then a restart under the next tests). Without
#: xdist, the last core this process may use, away from the thinker's.
TALKER_CORE = int(os.environ["VLLM_CPU_OMP_THREADS_BIND"]) \
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").isdigit() \
    else max(os.sched_getaffinity(0))
#: the plan tool's arguments for the module server's pipeline
PLAN_ARGS = ["--pipeline", "qwen3_omni_moe", "--devices", "cpu:3", "--max-model-len", "2048",
             "--dtype", "float32"]
#: runtime.stall_timeout of the module server's talker and code2wav, seconds: far above
#: their longest step here, now that the talker runs on this test worker's core, not the
#: other worker's (8 s was not, beside another server on a 2-core host; 30 s, as the
#: prefill/decode server's prefill stage, is what a stall test then waits)
STALL_S = 30


def _trust_request_mm_kwargs() -> list[str]:
    """vLLM 0.32 refuses per-request ``mm_processor_kwargs`` (``use_audio_in_video``)
    unless the server trusts them; earlier releases take them without the flag."""
    try:
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
    except ImportError:
        return []
    fields = getattr(FrontendArgs, "__dataclass_fields__", {})
    return ["--trust-request-mm-kwargs"] if "trust_request_mm_kwargs" in fields else []


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
    plan_path = root / "plan.yaml"
    plan = subprocess.run([PYTHON, "-m", "vllm_omni_plugin.tools.plan", tiny_qwen3_omni,
                           *PLAN_ARGS, "--write", str(plan_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    pipeline = yaml.safe_load(plan_path.read_text())
    pipeline["stages"][1]["default_sampling_params"]["max_tokens"] = TALKER_MAX_TOKENS
    pipeline["stages"][1]["runtime"]["devices"] = TALKER_CORE
    for stage in pipeline["stages"][1:]:
        stage.setdefault("runtime", {})["stall_timeout"] = STALL_S
    pipeline["stages"][2]["input_processor"] = "faulty_talker2code2wav"
    pipeline["stages"][2]["streaming"] = {"chunk_size": STREAM_CHUNK, "left_context": 25,
                                          "first_chunk_size": 2}
    yaml_path = root / "pipeline.yaml"
    yaml_path.write_text(yaml.safe_dump(pipeline))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_write_test_plugin(root),
                                                      env.get("PYTHONPATH")]))
    with serving(tiny_qwen3_omni, ["--stage-configs-path", str(yaml_path),
                                   "--max-model-len", "2048", "--dtype", "float32",
                                   "--omni-replica-wait-timeout", "3",
                                   "--limit-mm-per-prompt", json.dumps(MEDIA_LIMITS),
                                   "--omni-realtime-max-sessions", str(REALTIME_SESSIONS),
                                   "--omni-realtime-idle-timeout", str(REALTIME_IDLE_S),
                                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                   *_trust_request_mm_kwargs()],
                 str(root / "serve.log"), env=env, memory_flags=False) as proc:
        proc.plan = (plan_path, plan.stdout)
        yield proc


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


def test_the_plan_fits_and_the_engines_have_its_kv_cache_sizes(server):
    """The plan tool's table says the pipeline fits, its file names the command that wrote
    it, and each engine with a KV cache has the size the plan wrote (vLLM's CPU worker
    logs each explicit size)."""
    path, table = server.plan
    assert "fits on host memory 3 GiB" in table
    text = path.read_text()
    assert text.startswith("# Written by: python -m vllm_omni_plugin.tools.plan MODEL "
                           + " ".join(PLAN_ARGS))
    stages = {s["name"]: s for s in yaml.safe_load(text)["stages"]}
    planned = sorted(stages[n]["runtime"]["cpu_kv_cache_gib"] for n in ("thinker", "talker"))
    assert all(size > 0 for size in planned), planned
    sizes = sorted(float(x) for x in re.findall(
        r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", server.log()))
    assert sizes == pytest.approx(planned, abs=0.01)


def test_downstream_engines_read_only_their_shards(server, tiny_qwen3_omni):
    """The tiny checkpoint is sharded with an index, as the release is: vLLM's loader
    (0.32 and later) skips, in the talker's and code2wav's engines, the shards holding
    none of their keys, and logs how many."""
    from dataclasses import fields

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if "is_unused_weight" not in {f.name for f in fields(DefaultModelLoader.Source)}:
        pytest.skip("vLLM before 0.32 reads every shard")
    with open(os.path.join(tiny_qwen3_omni, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shards = set(weight_map.values())
    for prefix in ("talker.", "code2wav."):
        skipped = len(shards - {f for k, f in weight_map.items() if k.startswith(prefix)})
        assert 0 < skipped < len(shards), prefix
        assert f"Skipped {skipped}/{len(shards)} safetensors shard(s) holding no weights " \
            "the model loads" in server.log(), prefix


def test_placed_stage_runs_on_its_cores(server):
    """``runtime.devices`` on vLLM's CPU build: the talker's EngineCore binds its
    worker's OpenMP threads to the YAML's core (the worker process's CPU affinity)."""
    import psutil
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("runtime.devices are CPU cores on vLLM's CPU build only")
    log = server.log()
    assert f"stage 1: workers placed with VLLM_CPU_OMP_THREADS_BIND={TALKER_CORE}" in log
    _, pid = server.stage_worker(1)
    assert psutil.Process(pid).cpu_affinity() == [TALKER_CORE]


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
    ({"modalities": ["text", "audio"], "audio": {"format": "aac"}}, "audio.format"),
    ({"audio": {"voice": "ethan"}}, "audio"),
    ({"modalities": ["text", "audio"], "stream": True, "audio": {"format": "wav"}},
     "audio.format"),
])
def test_bad_request_is_rejected_and_server_keeps_serving(server, extra, field):
    r = server.chat(server.chat_body(**extra))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"'{field}'" in error["message"]
    ok = server.chat(server.audio_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["audio"]["data"]


def _pcm16(message) -> np.ndarray:
    return np.frombuffer(base64.b64decode(message["audio"]["data"]), "<i2")


@pytest.mark.parametrize("fmt", ["pcm16", "flac", "mp3", "opus"])
def test_each_audio_format_decodes_to_the_wav_sample_count(server, fmt):
    """The same greedy request as WAV and as ``fmt``: a standard decoder (libsndfile; raw
    int16 for pcm16) gives the WAV's sample count; pcm16 its samples, FLAC within 1 LSB."""
    import soundfile as sf

    wav = server.chat(server.audio_body(audio={"format": "wav"}))
    other = server.chat(server.audio_body(audio={"format": fmt}))
    assert wav.status_code == 200 and other.status_code == 200, other.text
    reference, _ = sf.read(io.BytesIO(base64.b64decode(
        wav.json()["choices"][0]["message"]["audio"]["data"])), dtype="int16")
    message = other.json()["choices"][0]["message"]
    if fmt == "pcm16":
        samples = _pcm16(message)
    else:
        samples, rate = sf.read(io.BytesIO(base64.b64decode(message["audio"]["data"])),
                                dtype="int16")
        assert rate == SAMPLE_RATE
    assert len(reference) > 0 and len(samples) == len(reference)
    if fmt == "pcm16":
        np.testing.assert_array_equal(samples, reference)
    elif fmt == "flac":  # libsndfile rounds float to 16 bit for FLAC unlike for WAV
        assert np.abs(samples.astype(np.int32) - reference).max() <= 1


def _read_stream(stream) -> tuple[str | None, list[str], list[dict], list[bytes], str | None]:
    """An OpenAI SDK chat stream read to its end: (the chunks' id, the text deltas that
    have text, each ``delta.audio`` as a dict, each one's decoded ``data``, the last
    ``finish_reason``)."""
    text, audio_deltas, pcm, finish, request_id = [], [], [], None, None
    for chunk in stream:
        request_id = chunk.id
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            text.append(delta.content)
        # the SDK parses delta.audio (ChoiceDeltaAudio); older SDKs keep it as an extra
        audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
        if audio:
            audio = audio if isinstance(audio, dict) else audio.model_dump()
            audio_deltas.append(audio)
            pcm.append(base64.b64decode(audio["data"]))
        finish = chunk.choices[0].finish_reason or finish
    return request_id, text, audio_deltas, pcm, finish


def test_streamed_chat_audio_deltas_equal_the_unstreamed_answer(server):
    """OpenAI SDK, ``stream=True`` with audio: text deltas as vLLM streams them, and
    ``delta.audio`` chunks decoded by code2wav while the talker generates (2 frames, then
    chunks growing to :data:`STREAM_CHUNK` frames) whose PCM16, concatenated, is the
    non-streamed answer's: the same sample count, each sample within 1 LSB (a chunk is
    decoded apart from the frames after it: float noise); transcripts joined are the
    text."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    body = server.audio_body(audio={"voice": "ethan", "format": "pcm16"})
    unstreamed = server.chat(body)
    assert unstreamed.status_code == 200, unstreamed.text
    expected = unstreamed.json()["choices"][0]["message"]
    stream = client.chat.completions.create(
        model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"],
        temperature=0, modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"}, stream=True)
    request_id, text, audio_deltas, pcm, finish = _read_stream(stream)
    assert finish == "length" and len(text) > 1
    assert "".join(text) == expected["content"]
    assert audio_deltas[-1]["expires_at"] > 0
    assert len({a["id"] for a in audio_deltas}) == 1
    assert sum(1 for p in pcm if p) >= 2, "the audio came in one piece: no chunk streamed"
    # the first chunk is first_chunk_size (2) frames of 1920 samples (24 kHz, 12.5 Hz)
    assert len(next(p for p in pcm if p)) // 2 <= 2 * 1920
    assert "".join(a.get("transcript") or "" for a in audio_deltas) == expected["content"]
    streamed = np.frombuffer(b"".join(pcm), "<i2").astype(np.int32)
    reference = _pcm16(expected).astype(np.int32)
    assert streamed.shape == reference.shape
    assert np.abs(streamed - reference).max() <= 1
    # the talker (stream_input) started while the thinker still generated
    started = re.search(rf"request {re.escape(request_id)}\S*: stage 1 \(talker\) starts "
                        r"after (\d+) tokens of stage 0", server.log())
    assert started and int(started[1]) < body["max_tokens"], request_id


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_reply_too_short_to_speak_is_its_text_and_no_speech(server, stream):
    """A one-token reply (``max_tokens`` 1 here; an end of turn right away does the same):
    the talker's prompt needs the thinker's row of generated token 0, which only the step
    of a second token feeds, so there is nothing to speak. The answer is a 200 with the
    text and audio of 0 samples, streamed or not (issue 27, 9: it was a 500 raised by the
    talker's prompt build), and the server goes on serving."""
    import openai

    body = server.audio_body(max_tokens=1, audio={"voice": "ethan", "format": "pcm16"})
    text_only = server.chat(server.chat_body(max_tokens=1))
    assert text_only.status_code == 200, text_only.text
    expected = text_only.json()["choices"][0]["message"]["content"] or ""
    if not stream:
        r = server.chat(body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert (choice["message"]["content"] or "") == expected
        assert choice["message"]["audio"]["transcript"] == expected
        assert _pcm16(choice["message"]).size == 0
    else:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
        _, text, audio_deltas, pcm, finish = _read_stream(client.chat.completions.create(
            model=body["model"], messages=body["messages"], max_tokens=1, temperature=0,
            modalities=["text", "audio"], audio=body["audio"], stream=True))
        assert finish == "length" and "".join(text) == expected
        assert audio_deltas and audio_deltas[-1]["expires_at"] > 0 and b"".join(pcm) == b""
        assert "".join(a.get("transcript") or "" for a in audio_deltas) == expected
    ok = server.chat(server.audio_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["audio"]["data"]


def test_half_a_minute_of_mixed_load_answers_every_valid_request(server):
    """30 s of ``benchmarks/soak_bench.py`` against this server: 12 clients cycling
    through text, audio, streamed audio, disconnects, bad requests and speech (each kind
    a few times over; the run's CPU is CI's time, so not a minute). No valid request gets
    a 5xx (or a stream error), every bad one its 400, and once the load stopped the
    payload store is empty (issue 27, 9 and 10; the RSS slope is the benchmark's, over 30
    minutes)."""
    import asyncio
    import glob
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from soak_bench import soak

    (run_dir,) = glob.glob(f"/dev/shm/vllm-omni-plugin-{server.proc.pid}-*")
    report = asyncio.run(soak(server.url, server.model, 30, 12, server.proc.pid,
                              Path(run_dir), interval=10))
    totals = report.totals()
    assert report.failed_valid() == 0, totals
    assert all(totals[(kind, "200")] + totals[(kind, "disconnected")] > 0
               for kind in ("text", "audio", "streamed", "speech")), totals
    assert totals[("bad", "400")] > 0 and totals[("disconnect", "disconnected")] > 0, totals
    assert report.files_at_end == 0
    assert server.proc.poll() is None


def test_streamed_chat_failure_is_an_error_event(server):
    """A stage failing after the text streamed: the OpenAI SDK raises with the stage."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    body = server.audio_body()
    with pytest.raises(openai.APIError, match="stage 2 \\(code2wav\\)"):
        for _ in client.chat.completions.create(
                model=body["model"], messages=body["messages"], max_tokens=4,
                modalities=["text", "audio"], stream=True,
                extra_body={"vllm_xargs": {"omni_test_fault": "code2wav"}}):
            pass
    ok = server.chat(server.audio_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["audio"]["data"]


def test_voices_lists_the_checkpoint_speakers(server, tiny_qwen3_omni):
    import requests

    with open(os.path.join(tiny_qwen3_omni, "config.json")) as f:
        speakers = json.load(f)["talker_config"]["speaker_id"]
    r = requests.get(f"{server.url}/v1/audio/voices", timeout=30)
    assert r.status_code == 200, r.text
    assert sorted(v["id"] for v in r.json()["data"]) == sorted(speakers)
    assert r.json()["default"] == "ethan"


def test_unknown_voice_is_a_400_listing_the_voices(server):
    r = server.chat(server.audio_body(audio={"voice": "nobody"}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "audio.voice"
    assert "'nobody'" in error["message"] and "ethan" in error["message"].lower()
    assert server.chat(server.audio_body(audio={"voice": "Ethan"})).status_code == 200


def test_speech_endpoint_speaks_the_input(server):
    """``/v1/audio/speech`` through the OpenAI SDK: the same input twice gives the same
    bytes, another input other audio; the SSE events carry the same audio."""
    import openai
    import requests
    import soundfile as sf

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")

    def speak(text, **extra):
        return client.audio.speech.create(model=server.model, voice="ethan", input=text,
                                          response_format="wav", **extra).content

    first, again = speak("Hello there, how are you?"), speak("Hello there, how are you?")
    other = speak("The weather is cold and grey today.")
    data, rate = sf.read(io.BytesIO(first), dtype="float32")
    assert rate == SAMPLE_RATE and 0 < len(data) <= TALKER_MAX_TOKENS * 1920
    assert first == again and first != other
    r = requests.post(f"{server.url}/v1/audio/speech", timeout=300, json={
        "model": server.model, "voice": "ethan", "input": "Hello there, how are you?",
        "response_format": "wav", "stream_format": "sse"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.done"]
    assert base64.b64decode(events[0]["audio"]) == first
    assert events[1]["usage"]["input_tokens"] > 0


def test_pcm_speech_streams_chunks_that_join_into_the_whole_speech(server):
    """``/v1/audio/speech`` with ``pcm``, read as a stream through the OpenAI SDK and as
    SSE: code2wav's chunks go out as they come (at least two pieces) and, joined, are the
    WAV answer's samples within 1 LSB (chunks decoded apart: float noise)."""
    import openai
    import requests
    import soundfile as sf

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    text = "Hello there, how are you?"
    wav = client.audio.speech.create(model=server.model, voice="ethan", input=text,
                                     response_format="wav").content
    reference = sf.read(io.BytesIO(wav), dtype="int16")[0].astype(np.int32)
    with client.audio.speech.with_streaming_response.create(
            model=server.model, voice="ethan", input=text, response_format="pcm") as answer:
        pcm = b"".join(answer.iter_bytes())
    streamed = np.frombuffer(pcm, "<i2").astype(np.int32)
    assert streamed.shape == reference.shape
    assert np.abs(streamed - reference).max() <= 1
    r = requests.post(f"{server.url}/v1/audio/speech", timeout=300, json={
        "model": server.model, "voice": "ethan", "input": text, "response_format": "pcm",
        "stream_format": "sse"})
    assert r.status_code == 200, r.text
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ")]
    deltas = [base64.b64decode(e["audio"]) for e in events[:-1]]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    assert events[-1]["type"] == "speech.audio.done"
    assert sum(1 for d in deltas if d) >= 2 and b"".join(deltas) == pcm


@pytest.mark.parametrize("change, field", [
    ({"voice": "nobody"}, "voice"), ({"response_format": "aac"}, "response_format"),
    ({"speed": 2.0}, "speed"), ({"input": ""}, "input")])
def test_bad_speech_request_is_a_400_naming_the_field(server, change, field):
    import requests

    body = {"model": server.model, "voice": "ethan", "input": "Hello", **change}
    r = requests.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_worker_failure_fails_only_that_request(server):
    r = server.chat(server.audio_body(vllm_xargs={"omni_test_fault": "code2wav"}))
    assert r.status_code == 500, r.text
    assert "stage 2 (code2wav)" in r.json()["error"]["message"]
    assert "request" in server.log() and "failed" in server.log()
    ok = server.chat(server.audio_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["audio"]["data"]


def _prefix_cache_hits(server) -> float:
    """The thinker's prefix-cache hits so far (vLLM's counter, tokens)."""
    return sum(value for (name, _), value in server.metrics().items()
               if name == "vllm:prefix_cache_hits_total")


def test_a_repeated_long_prompt_reads_the_prefix_cache_as_text_and_as_speech(server):
    """vLLM's prefix caching on the thinker: the same long prompt (several KV blocks of
    128 positions, the CPU build's block size) as text a second time reads its cached
    blocks and answers the same, as in plain vLLM. As speech, the first time reads none
    (the blocks text computed have no rows for the talker) and computes the prompt again;
    the second time reads those blocks (the row cache's twins of the text's), and both
    give the same text and audio. ``/metrics`` then shows the row cache's blocks, bytes
    and the blocks it handed out."""
    messages = [{"role": "user",
                 "content": " ".join(["tell me a story about the sea and the stars"] * 40)}]
    text = server.chat_body(messages=messages, return_token_ids=True)
    first = server.chat(text)
    assert first.status_code == 200, first.text
    assert len(first.json()["prompt_token_ids"]) >= 3 * 128
    hits = _prefix_cache_hits(server)
    second = server.chat(text)
    assert second.status_code == 200, second.text
    server.wait_until(lambda: _prefix_cache_hits(server) >= hits + 2 * 128, timeout=30)
    answer = first.json()["choices"][0]["message"]["content"]
    assert second.json()["choices"][0]["message"]["content"] == answer

    hits = _prefix_cache_hits(server)
    spoken = server.chat(server.audio_body(messages=messages))
    assert spoken.status_code == 200, spoken.text
    assert _prefix_cache_hits(server) == hits  # the text's blocks hold no rows
    again = server.chat(server.audio_body(messages=messages))
    assert again.status_code == 200, again.text
    server.wait_until(lambda: _prefix_cache_hits(server) >= hits + 2 * 128, timeout=30)
    a, b = (r.json()["choices"][0]["message"] for r in (spoken, again))
    assert a["content"] == b["content"] == answer
    assert a["audio"]["data"] == b["audio"]["data"]
    server.wait_until(lambda: (server.metric("vllm_omni:row_cache_hit_blocks_total",
                                             stage=0) or 0) >= 2, timeout=60)
    assert server.metric("vllm_omni:row_cache_blocks", stage=0) >= 3
    assert server.metric("vllm_omni:row_cache_bytes", stage=0) > 0


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



# -- media input -----------------------------------------------------------------------
def _media_parts() -> dict[str, tuple[dict, dict]]:
    """kind -> (content part, extra request fields), as a client sends them."""
    from plugin_tests import media

    wav = media.b64(media.wav_bytes(1.5))
    return {
        "image": ({"type": "image_url", "image_url": {
            "url": media.data_url("image/png", media.png_bytes(96, 64))}}, {}),
        "audio": ({"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}, {}),
        "video": ({"type": "video_url", "video_url": {
            "url": media.data_url("video/mp4", media.mp4_bytes(4, 64, 64))}}, {}),
        "video+audio": ({"type": "video_url", "video_url": {
            "url": media.data_url("video/mp4", media.mp4_bytes(4, 64, 64))}},
            {"mm_processor_kwargs": {"use_audio_in_video": True}}),
    }


@pytest.mark.parametrize("kind", ["image", "audio", "video", "video+audio"])
def test_media_input_chat_speaks(server, kind):
    """Image, audio and video input (and a video's own sound with use_audio_in_video)
    through vLLM's Qwen3-Omni processor, text and speech out, parsed by the OpenAI SDK;
    the prompt holds the medium's placeholder tokens."""
    import openai
    from transformers import AutoConfig

    part, extra = _media_parts()[kind]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    completion = client.chat.completions.create(
        model=server.model, max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
        extra_body={"return_token_ids": True, **extra})
    message = completion.choices[0].message
    assert message.content and message.audio is not None
    samples, rate = _decode_wav({"audio": {"data": message.audio.data}})
    assert rate == SAMPLE_RATE and float(abs(samples).max()) > 0
    thinker = AutoConfig.from_pretrained(server.model).thinker_config
    prompt = completion.model_extra["prompt_token_ids"]
    wanted = {"image": [thinker.image_token_id], "audio": [thinker.audio_token_id],
              "video": [thinker.video_token_id],
              "video+audio": [thinker.video_token_id, thinker.audio_token_id]}[kind]
    for token in wanted:
        assert prompt.count(token) > 0, (kind, token)
    if kind == "image":
        assert prompt.count(thinker.image_token_id) == 6  # 96 x 64 px: 6 x 4 patches, merged 2 x 2


#: (part type, format, rate): every format at a rate other than the model's 16 kHz, every
#: common rate once (Opus itself takes 8, 12, 16, 24 or 48 kHz only); one as a data URL
AUDIO_INPUTS = [("input_audio", "wav", 44100), ("input_audio", "mp3", 22050),
                ("input_audio", "flac", 48000), ("input_audio", "opus", 8000),
                ("audio_url", "mp3", 48000)]


def _audio_tokens(server, part: dict) -> tuple[int, dict]:
    """(audio placeholder tokens in the prompt, the message) of a 2-token text answer."""
    from transformers import AutoConfig

    r = server.chat(server.chat_body(
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],
        modalities=["text"], max_tokens=2, return_token_ids=True))
    assert r.status_code == 200, r.text
    audio_token = AutoConfig.from_pretrained(server.model).thinker_config.audio_token_id
    return r.json()["prompt_token_ids"].count(audio_token), r.json()["choices"][0]["message"]


@pytest.mark.parametrize("kind, fmt, rate", AUDIO_INPUTS,
                         ids=[f"{k}-{f}-{r}" for k, f, r in AUDIO_INPUTS])
def test_audio_input_at_any_rate_is_heard_as_16_khz(server, kind, fmt, rate):
    """A 1 s tone as WAV, MP3, FLAC or Ogg/Opus at 8 to 48 kHz is answered (vLLM resamples
    it to the feature extractor's 16 kHz; torchaudio was missing on the CPU install: HTTP
    500) with as many audio tokens as the same second at 16 kHz (a clip taken at its own
    rate would give rate/16 kHz times as many)."""
    from plugin_tests import media

    def part(fmt: str, data: bytes) -> dict:
        if kind == "audio_url":
            return {"type": "audio_url", "audio_url": {
                "url": media.data_url({"mp3": "audio/mpeg", "opus": "audio/ogg"}.get(
                    fmt, f"audio/{fmt}"), data)}}
        return {"type": "input_audio", "input_audio": {"data": media.b64(data), "format": fmt}}

    reference, _ = _audio_tokens(server, part("wav", media.audio_bytes("wav", 1.0, 16000)))
    tokens, message = _audio_tokens(server, part(fmt, media.audio_bytes(fmt, 1.0, rate)))
    assert reference > 0 and message["content"] is not None
    assert abs(tokens - reference) <= 1, (tokens, reference)
    print(f"audio input {kind} {fmt} {rate} Hz: 200, {tokens} audio tokens "
          f"(16 kHz WAV: {reference})")


def _bad_media_cases():
    from plugin_tests import media

    image = _media_parts()["image"][0]
    return [
        ({"type": "input_file", "file": {"file_data": "JVBERi0="}},
         "messages[0].content[0].type", "unsupported content part type 'input_file'"),
        ({"type": "image_url", "image_url": {"url": "data:application/pdf;base64,JVBERi0="}},
         "messages[0].content[0].image_url.url", "unsupported media type 'application/pdf'"),
        ({"type": "input_audio", "input_audio": {"data": media.b64(media.wav_bytes(1)),
                                                 "format": "midi"}},
         "messages[0].content[0].input_audio.format", "unsupported audio format 'midi'"),
        ({"type": "input_audio", "input_audio": {"data": media.b64(b"not a wav " * 40),
                                                 "format": "wav"}},
         "messages[0].content[0].input_audio.data", "cannot decode the audio"),
        ({"type": "image_url", "image_url": {"url": media.data_url("image/png",
                                                                   b"not a png " * 40)}},
         "messages[0].content[0].image_url.url", "cannot decode the image"),
        ([image] * (MEDIA_LIMITS["image"] + 1),
         f"messages[0].content[{MEDIA_LIMITS['image']}]", "at most 2 image item(s)"),
        # 301 s at 1 kHz (600 kB): longer than the feature extractor's chunk_length (300 s)
        ({"type": "input_audio", "input_audio": {"data": media.b64(media.wav_bytes(301, rate=1000)),
                                                 "format": "wav"}},
         "messages[0].content[0].input_audio.data", "at most 300 s per clip"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_bad_media_is_a_400_naming_the_field(server, case):
    """Unsupported part or media type, undecodable audio or image, too many items, audio
    too long: HTTP 400 whose ``param`` names the field; the next good request is served."""
    content, field, fragment = _bad_media_cases()[case]
    content = content if isinstance(content, list) else [content]
    r = server.chat(server.audio_body(messages=[{"role": "user", "content": content}]))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and fragment in error["message"], error
    part, _ = _media_parts()["image"]
    ok = server.chat(server.audio_body(messages=[{"role": "user", "content": [part]}]))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["audio"]["data"]



# -- the Realtime API (/v1/realtime) through the official SDK's realtime client -----------
def _realtime(server, scenario, timeout: float = 300, **connect):
    """Run ``scenario(connection, events)`` on one realtime session of the server (the
    SDK's async client; every server event checked against the SDK's types)."""
    import asyncio

    import openai

    from plugin_tests.realtime_client import Events

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-")
        async with client.realtime.connect(model=server.model, **connect) as connection:
            events = Events(connection)
            created = await events.next()
            assert created["type"] == "session.created", created
            return await scenario(connection, events)

    return asyncio.run(asyncio.wait_for(run(), timeout))


async def _respond(connection, events, **response) -> dict:
    """``response.create``; the events up to its ``response.done``, checked for the
    order OpenAI gives them; returns ``{"events", "response", "transcript", "pcm"}``."""
    from plugin_tests.realtime_client import audio_of, kinds

    await connection.response.create(**({"response": response} if response else {}))
    got = await events.until("response.done")
    order = kinds(got)
    done = got[-1]["response"]
    assert order[0] == "response.created", order
    assert done["status"] in ("completed", "cancelled"), done
    message = [i for i in done["output"] if i["type"] == "message"]
    transcript = ""
    if message:
        for kind in ("response.output_item.added", "conversation.item.added",
                     "response.content_part.added", "response.content_part.done",
                     "response.output_item.done"):
            assert kind in order, (kind, order)
        assert order.index("response.output_item.added") < order.index(
            "response.content_part.added") < order.index("response.content_part.done")
        part = message[0]["content"][0]
        transcript = part.get("transcript") if "transcript" in part else part.get("text")
        deltas = "".join(e["delta"] for e in got if e["type"] in (
            "response.output_audio_transcript.delta", "response.output_text.delta"))
        assert deltas == transcript
    return {"events": got, "response": done, "transcript": transcript, "pcm": audio_of(got)}


def test_realtime_text_in_text_and_audio_out_over_two_turns(server):
    """A text turn answered with a spoken transcript and pcm16 audio deltas; a second
    turn's prompt holds the first turn (its input tokens exceed the first's input plus
    output); a text-only response has text deltas and no audio."""
    from plugin_tests.realtime_client import session, text_item

    async def scenario(connection, events):
        await connection.session.update(session=session(max_output_tokens=8))
        updated = await events.until("session.updated")
        assert updated[-1]["session"]["audio"]["output"]["voice"] == "ethan"
        await connection.conversation.item.create(item=text_item("Say hello"))
        added = await events.until("conversation.item.done")
        assert added[-1]["item"]["role"] == "user"
        first = await _respond(connection, events)
        await connection.conversation.item.create(item=text_item("And again, please"))
        await events.until("conversation.item.done")
        second = await _respond(connection, events, output_modalities=["text"])
        return first, second

    first, second = _realtime(server, scenario)
    done = first["response"]
    assert done["status"] == "completed" and done["output_modalities"] == ["audio"]
    assert first["transcript"] and len(first["pcm"]) > 0 and len(first["pcm"]) % 2 == 0
    assert 0 < done["usage"]["output_tokens"] <= 8
    assert second["response"]["status"] == "completed" and second["pcm"] == b""
    assert second["transcript"], second["events"]
    assert second["response"]["usage"]["input_tokens"] > \
        done["usage"]["input_tokens"] + done["usage"]["output_tokens"]


def test_realtime_speech_in_with_server_vad_is_answered(server):
    """The speech fixture streamed as 100 ms appends with server VAD: speech started and
    stopped where the speech is, the buffer committed as a user audio item, and a
    response created by itself, whose prompt holds the audio (more input tokens than a
    text turn)."""
    from plugin_tests.realtime_client import chunks, kinds, session, speech_pcm

    async def scenario(connection, events):
        await connection.session.update(session=session(turn_detection={
            "type": "server_vad", "silence_duration_ms": 500}))
        await events.until("session.updated")
        for piece in chunks(speech_pcm(before_s=0.5, after_s=1.0)):
            await connection.input_audio_buffer.append(audio=piece)
        got = await events.until("response.done")
        return got

    got = _realtime(server, scenario)
    order = kinds(got)
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "response.created", "response.done"):
        assert kind in order, (kind, order)
    assert order.index("input_audio_buffer.speech_stopped") < order.index("response.created")
    started = next(e for e in got if e["type"] == "input_audio_buffer.speech_started")
    stopped = next(e for e in got if e["type"] == "input_audio_buffer.speech_stopped")
    assert 0 <= started["audio_start_ms"] <= 600 and 3000 <= stopped["audio_end_ms"] <= 4300
    user = next(e["item"] for e in got if e["type"] == "conversation.item.added"
                and e["item"]["role"] == "user")
    assert user["content"][0]["type"] == "input_audio" and user["id"] == started["item_id"]
    done = got[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["input_tokens"] > 30, done


def test_realtime_barge_in_cancels_the_playing_response(server):
    """Speech while a response plays: ``speech_started``, the response ``cancelled``
    (``turn_detected``) with its assistant item truncated where its audio stopped (the
    audio the client got), its pipeline request stopped in the server (one more such line
    in the log); the new turn is then answered. The speech starts at the first transcript
    delta, while the talker and code2wav still have work (at the first audio delta a
    short answer may be all spoken)."""
    from plugin_tests.realtime_client import (
        RATE,
        audio_of,
        chunks,
        kinds,
        session,
        speech_pcm,
        text_item,
    )

    async def scenario(connection, events):
        await connection.session.update(session=session(
            max_output_tokens=64, turn_detection={"type": "server_vad"}))
        await events.until("session.updated")
        for piece in chunks(speech_pcm(before_s=0.3, after_s=0)[:RATE_BYTES // 5]):
            await connection.input_audio_buffer.append(audio=piece)  # silence: loads VAD
        await connection.input_audio_buffer.clear()
        await events.until("input_audio_buffer.cleared")
        await connection.conversation.item.create(item=text_item("Tell me a story"))
        # long enough to be playing still when the speech is detected (at 64 tokens it
        # was all spoken by then once in a while); the answer after keeps the session's 64
        await connection.response.create(response={"max_output_tokens": 512})
        first = await events.until("response.output_audio_transcript.delta")
        for piece in chunks(speech_pcm(before_s=0, after_s=1.0)):
            await connection.input_audio_buffer.append(audio=piece)
        cancelled = await events.until("response.done")
        after = await events.until("response.done")
        return first, cancelled, after

    def stopped() -> int:
        return len(re.findall(r"request \S+ cancelled \(client disconnected\) while at "
                              "stage", server.log()))

    before = stopped()
    barge_ins = server.metric("vllm_omni:realtime_responses_cancelled_total",
                              reason="turn_detected") or 0.0
    sessions = server.metric("vllm:websocket_connections_total") or 0.0
    first, cancelled, after = _realtime(server, scenario)
    response_id = next(e["response"]["id"] for e in first if e["type"] == "response.created")
    order = kinds(cancelled)
    done = cancelled[-1]["response"]
    assert done["id"] == response_id and done["status"] == "cancelled", done
    assert done["status_details"]["reason"] == "turn_detected"
    assert order.index("input_audio_buffer.speech_started") < len(order) - 1
    at = order.index("conversation.item.truncated")
    truncated = cancelled[at]
    played = len(audio_of(first + cancelled[:at])) // 2  # samples the client got
    assert truncated["item_id"] == done["output"][0]["id"]
    assert truncated["audio_end_ms"] == played * 1000 // RATE, (truncated, played)
    assert after[-1]["response"]["status"] == "completed"
    assert "input_audio_buffer.committed" in kinds(after)
    server.wait_until(lambda: stopped() > before, 30)
    # /metrics: the barge-in, the session (vLLM's WebSocket metrics), the turn latencies
    assert server.metric("vllm_omni:realtime_responses_cancelled_total",
                         reason="turn_detected") == barge_ins + 1
    assert server.metric("vllm:websocket_connections_total") == sessions + 1
    assert server.metric("vllm_omni:realtime_turn_latency_seconds_count") >= 1


def test_realtime_tool_call_round_trip(server):
    """A function tool named by ``tool_choice``: the response is a ``function_call`` item
    with JSON arguments; its ``function_call_output`` then goes into the next response's
    prompt."""
    from plugin_tests.realtime_client import session, text_item

    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}

    async def scenario(connection, events):
        # room for the whole call: vLLM guides it into hermes' <tool_call>{...}</tool_call>
        await connection.session.update(session=session(
            max_output_tokens=200, modalities=("text",), tools=[tool],
            tool_choice={"type": "function", "name": "get_weather"}))
        await events.until("session.updated")
        await connection.conversation.item.create(item=text_item("Weather in Paris?"))
        await events.until("conversation.item.done")
        call = await _respond(connection, events)
        item = next(i for i in call["response"]["output"] if i["type"] == "function_call")
        await connection.conversation.item.create(item={
            "type": "function_call_output", "call_id": item["call_id"],
            "output": json.dumps({"city": "Paris", "temperature_c": 21, "sky": "clear"})})
        await events.until("conversation.item.done")
        await connection.session.update(session={"type": "realtime", "tool_choice": "none"})
        await events.until("session.updated")
        answer = await _respond(connection, events)
        return call, item, answer

    call, item, answer = _realtime(server, scenario)
    assert item["name"] == "get_weather" and item["arguments"]
    json.loads(item["arguments"])  # whole JSON (the tiny model's, guided by vLLM)
    done_args = next(e for e in call["events"]
                     if e["type"] == "response.function_call_arguments.done")
    assert done_args["call_id"] == item["call_id"] and done_args["arguments"] == item["arguments"]
    first, second = call["response"]["usage"], answer["response"]["usage"]
    assert answer["response"]["status"] == "completed"
    assert second["input_tokens"] > first["input_tokens"] + first["output_tokens"]


def test_realtime_conversation_over_the_context_drops_its_oldest_items(server):
    """Three long user turns (about 800 tokens each) over the server's 2048-token
    context: the response drops the oldest item (``conversation.item.deleted``, logged)
    and answers from the two left."""
    from plugin_tests.realtime_client import session, text_item

    async def scenario(connection, events):
        await connection.session.update(session=session(modalities=("text",)))
        await events.until("session.updated")
        ids = []
        for i in range(3):
            # about 800 tokens each: the tiny checkpoint's tokenizer makes "word " 4
            await connection.conversation.item.create(item=text_item(f"{i} " + "word " * 200))
            ids.append((await events.until("conversation.item.done"))[-1]["item"]["id"])
        answer = await _respond(connection, events)
        return ids, answer

    ids, answer = _realtime(server, scenario)
    deleted = [e["item_id"] for e in answer["events"] if e["type"] == "conversation.item.deleted"]
    assert deleted == ids[:1], deleted
    assert answer["response"]["status"] == "completed"
    assert 1600 < answer["response"]["usage"]["input_tokens"] <= 2048
    assert f"its oldest item ({ids[0]}, user) is dropped" in server.log()


@pytest.mark.parametrize("send, param, code", [
    ("not json", None, "invalid_json"),
    ({"type": "session.dance"}, "type", "invalid_event"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "format": {"type": "audio/pcmu"}}}}}, "session.audio.input.format.type",
     "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000}}}}},
     "session.audio.input.format.rate", "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"output": {
        "voice": "nobody"}}}}, "session.audio.output.voice", "invalid_value"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()},
     "audio", "invalid_value"),
    ({"type": "input_audio_buffer.commit"}, None, "input_audio_buffer_commit_empty"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_image"}]}},
     "item.content[0].type", "invalid_value"),
    ({"type": "response.cancel"}, None, "response_cancel_not_active"),
    ("x" * (15 * 1024 * 1024 + 1), None, "event_too_large"),
], ids=["malformed", "unknown-type", "format", "rate", "voice", "odd-bytes", "empty-commit",
        "content-type", "cancel-idle", "oversize"])
def test_realtime_bad_event_is_an_error_naming_the_field_and_the_session_lives(
        server, send, param, code):
    async def scenario(connection, events):
        await connection.send_raw(send if isinstance(send, str) else json.dumps(send))
        error = (await events.until("error"))[-1]["error"]
        await connection.session.update(session={"type": "realtime", "instructions": "ok"})
        updated = await events.until("session.updated")
        return error, updated[-1]

    error, updated = _realtime(server, scenario)
    assert error["param"] == param and error["code"] == code, error
    assert updated["session"]["instructions"] == "ok"


def test_realtime_session_limit_and_idle_timeout(server):
    """One session more than --omni-realtime-max-sessions gets an error event and close
    code 1013, and one fits again once a session closed; a session that sends nothing for
    --omni-realtime-idle-timeout seconds is told so and closed (code 1000)."""
    import asyncio
    import time

    import openai
    from websockets.exceptions import ConnectionClosed

    from plugin_tests.realtime_client import Events

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-")
        managers = [client.realtime.connect(model=server.model, max_retries=0)
                    for _ in range(REALTIME_SESSIONS + 1)]
        connections = [await m.__aenter__() for m in managers]
        firsts = [await Events(c).next() for c in connections]
        refused = firsts[-1]
        try:
            await asyncio.wait_for(connections[-1].recv_bytes(), 30)
            closed = None
        except ConnectionClosed as exc:
            closed = exc
        await managers[0].__aexit__(None, None, None)
        deadline = time.monotonic() + 30
        while True:  # until the server has seen the first session go
            started = time.monotonic()
            again = await client.realtime.connect(model=server.model,
                                                  max_retries=0).__aenter__()
            created = await Events(again).next()
            if created["type"] == "session.created" or time.monotonic() > deadline:
                break
            await again.close()
            await asyncio.sleep(0.2)
        idle = await Events(again).next(timeout=REALTIME_IDLE_S + 10)
        waited = time.monotonic() - started
        for manager in managers[1:]:
            await manager.__aexit__(None, None, None)
        return firsts, refused, closed, created, idle, waited

    firsts, refused, closed, created, idle, waited = asyncio.run(run())
    assert [e["type"] for e in firsts[:-1]] == ["session.created"] * REALTIME_SESSIONS
    assert refused["type"] == "error" and refused["error"]["code"] == "session_limit_reached"
    assert closed is not None and closed.rcvd.code == 1013, closed
    assert created["type"] == "session.created"
    assert idle["type"] == "error" and idle["error"]["code"] == "idle_timeout"
    assert REALTIME_IDLE_S - 1 <= waited <= REALTIME_IDLE_S + 10


def test_realtime_client_gone_mid_response_frees_every_stage(server):
    """A client that closes the socket while a response plays: the pipeline request is
    stopped at once (logged), and no payload file or admission slot is left."""
    import glob
    import sys
    import time
    from pathlib import Path

    from plugin_tests.realtime_client import session, text_item

    async def scenario(connection, events):
        await connection.session.update(session=session(max_output_tokens=64))
        await events.until("session.updated")
        await connection.conversation.item.create(item=text_item("Tell me a story"))
        await connection.response.create()
        # the first transcript delta: the thinker has begun and the talker and code2wav
        # are still to run (at the first audio delta a short answer may be all spoken)
        await events.until("response.output_audio_transcript.delta")

    before = server.log().count("cancelled (client disconnected)")
    _realtime(server, scenario)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from soak_bench import payload_files

    (run_dir,) = glob.glob(f"/dev/shm/vllm-omni-plugin-{server.proc.pid}-*")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        in_flight = [v for (name, _), v in server.metrics().items()
                     if name == "vllm_omni:stage_requests_in_flight"]
        if server.log().count("cancelled (client disconnected)") > before and \
                payload_files(Path(run_dir)) == 0 and not any(in_flight):
            break
        time.sleep(0.2)
    assert server.log().count("cancelled (client disconnected)") > before
    assert payload_files(Path(run_dir)) == 0
    assert not any(in_flight), in_flight


# -- stalled stages (the module's last tests: each restarts a stage) -------------------
@pytest.mark.parametrize("stage,name", [(1, "talker"), (2, "code2wav")])
def test_a_stalled_stage_is_restarted_and_its_request_answered(server, stage, name):
    """SIGSTOP of the stage's EngineCore (a hung kernel, as the head sees it) with an
    audio chat at the stage: see :func:`check_stall_recovery`. The stage's one replica is
    restarting when the request is resubmitted, and this server waits 3 s for a replica:
    the answer is a 503 naming the stage and the stall. No earlier test of the module
    counted a stall (a long step is not one)."""
    answer = check_stall_recovery(server, stage, name, STALL_S,
                                  lambda: server.chat(server.audio_body()))
    assert answer.status_code == 503
