"""The Realtime API session (``entrypoints/realtime/``) over a scripted WebSocket and
a scripted chat serving standing in for vLLM's (the real server: the realtime tests in
``e2e/test_e2e_serve.py``). Every server event is checked against the ``openai`` SDK's
``RealtimeServerEvent`` types."""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_omni_plugin.engine.omni_request import StageResult, current_omni_request
from vllm_omni_plugin.entrypoints.middleware import OmniApiMiddleware
from vllm_omni_plugin.entrypoints.realtime import REALTIME_PATH

PIECES = [torch.full((480,), 0.25), torch.full((960,), -0.5)]
WHOLE = torch.cat([*PIECES, torch.full((240,), 0.125)])


def _chunk(content, finish=None) -> str:
    """One SSE event of vLLM's stream: a ``chat.completion.chunk`` with ``content``."""
    return "data: " + json.dumps({
        "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": content},
                     "finish_reason": finish}]}) + "\n\n"


class _ScriptedChat:
    """vLLM's chat serving (``create_chat_completion``), scripted: the real one needs an
    engine (it runs in the realtime tests of ``e2e/test_e2e_serve.py``). A streamed chat
    with audio: text "Hel", two streamed pieces of speech, text "lo" (held until
    ``hold`` is set, when given), then the whole waveform as the result. ``seen``
    collects each request's ``(ChatCompletionRequest, voice, modalities)``;
    ``cancelled`` gets True when the stream is cancelled. The first ``refuse`` requests
    are refused as vLLM's renderer refuses a prompt over the model's context."""

    def __init__(self, seen: list, hold: asyncio.Event | None = None,
                 cancelled: list | None = None, refuse: int = 0) -> None:
        self.seen, self.hold, self.cancelled, self.refuse = seen, hold, cancelled, refuse

    @staticmethod
    def create_error_response(exc):
        from vllm.entrypoints.serve.engine.serving import BaseServing

        return BaseServing.create_error_response(exc)

    async def create_chat_completion(self, request, raw_request):
        from vllm.exceptions import VLLMValidationError

        omni = current_omni_request()
        self.seen.append((request, omni.voice, omni.modalities))
        if len(self.seen) <= self.refuse:
            raise VLLMValidationError("This model's maximum context length is 2048 tokens.",
                                      parameter="input_tokens", value=2049)
        return self._events(omni)

    async def _events(self, omni):
        try:
            yield _chunk("Hel")
            for piece in PIECES:
                omni.partials.put_nowait({"waveform": piece,
                                          "sample_rate": torch.tensor([24000])})
                await asyncio.sleep(0)
            if self.hold is not None:
                await self.hold.wait()
            omni.result = StageResult(output_type="audio", payload={"waveform": WHOLE},
                                      sample_rate=24000)
            yield _chunk("lo", "stop")
            yield "data: " + json.dumps({
                "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                         "total_tokens": 9}}) + "\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            if self.cancelled is not None:
                self.cancelled.append(True)
            raise


async def _no_http(scope, receive, send):
    raise AssertionError(f"a realtime session made an HTTP request to {scope.get('path')}")


class _Client:
    """The client side of one scripted WebSocket to the middleware."""

    def __init__(self, serving: _ScriptedChat, additional_config: dict | None = None) -> None:
        from openai.types.realtime import RealtimeServerEvent
        from pydantic import TypeAdapter

        self.incoming: asyncio.Queue = asyncio.Queue()
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.incoming.put_nowait({"type": "websocket.connect"})
        self.closed = None
        self._adapter = TypeAdapter(RealtimeServerEvent)
        hf_config = SimpleNamespace(talker_config=SimpleNamespace(
            speaker_id={"Ethan": 2302, "Chelsie": 2301}))
        state = SimpleNamespace(vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(hf_config=hf_config),
            additional_config=additional_config or {}), openai_serving_chat=serving)
        scope = {"type": "websocket", "path": REALTIME_PATH, "query_string": b"model=m",
                 "headers": [], "scheme": "ws", "server": ("127.0.0.1", 8000),
                 "client": ("127.0.0.1", 5555), "subprotocols": [],
                 "app": SimpleNamespace(state=state)}
        self.task = asyncio.ensure_future(OmniApiMiddleware(_no_http)(
            scope, self.incoming.get, self.outgoing.put))

    def send(self, event: dict) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(event)})

    async def next(self) -> dict:
        while True:
            message = await asyncio.wait_for(self.outgoing.get(), 30)
            if message["type"] == "websocket.close":
                self.closed = message
                raise ConnectionError(message)
            if message["type"] == "websocket.send":
                event = json.loads(message["text"])
                self._adapter.validate_python(event)
                return event

    async def until(self, kind: str) -> list[dict]:
        got = []
        while not got or got[-1]["type"] != kind:
            got.append(await self.next())
        return got

    async def close(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
        await asyncio.wait_for(self.task, 30)


def _user_text(client: _Client) -> None:
    client.send({"type": "session.update", "session": {"type": "realtime",
                                                        "max_output_tokens": 8}})
    client.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})


def test_a_response_streams_transcript_and_audio_in_openais_order():
    """Transcript deltas, then each streamed piece of speech as an audio delta as it
    comes, the rest of the waveform before the end; the chat body holds the
    conversation and asks for pcm16 speech in the session's voice."""
    seen: list = []

    async def run():
        client = _Client(_ScriptedChat(seen))
        assert (await client.next())["type"] == "session.created"
        _user_text(client)
        await client.until("conversation.item.done")
        client.send({"type": "response.create"})
        events = await client.until("response.done")
        await client.close()
        return events

    events = asyncio.run(run())
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.output_item.added",
                         "conversation.item.added", "response.content_part.added"]
    assert kinds[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done",
                          "conversation.item.done", "response.done"]
    pcm = b"".join(base64.b64decode(e["delta"]) for e in events
                   if e["type"] == "response.output_audio.delta")
    samples = np.frombuffer(pcm, "<i2")
    assert len(samples) == WHOLE.shape[0]
    assert abs(int(samples[0]) - 8192) <= 1 and abs(int(samples[-1]) - 4096) <= 1
    transcript = "".join(e["delta"] for e in events
                         if e["type"] == "response.output_audio_transcript.delta")
    done = events[-1]["response"]
    assert transcript == "Hello" == done["output"][0]["content"][0]["transcript"]
    assert done["status"] == "completed" and done["usage"]["input_tokens"] == 7
    ((request, voice, modalities),) = seen
    assert request.messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert request.max_completion_tokens == 8 and request.stream is True
    assert voice == "ethan" and modalities == ("text", "audio")


def _metric(name: str, **labels: str) -> float:
    """A sample of ``prometheus_client``'s default registry (what vLLM's ``/metrics``
    serves); 0 when it has none yet."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_session_is_metered_and_its_turn_latency_observed():
    """vLLM's WebSocket metrics count the session (open while it runs, once in the total,
    its duration), and the response's first audio delta observes one turn latency."""
    before = {name: _metric(name) for name in (
        "vllm:websocket_connections_total", "vllm:websocket_connections_active",
        "vllm:websocket_connection_duration_seconds_count",
        "vllm_omni:realtime_turn_latency_seconds_count")}

    async def run():
        client = _Client(_ScriptedChat([]))
        await client.next()
        active = _metric("vllm:websocket_connections_active")
        _user_text(client)
        await client.until("conversation.item.done")
        client.send({"type": "response.create"})
        await client.until("response.done")
        await client.close()
        return active

    active = asyncio.run(run())
    assert active == before["vllm:websocket_connections_active"] + 1
    after = {name: _metric(name) - value for name, value in before.items()}
    assert after == {"vllm:websocket_connections_total": 1,
                     "vllm:websocket_connections_active": 0,
                     "vllm:websocket_connection_duration_seconds_count": 1,
                     "vllm_omni:realtime_turn_latency_seconds_count": 1}


def test_speech_over_a_playing_answer_cancels_it_as_a_barge_in():
    """Server VAD on, an answer playing (held after its first audio): the user's speech
    cancels it (``turn_detected``, its chat handler cancelled, counted as a barge-in in
    ``vllm_omni:realtime_responses_cancelled_total``); the speech, once over, is
    committed and answered."""
    from plugin_tests.realtime_client import chunks, speech_pcm

    cancelled: list = []
    before = _metric("vllm_omni:realtime_responses_cancelled_total", reason="turn_detected")

    async def run():
        hold = asyncio.Event()
        client = _Client(_ScriptedChat([], hold, cancelled))
        await client.next()
        client.send({"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"turn_detection": {"type": "server_vad"}}}}})
        await client.until("session.updated")
        client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "hi"}]}})
        await client.until("conversation.item.done")
        client.send({"type": "response.create"})
        await client.until("response.output_audio.delta")
        for piece in chunks(speech_pcm(before_s=0, after_s=1.0)):
            client.send({"type": "input_audio_buffer.append", "audio": piece})
        barged = await client.until("response.done")
        hold.set()
        answered = await client.until("response.done")
        await client.close()
        return barged, answered

    barged, answered = asyncio.run(run())
    done = barged[-1]["response"]
    assert done["status"] == "cancelled", done
    assert done["status_details"]["reason"] == "turn_detected" and cancelled == [True]
    assert "input_audio_buffer.speech_started" in [e["type"] for e in barged]
    assert "input_audio_buffer.committed" in [e["type"] for e in answered]
    assert answered[-1]["response"]["status"] == "completed"
    assert _metric("vllm_omni:realtime_responses_cancelled_total",
                   reason="turn_detected") == before + 1


def test_response_cancel_stops_the_chat_and_reports_cancelled():
    """``response.cancel`` while the answer plays: the chat's handler is cancelled (the
    pipeline request with it), the item is left incomplete and ``response.done`` says
    ``cancelled`` (counted by reason); the next response runs."""
    seen: list = []
    cancelled: list = []
    before = _metric("vllm_omni:realtime_responses_cancelled_total",
                     reason="client_cancelled")

    async def run():
        hold = asyncio.Event()
        client = _Client(_ScriptedChat(seen, hold, cancelled))
        await client.next()
        _user_text(client)
        await client.until("conversation.item.done")
        client.send({"type": "response.create"})
        await client.until("response.output_audio.delta")
        client.send({"type": "response.cancel"})
        events = await client.until("response.done")
        hold.set()
        client.send({"type": "response.create"})
        again = await client.until("response.done")
        await client.close()
        return events, again

    events, again = asyncio.run(run())
    done = events[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == \
        "client_cancelled"
    assert done["output"][0]["status"] == "incomplete" and cancelled == [True]
    assert _metric("vllm_omni:realtime_responses_cancelled_total",
                   reason="client_cancelled") == before + 1
    assert again[-1]["response"]["status"] == "completed"
    # the second response's prompt holds the first, cut short, answer
    assert seen[1][0].messages[-1] == {"role": "assistant", "content": "Hel"}


def test_a_conversation_over_the_context_drops_its_oldest_items_until_it_fits():
    """vLLM refuses the first two prompts as over the model's context (``input_tokens``):
    the two oldest items are dropped (``conversation.item.deleted``) and the third prompt,
    the newest item alone, is answered."""
    seen: list = []

    async def run():
        client = _Client(_ScriptedChat(seen, refuse=2))
        await client.next()
        ids = []
        for text in ("one", "two", "three"):
            client.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]}})
            ids.append((await client.until("conversation.item.done"))[-1]["item"]["id"])
        client.send({"type": "response.create"})
        events = await client.until("response.done")
        await client.close()
        return ids, events

    ids, events = asyncio.run(run())
    assert [e["item_id"] for e in events if e["type"] == "conversation.item.deleted"] == \
        ids[:2]
    assert events[-1]["response"]["status"] == "completed"
    assert [len(request.messages) for request, _, _ in seen] == [3, 2, 1]


def test_an_assistant_text_part_comes_back_as_output_text_and_reaches_the_prompt():
    """An assistant item created with a ``text`` part (the beta API's name): reported as
    ``output_text`` (the SDK's type, which every event here is validated against), and
    in the next prompt as the assistant's turn."""
    seen: list = []

    async def run():
        client = _Client(_ScriptedChat(seen))
        await client.next()
        client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "earlier"}]}})
        added = (await client.until("conversation.item.added"))[-1]
        client.send({"type": "response.create"})
        await client.until("response.done")
        await client.close()
        return added

    added = asyncio.run(run())
    assert added["item"]["content"] == [{"type": "output_text", "text": "earlier"}]
    assert seen[0][0].messages == [{"role": "assistant", "content": "earlier"}]


@pytest.mark.parametrize("event, param", [
    ({"type": "session.update", "session": {"type": "realtime", "output_modalities":
                                            ["audio", "text"]}},
     "session.output_modalities"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "near_field_vad"}}}}},
     "session.audio.input.turn_detection.type"),
    ({"type": "session.update", "session": {"type": "realtime", "tools": [
        {"type": "mcp", "name": "x"}]}}, "session.tools[0].type"),
    ({"type": "conversation.item.create", "item": {"type": "function_call_output",
                                                   "call_id": "c"}}, "item.output"),
    ({"type": "conversation.item.delete", "item_id": "nope"}, "item_id"),
])
def test_a_refused_event_names_its_field_and_the_session_goes_on(event, param):
    async def run():
        client = _Client(_ScriptedChat([]))
        await client.next()
        client.send({**event, "event_id": "evt_1"})
        error = await client.next()
        client.send({"type": "session.update", "session": {"type": "realtime"}})
        updated = await client.next()
        await client.close()
        return error, updated

    error, updated = asyncio.run(run())
    assert error["type"] == "error" and error["error"]["param"] == param, error
    assert error["error"]["event_id"] == "evt_1"
    assert updated["type"] == "session.updated"


def _append(client: _Client, seconds: float) -> None:
    """Append ``seconds`` of silence (pcm16 at 24 kHz)."""
    pcm = bytes(2 * round(24000 * seconds))
    client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})


def _limited(seconds: float) -> dict:
    from vllm_omni_plugin.config.settings import OmniSettings, RealtimeSettings

    return OmniSettings(stage_configs_path="/p.yaml", realtime=RealtimeSettings(
        max_input_audio=seconds)).additional_config()


def test_an_append_past_the_input_audio_limit_is_refused_and_the_buffer_kept():
    """--omni-realtime-max-input-audio 1: 0.8 s fit, 0.4 s more are refused naming the
    buffer and its limit; the 0.8 s are still there to commit (800 ms)."""
    async def run():
        client = _Client(_ScriptedChat([]), _limited(1.0))
        await client.next()
        client.send({"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"turn_detection": None}}}})
        await client.next()
        _append(client, 0.8)
        _append(client, 0.4)
        error = await client.next()
        client.send({"type": "input_audio_buffer.commit"})
        committed = await client.next()
        client.send({"type": "input_audio_buffer.clear"})
        await client.until("input_audio_buffer.cleared")
        _append(client, 0.9)  # the cleared buffer takes audio again
        client.send({"type": "input_audio_buffer.commit"})
        again = await client.until("input_audio_buffer.committed")
        await client.close()
        return error, committed, again

    error, committed, again = asyncio.run(run())
    assert error["error"]["code"] == "input_audio_buffer_full", error
    message = error["error"]["message"]
    assert "input audio buffer holds 0.8 s" in message and "limit of 1 s" in message
    assert "--omni-realtime-max-input-audio" in message
    assert committed["type"] == "input_audio_buffer.committed"
    assert [e for e in again if e["type"] == "error"] == []


def test_with_server_vad_silence_does_not_fill_the_input_audio_buffer():
    """An open microphone: 3 s of silence with server VAD under a 1 s limit are taken
    (the buffer keeps only the prefix padding while nobody speaks); without VAD the same
    audio is refused once past the limit."""
    async def run(turn_detection):
        client = _Client(_ScriptedChat([]), _limited(1.0))
        await client.next()
        client.send({"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"turn_detection": turn_detection}}}})
        await client.next()
        for _ in range(6):
            _append(client, 0.5)
        client.send({"type": "session.update", "session": {"type": "realtime"}})
        events = await client.until("session.updated")
        await client.close()
        return [e["error"]["code"] for e in events if e["type"] == "error"]

    assert asyncio.run(run({"type": "server_vad"})) == []
    assert asyncio.run(run(None)) == ["input_audio_buffer_full"] * 4


def _session(turn_detection: dict, pcm: bytes | None = None) -> list[dict]:
    """A session (the unit tests' scripted WebSocket) that sets ``turn_detection``, then
    streams ``pcm``: the events it got."""
    from plugin_tests.realtime_client import chunks

    async def run():
        client = _Client(_ScriptedChat([]))
        await client.next()
        client.send({"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"turn_detection": turn_detection}}}})
        events = [await client.next()]  # session.updated or an error
        if pcm is not None:
            for piece in chunks(pcm):
                client.send({"type": "input_audio_buffer.append", "audio": piece})
            events += await client.until("response.done")
        await client.close()
        return events

    return asyncio.run(run())


def test_a_session_with_semantic_vad_answers_the_finished_turn():
    from plugin_tests.realtime_client import speech_pcm

    events = _session({"type": "semantic_vad", "eagerness": "high"},
                      speech_pcm(before_s=0.5, after_s=1.5))
    updated = events[0]["session"]["audio"]["input"]["turn_detection"]
    assert updated == {"type": "semantic_vad", "eagerness": "high", "create_response": True,
                       "interrupt_response": True}
    kinds = [e["type"] for e in events]
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "response.created"):
        assert kind in kinds, kinds
    assert events[-1]["response"]["status"] == "completed"


@pytest.mark.parametrize("detection, param", [
    ({"type": "semantic_vad", "eagerness": "eventually"}, "eagerness"),
    ({"type": "semantic_vad", "eagerness": ["low"]}, "eagerness"),
    ({"type": "semantic_vad", "threshold": 0.5}, "threshold"),
    ({"type": "semantic_vad", "create_response": "yes"}, "create_response"),
])
def test_bad_semantic_vad_fields_are_named(detection, param):
    (error,) = _session(detection)
    assert error["type"] == "error", error
    assert error["error"]["param"] == f"session.audio.input.turn_detection.{param}"


def test_without_the_model_semantic_vad_is_refused_saying_what_to_install(monkeypatch):
    import importlib.util

    from vllm_omni_plugin.entrypoints.realtime.semantic_vad import INSTALL

    """A fake (``find_spec`` says pipecat is not installed): the test venv has it, and
    uninstalling a package mid-run is not something a test can undo."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pipecat" else real(name, *a))
    (error,) = _session({"type": "semantic_vad"})
    assert error["error"]["param"] == "session.audio.input.turn_detection.type"
    assert "pipecat" in error["error"]["message"]
    assert INSTALL in error["error"]["message"]
