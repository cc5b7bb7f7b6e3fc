"""OpenAI's Realtime API, ``GET /v1/realtime`` (WebSocket), on the omni pipeline.

One session per connection, speaking the event protocol of OpenAI's Realtime API as the
official ``openai`` SDK does (``client.realtime.connect(model=...)``), in the shape of
vLLM's own realtime entrypoint (``vllm/entrypoints/speech_to_text/realtime/``):

* :mod:`.api_router`: the route's entry (session limit, vLLM's WebSocket metrics);
* :mod:`.connection`: one session: client events, the input audio buffer, turn detection,
  barge-in, the responses' lifecycle;
* :mod:`.protocol`: constants, errors and the server events as typed models;
* :mod:`.session_config`: what ``session.update`` sets, and the client's field checks;
* :mod:`.conversation`: the items, their edits and their chat form;
* :mod:`.response`: one response, chat deltas in, Realtime events out;
* :mod:`.serving`: the model work, each response a streamed chat completion with audio
  through vLLM's chat handler;
* :mod:`.vad`: server VAD (Silero); :mod:`.semantic_vad`: semantic VAD (Silero's pauses,
  an end-of-turn model deciding); :mod:`.metrics`: the plugin's Realtime metrics.

Audio in and out is ``audio/pcm``: 16-bit little-endian mono at 24 kHz. The output is
the pipeline's own pcm16, passed through: 24 kHz is Qwen3-Omni's code2wav rate (not
checked against the pipeline). A conversation longer than the model's context loses its
oldest items first, each logged and announced as ``conversation.item.deleted``, until it
fits; an assistant turn goes into later prompts as its transcript.

Limits: at most ``--omni-realtime-max-sessions`` sessions (one more gets an ``error``
event and is closed with code 1013); a session idle for ``--omni-realtime-idle-timeout``
seconds is closed (code 1000); an event over :data:`.protocol.MAX_EVENT_BYTES` or not a
JSON object gets an ``error`` event; the input audio buffer holds at most
``--omni-realtime-max-input-audio`` seconds (an append past it gets an ``error`` event,
``input_audio_buffer_full``, and is dropped).
"""

from vllm_omni_plugin.entrypoints.realtime.api_router import REALTIME_PATH, RealtimeEndpoint

__all__ = ["REALTIME_PATH", "RealtimeEndpoint"]
