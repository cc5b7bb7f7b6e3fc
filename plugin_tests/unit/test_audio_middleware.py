"""The API middleware: its answer when vLLM's handler raises for a request the orchestrator
already failed (the recorded status and message; vLLM would answer every exception with
500), the audio of streamed chat completions, and the ``audio`` field's checks. The app
is a scripted ASGI callable standing in for vLLM's FastAPI app (the real server is in
``plugin_tests/e2e/test_e2e_serve.py``)."""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_omni_plugin.engine.omni_request import StageResult, current_omni_request
from vllm_omni_plugin.entrypoints.audio_encoding import AUDIO_FORMATS, encode_audio
from vllm_omni_plugin.entrypoints.chat_audio import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    parse_audio_request,
)
from vllm_omni_plugin.entrypoints.media_input import RequestError
from vllm_omni_plugin.entrypoints.middleware import VOICES_PATH
from vllm_omni_plugin.entrypoints.middleware import OmniApiMiddleware as OmniAudioMiddleware
from vllm_omni_plugin.entrypoints.speech import (
    SPEECH_PATH,
    parse_speech_request,
    speech_chat_body,
)

COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2}
STREAMED_AUDIO_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "modalities": ["text", "audio"], "stream": True}


def _call(app, path=COMPLETIONS_PATH, request=COMPLETION, raw: bytes | None = None
          ) -> list[dict]:
    """What the middleware in front of ``app`` sends for ``request`` (or the bytes
    ``raw``) POSTed to ``path``."""
    sent: list[dict] = []
    body = raw if raw is not None else json.dumps(request).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", b"application/json")]}
    asyncio.run(OmniAudioMiddleware(app)(scope, receive, send))
    return sent


def test_recorded_failure_answers_with_its_status_when_vllm_raises():
    async def app(scope, receive, send):
        await receive()
        current_omni_request().result = StageResult.failure("stage 3 (p): no KV cache", 503)
        raise RuntimeError("stage 3 (p): no KV cache")

    start, body = _call(app)
    assert start["status"] == 503
    error = json.loads(body["body"])["error"]
    assert error["message"] == "stage 3 (p): no KV cache" and error["code"] == 503


def test_other_exceptions_reach_vllm_unchanged():
    async def app(scope, receive, send):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _call(app)


# -- text: vLLM's answer as it comes -----------------------------------------------------
TEXT_CHAT = b'{"model":"m",  "messages":[{"role":"user","content":"hi"}], "max_tokens":2}'


def _text_app(received: list, failure: StageResult | None = None):
    """vLLM's answer in two body messages (its own headers); ``failure`` is recorded
    before the answer starts."""
    async def app(scope, receive, send):
        received.append((await receive())["body"])
        if failure is not None:
            current_omni_request().result = failure
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", b"9")]})
        await send({"type": "http.response.body", "body": b'{"a":', "more_body": True})
        await send({"type": "http.response.body", "body": b"1}", "more_body": False})
    return app


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
def test_a_text_request_reaches_vllm_as_sent_and_its_answer_passes_through(path):
    """No second encoding of the body, no buffering of the answer: vLLM gets the client's
    bytes and the client vLLM's messages, one by one, headers untouched."""
    received: list[bytes] = []
    sent = _call(_text_app(received), path, raw=TEXT_CHAT)
    assert received == [TEXT_CHAT]
    assert [m.get("body") for m in sent] == [None, b'{"a":', b"1}"]
    assert sent[0]["headers"][1] == (b"content-length", b"9")


def test_a_failure_recorded_before_a_text_answer_starts_answers_instead():
    failure = StageResult.failure("stage 0 (thinker): RuntimeError: model broke", 500)
    sent = _call(_text_app([], failure), CHAT_PATH, raw=TEXT_CHAT)
    assert sent[0]["status"] == 500 and len(sent) == 2
    error = json.loads(sent[1]["body"])["error"]
    assert error["message"] == "stage 0 (thinker): RuntimeError: model broke"


# -- streamed chat with audio ------------------------------------------------------------
WAVEFORM = torch.linspace(-0.5, 0.5, 480)
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def _chunk(delta, finish=None) -> bytes:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
             "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _streaming_app(result: StageResult, fail_early=False, last=None):
    """vLLM's SSE sequence; the orchestrator's result lands before the finish chunk (or,
    with ``fail_early``, before any output); ``last``: the finish chunk's own text."""
    async def app(scope, receive, send):
        await receive()
        if fail_early:
            current_omni_request().result = result
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        if not fail_early:
            for delta in ({"role": "assistant", "content": ""}, {"content": "Hel"},
                          {"content": "lo"}):
                await send({"type": "http.response.body", "body": _chunk(delta),
                            "more_body": True})
            current_omni_request().result = result
            await send({"type": "http.response.body", "more_body": True,
                        "body": _chunk({"content": last} if last else {}, "stop")})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})
    return app


def _events(sent) -> list:
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def test_streamed_audio_goes_out_before_the_finish_chunk():
    result = StageResult(output_type="audio", payload={"waveform": WAVEFORM},
                         sample_rate=24000)
    sent = _call(_streaming_app(result), CHAT_PATH, STREAMED_AUDIO_CHAT)
    assert sent[0]["status"] == 200
    events = _events(sent)
    assert [e if isinstance(e, str) else e["choices"][0]["finish_reason"]
            for e in events] == [None, None, None, None, "stop", "[DONE]"]
    chunk = events[3]
    assert (chunk["id"], chunk["model"], chunk["object"]) == (
        "chatcmpl-1", "m", "chat.completion.chunk")
    audio = chunk["choices"][0]["delta"]["audio"]
    assert audio["transcript"] == "Hello"
    assert audio["id"].startswith("audio_") and audio["expires_at"] > 0
    pcm = base64.b64decode(audio["data"])
    assert pcm == encode_audio(WAVEFORM.numpy(), 24000, "pcm16")
    assert len(np.frombuffer(pcm, "<i2")) == len(WAVEFORM)


def test_streamed_chunks_go_out_as_they_come_and_the_rest_before_the_finish_chunk():
    """Two chunks of a streamed final stage reach the client while vLLM's stream waits
    for the last stage; the waveform's remaining samples go out before the finish chunk;
    the deltas' PCM joined is the whole waveform's."""
    pieces = WAVEFORM.split([100, 200, 180])
    result = StageResult(output_type="audio", payload={"waveform": WAVEFORM},
                         sample_rate=24000)

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        for delta in ({"role": "assistant", "content": ""}, {"content": "Hel"},
                      {"content": "lo"}):
            await send({"type": "http.response.body", "body": _chunk(delta),
                        "more_body": True})
        partials = current_omni_request().partials
        for piece in pieces[:2]:
            partials.put_nowait({"waveform": piece, "sample_rate": torch.tensor([24000])})
        await partials.join()  # both sent by the middleware meanwhile
        current_omni_request().result = result
        await send({"type": "http.response.body", "more_body": True,
                    "body": _chunk({"content": "!"}, "stop")})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})

    events = _events(_call(app, CHAT_PATH, STREAMED_AUDIO_CHAT))
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    assert [d.get("content") for d in deltas] == ["Hel", "lo", None, None, "!", None, None]
    audio = [deltas[i]["audio"] for i in (2, 3, 5)]
    assert [a["transcript"] for a in audio] == ["Hello", "", "!"]
    assert len({a["id"] for a in audio}) == 1
    assert [("expires_at" in a) for a in audio] == [False, False, True]
    assert [len(base64.b64decode(a["data"])) // 2 for a in audio] == [100, 200, 180]
    assert b"".join(base64.b64decode(a["data"]) for a in audio) == encode_audio(
        WAVEFORM.numpy(), 24000, "pcm16")
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_text_of_the_finish_chunk_goes_out_before_the_audio():
    result = StageResult(output_type="audio", payload={"waveform": WAVEFORM},
                         sample_rate=24000)
    events = _events(_call(_streaming_app(result, last="!"), CHAT_PATH, STREAMED_AUDIO_CHAT))
    deltas = [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"])
              for e in events[1:-1]]
    assert [d.get("content") for d, _ in deltas] == ["Hel", "lo", "!", None, None]
    assert [f for _, f in deltas] == [None, None, None, None, "stop"]
    assert deltas[3][0]["audio"]["transcript"] == "Hello!"
    assert deltas[4][0] == {}


def test_stream_failure_before_any_output_answers_with_its_status():
    failure = StageResult.failure("stage 1 (talker): full", 429, retry_after=2.0)
    sent = _call(_streaming_app(failure, fail_early=True), CHAT_PATH, STREAMED_AUDIO_CHAT)
    start, body = sent
    assert start["status"] == 429
    assert (b"retry-after", b"2") in start["headers"]
    assert json.loads(body["body"])["error"]["message"] == "stage 1 (talker): full"


def test_stream_failure_after_text_is_an_error_event():
    failure = StageResult.failure("stage 2 (code2wav): boom", 500)
    events = _events(_call(_streaming_app(failure), CHAT_PATH, STREAMED_AUDIO_CHAT))
    assert events[3] == {"error": {"message": "stage 2 (code2wav): boom",
                                   "type": "InternalServerError", "param": None,
                                   "code": 500}}
    assert events[4]["choices"][0]["finish_reason"] == "stop"


def test_vllm_errors_in_a_stream_pass_through():
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 400,
                     "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {}}'})

    start, body = _call(app, CHAT_PATH, STREAMED_AUDIO_CHAT)
    assert start["status"] == 400 and body["body"] == b'{"error": {}}'


# -- the audio field -----------------------------------------------------------------
@pytest.mark.parametrize("stream, audio, fmt", [
    (False, None, "wav"), (True, None, "pcm16"), (False, {"format": "opus"}, "opus"),
    (True, {"format": "pcm16", "voice": "ethan"}, "pcm16")])
def test_audio_format_defaults_and_choices(stream, audio, fmt):
    body = {"modalities": ["text", "audio"], "stream": stream,
            **({"audio": audio} if audio else {})}
    assert parse_audio_request(body).format == fmt
    assert "audio" not in body and "modalities" not in body


@pytest.mark.parametrize("stream, fmt, says", [
    (False, "aac", "'aac' is not supported; use one of wav, pcm16, flac, mp3, opus"),
    (True, "wav", "streamed audio is 'pcm16' only"),
    (False, 16, "'int' is not supported"),
    # a JSON object or array (unhashable): a 400 too, not a TypeError (an HTTP 500)
    (False, {"a": 1}, "'dict' is not supported"), (True, ["pcm16"], "'list' is not supported")])
def test_bad_audio_format_names_the_field(stream, fmt, says):
    body = {"modalities": ["text", "audio"], "stream": stream, "audio": {"format": fmt}}
    with pytest.raises(RequestError, match="audio.format") as info:
        parse_audio_request(body)
    assert says in str(info.value)


# -- /v1/audio/speech and /v1/audio/voices ------------------------------------------------
SPEECH = {"model": "m", "input": "Hello there.", "voice": "ethan"}


@pytest.mark.parametrize("change, field", [
    ({"input": ""}, "input"), ({"input": "x" * 4097}, "input"), ({"model": None}, "model"),
    ({"response_format": "aac"}, "response_format"), ({"stream_format": "chunks"},
                                                       "stream_format"),
    ({"speed": 1.5}, "speed"), ({"voice": ""}, "voice"), ({"instructions": 3}, "instructions"),
    ({"response_format": {"a": 1}}, "response_format"), ({"stream_format": ["sse"]},
                                                         "stream_format")])
def test_bad_speech_request_names_the_field(change, field):
    with pytest.raises(RequestError) as info:
        parse_speech_request({**SPEECH, **change}, 64)
    assert info.value.field == field


def test_speech_becomes_an_open_assistant_turn_spoken_in_the_asked_format():
    speech = parse_speech_request({**SPEECH, "response_format": "pcm"}, 64)
    body = speech_chat_body(speech)
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello there."}
    assert body["continue_final_message"] and not body["add_generation_prompt"]
    assert body["audio"] == {"format": "pcm16", "voice": "ethan"}
    assert parse_speech_request({"model": "m", "input": "hi"}, 64).format == "mp3"


def _with_voices(scope_path, method="GET", body=None, app=None):
    """Run the middleware with an app state whose checkpoint has two voices."""
    hf_config = SimpleNamespace(talker_config=SimpleNamespace(speaker_id={"Ethan": 2302,
                                                                          "Chelsie": 2301}))
    state = SimpleNamespace(vllm_config=SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config)))
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body or {}).encode(),
                "more_body": False}

    async def send(message):
        sent.append(message)

    async def no_app(scope, receive, send):
        raise AssertionError("vLLM must not see this request")

    scope = {"type": "http", "method": method, "path": scope_path,
             "headers": [(b"content-type", b"application/json")],
             "app": SimpleNamespace(state=state)}
    asyncio.run(OmniAudioMiddleware(app or no_app)(scope, receive, send))
    return sent


def test_voices_lists_the_checkpoint_speakers():
    start, body = _with_voices(VOICES_PATH)
    assert start["status"] == 200
    assert json.loads(body["body"]) == {"object": "list", "default": "ethan", "data": [
        {"id": "Chelsie", "object": "voice"}, {"id": "Ethan", "object": "voice"}]}


@pytest.mark.parametrize("path, body, field", [
    (SPEECH_PATH, {**SPEECH, "voice": "alloy"}, "voice"),
    (CHAT_PATH, {**STREAMED_AUDIO_CHAT, "audio": {"voice": "alloy"}}, "audio.voice")])
def test_unknown_voice_is_refused_before_any_stage_runs(path, body, field):
    start, answer = _with_voices(path, "POST", body)
    assert start["status"] == 400
    error = json.loads(answer["body"])["error"]
    assert error["param"] == field
    assert "'alloy'" in error["message"] and "Chelsie, Ethan" in error["message"]


def _speech_app(result: StageResult, pieces=(), seen: list | None = None):
    """The chat behind a speech request: ``pieces`` come as chunks of a streamed final
    stage (each sent by the middleware before the next), then ``result``; ``seen``
    collects the path and body the chat got."""
    async def chat_app(scope, receive, send):
        body = json.loads((await receive())["body"])
        if seen is not None:
            seen.append((scope["path"], body))
        partials = current_omni_request().partials
        for piece in pieces:
            partials.put_nowait({"waveform": piece, "sample_rate": torch.tensor([24000])})
            await partials.join()
        current_omni_request().result = result
        answer = json.dumps({"choices": [{"message": {"content": "."}}],
                             "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                       "total_tokens": 10}}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})
    return chat_app


@pytest.mark.parametrize("fmt", sorted(AUDIO_FORMATS))
def test_an_answer_without_speech_encodes_to_a_readable_file(fmt):
    """0 samples (a reply too short to speak): WAV and pcm16 hold none; libsndfile writes
    no readable FLAC, MP3 or Ogg of 0 frames, so those hold one silent sample."""
    import io

    import soundfile as sf

    encoded = encode_audio(np.zeros(0), 24000, fmt)
    if fmt == "pcm16":
        assert encoded == b""
        return
    samples, rate = sf.read(io.BytesIO(encoded), dtype="float32")
    assert rate == 24000 and len(samples) == (0 if fmt == "wav" else 1)
    assert np.abs(samples).max(initial=0.0) < 1e-4  # silence (Opus is lossy)


def test_speech_answers_the_encoded_audio_or_events():
    result = StageResult(output_type="audio", payload={"waveform": WAVEFORM},
                         sample_rate=24000)
    seen = []
    chat_app = _speech_app(result, seen=seen)

    start, body = _with_voices(SPEECH_PATH, "POST", {**SPEECH, "response_format": "wav"},
                               chat_app)
    assert seen[0][0] == CHAT_PATH and seen[0][1]["continue_final_message"]
    assert (b"content-type", b"audio/wav") in start["headers"]
    assert body["body"] == encode_audio(WAVEFORM.numpy(), 24000, "wav")
    start, body = _with_voices(SPEECH_PATH, "POST", {**SPEECH, "stream_format": "sse"},
                               chat_app)
    assert (b"content-type", b"text/event-stream") in start["headers"]
    delta, done = _events([body])
    assert delta["type"] == "speech.audio.delta"
    assert base64.b64decode(delta["audio"]) == encode_audio(WAVEFORM.numpy(), 24000, "mp3")
    assert done == {"type": "speech.audio.done",
                    "usage": {"input_tokens": 9, "output_tokens": 1, "total_tokens": 10}}


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_pcm_speech_goes_out_chunk_by_chunk(stream_format):
    pieces = WAVEFORM.split([100, 200, 180])
    result = StageResult(output_type="audio", payload={"waveform": WAVEFORM},
                         sample_rate=24000)
    start, *bodies = _with_voices(
        SPEECH_PATH, "POST", {**SPEECH, "response_format": "pcm",
                              "stream_format": stream_format},
        _speech_app(result, pieces[:2]))
    assert start["status"] == 200
    assert not any(k == b"content-length" for k, _ in start["headers"])
    assert [b["more_body"] for b in bodies] == [True, True, False]
    whole = encode_audio(WAVEFORM.numpy(), 24000, "pcm16")
    if stream_format == "audio":
        assert (b"content-type", b"audio/pcm") in start["headers"]
        assert [len(b["body"]) // 2 for b in bodies] == [100, 200, 180]
        assert b"".join(b["body"] for b in bodies) == whole
    else:
        events = _events(bodies)
        assert [e["type"] for e in events] == ["speech.audio.delta"] * 3 + [
            "speech.audio.done"]
        assert b"".join(base64.b64decode(e["audio"]) for e in events[:3]) == whole
        assert events[3]["usage"]["total_tokens"] == 10


def test_streamed_speech_failing_after_a_chunk_ends_with_an_error_event():
    failure = StageResult.failure("stage 2 (code2wav): boom", 500)
    start, *bodies = _with_voices(
        SPEECH_PATH, "POST", {**SPEECH, "response_format": "pcm", "stream_format": "sse"},
        _speech_app(failure, WAVEFORM.split([100, 380])[:1]))
    assert start["status"] == 200
    events = _events(bodies)
    assert events[0]["type"] == "speech.audio.delta"
    assert events[1] == {"type": "error", "error": {
        "message": "stage 2 (code2wav): boom", "type": "InternalServerError",
        "param": None, "code": 500}}
