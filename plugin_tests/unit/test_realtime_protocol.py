"""The Realtime server events' models (``entrypoints/realtime/protocol.py``) against the
installed ``openai`` SDK: every one of them, encoded, is one of the SDK's
``RealtimeServerEvent`` types, with the same ``type``; none holds a field the SDK does not
know."""

from __future__ import annotations

import json

import msgspec
import pytest

from vllm_omni_plugin.entrypoints.realtime import protocol as p

MESSAGE = p.MessageItem(id="item_1", role="user", content=[p.InputText("hi"), p.InputAudio()])
SPOKEN = p.MessageItem(id="item_4", role="assistant", content=[p.OutputAudio("said")],
                       status="incomplete")
WRITTEN = p.MessageItem(id="item_5", role="assistant", content=[p.OutputText("so")])
CALL = p.FunctionCallItem(id="item_2", call_id="call_1", name="f", arguments="{}")
CALL_OUTPUT = p.FunctionCallOutputItem(id="item_3", call_id="call_1", output="42")
RESPONSE = p.Response(id="resp_1", status="cancelled", output=[SPOKEN, CALL],
                      output_modalities=["audio"], max_output_tokens="inf",
                      audio={"output": {"format": dict(p.PCM_FORMAT), "voice": "ethan"}},
                      status_details={"type": "cancelled", "reason": "turn_detected"},
                      usage=p.Usage(9, 7, 2))
IN = {"response_id": "resp_1", "item_id": "item_1"}
SESSION = {"type": "realtime", "object": "realtime.session", "id": "sess_1", "model": "m",
           "instructions": "", "output_modalities": ["audio"],
           "audio": {"input": {"format": dict(p.PCM_FORMAT), "turn_detection": None},
                     "output": {"format": dict(p.PCM_FORMAT), "voice": "ethan"}},
           "tools": [], "tool_choice": "auto", "max_output_tokens": "inf"}

#: one instance of every server event model
EXAMPLES = [
    p.error_event(p.RealtimeError("item_id", "no item", code="item_not_found"), "evt_1"),
    p.SessionCreated(session=SESSION),
    p.SessionUpdated(session=SESSION),
    p.SpeechStarted(audio_start_ms=300, item_id="item_1"),
    p.SpeechStopped(audio_end_ms=900, item_id="item_1"),
    p.InputAudioCommitted(item_id="item_1", previous_item_id=None),
    p.InputAudioCleared(),
    p.ItemAdded(item=MESSAGE, previous_item_id="item_0"),
    p.ItemDone(item=CALL_OUTPUT),
    p.ItemDone(item=WRITTEN, previous_item_id="item_4"),
    p.ItemDeleted(item_id="item_1"),
    p.ItemTruncated(item_id="item_1", content_index=0, audio_end_ms=400),
    p.ResponseCreated(response=RESPONSE),
    p.ResponseDone(response=RESPONSE),
    p.OutputItemAdded(response_id="resp_1", output_index=0, item=SPOKEN),
    p.OutputItemDone(response_id="resp_1", output_index=1, item=CALL),
    p.FunctionCallArgumentsDone(response_id="resp_1", output_index=1, item_id="item_2",
                                call_id="call_1", name="f", arguments="{}"),
    p.ContentPartAdded(**IN, part=p.Audio("")),
    p.ContentPartDone(**IN, part=p.Text("done")),
    p.AudioTranscriptDelta(**IN, delta="He"),
    p.AudioTranscriptDone(**IN, transcript="Hello"),
    p.TextDelta(**IN, delta="He"),
    p.TextDone(**IN, text="Hello"),
    p.AudioDelta(**IN, delta="AAAA"),
    p.AudioDone(**IN),
]


def _models(cls) -> set[type]:
    """The event models under ``cls``: its subclasses that have none of their own."""
    found = set()
    for sub in cls.__subclasses__():
        found |= _models(sub) if sub.__subclasses__() else {sub}
    return found


def test_every_event_model_has_an_example():
    assert {type(e) for e in EXAMPLES} == _models(p.Event)


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__struct_config__.tag)
def test_each_event_is_the_sdks_own(event):
    from openai.types.realtime import RealtimeServerEvent
    from pydantic import TypeAdapter

    wire = json.loads(p.encode(event))
    parsed = TypeAdapter(RealtimeServerEvent).validate_python(wire)
    assert parsed.type == wire["type"] == event.__struct_config__.tag
    # nothing of ours that the SDK's type does not declare
    dumped = parsed.model_dump(exclude_unset=True)
    assert _keys(wire) <= _keys(dumped) | _keys(wire, unknown_ok=True), wire


def _keys(value, prefix: str = "", unknown_ok: bool = False) -> set[str]:
    """Every key path of ``value``; with ``unknown_ok``, only those under the free-form
    objects the SDK types as plain dicts (``session``, ``audio``, ``status_details``)."""
    keys = set()
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}"
            if not unknown_ok or any(f".{free}" in path for free in (
                    "session", "audio", "status_details")):
                keys.add(path)
            keys |= _keys(item, path, unknown_ok)
    elif isinstance(value, list):
        for item in value:
            keys |= _keys(item, f"{prefix}[]", unknown_ok)
    return keys


def test_a_client_item_round_trips_to_its_wire_shape():
    """An item decoded from its own JSON is the same model (tagged unions by ``type``)."""
    decoded = msgspec.json.decode(p.encode(p.ItemAdded(item=MESSAGE)), type=p.ItemAdded)
    assert decoded.item == MESSAGE


@pytest.mark.parametrize("item, param", [
    ({"type": "message", "role": {"a": 1}, "content": [{"type": "input_text", "text": "hi"}]},
     "item.role"),
    ({"type": "message", "role": "user", "content": [{"type": ["input_text"]}]},
     "item.content[0].type"),
])
def test_a_json_object_or_array_where_a_choice_goes_is_refused_naming_it(item, param):
    """A role or part type sent as an object or an array (unhashable) is the session's
    error naming the field, not a TypeError."""
    from vllm_omni_plugin.entrypoints.realtime.conversation import conversation_item

    with pytest.raises(p.RealtimeError) as info:
        conversation_item(item)
    assert info.value.param == param


def test_user_audio_longer_than_the_model_takes_is_refused_as_it_joins():
    """A clip checked as it joins the conversation (so that no response decodes the
    conversation's audio again): an item's ``input_audio`` over the model's clip length is
    refused naming its field; a committed buffer's, naming none (the buffer)."""
    import base64

    from vllm_omni_plugin.entrypoints.media_input import MediaLimits
    from vllm_omni_plugin.entrypoints.realtime.conversation import clip_fits, conversation_item
    from vllm_omni_plugin.entrypoints.realtime.vad import INPUT_RATE

    limits = MediaLimits(max_audio_seconds=1.0)
    pcm = base64.b64encode(b"\0\0" * (INPUT_RATE * 3 // 2)).decode()
    item = {"type": "message", "role": "user",
            "content": [{"type": "input_audio", "audio": pcm}]}
    with pytest.raises(p.RealtimeError) as info:
        conversation_item(item, limits)
    assert info.value.param == "item.content[0].audio"
    assert "1.5 s long; this model takes at most 1 s" in str(info.value)
    conversation_item(item)  # no limit known
    clip_fits(1.0, None, limits)
    with pytest.raises(p.RealtimeError) as info:
        clip_fits(1.2, None, limits)
    assert info.value.param is None and str(info.value).startswith("the audio is 1.2 s")
