"""OpenAI's text-to-speech request, ``POST /v1/audio/speech``, on the omni pipeline.

The request becomes a chat completion whose assistant turn is the ``input`` text,
left open (vLLM's ``continue_final_message``): the entry stage prefills it and
generates one token, which no later stage reads, and the stages after it speak the
assistant turn as they speak a generated answer. The user turn is ``instructions``
when given, else the ``input`` itself.

Fields (OpenAI's): ``model``, ``input`` (at most :data:`MAX_INPUT_CHARS`
characters), ``voice`` (one of ``GET /v1/audio/voices``; default: the checkpoint's),
``response_format`` (:data:`SPEECH_FORMATS`, default ``mp3``), ``stream_format``
(``audio``: the encoded bytes as the body; ``sse``: ``speech.audio.delta`` and
``speech.audio.done`` events), ``instructions`` and ``speed`` (1.0 only).

``pcm`` is streamed: each chunk of speech a streamed final stage produces goes out as
soon as it is ready (body bytes, or one ``speech.audio.delta`` each); the other formats
are containers, encoded once the whole speech exists.
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass

from vllm_omni_plugin.engine.omni_request import AUDIO, TEXT, OmniRequest
from vllm_omni_plugin.entrypoints.asgi import captured, error_body, sent_failure, sse
from vllm_omni_plugin.entrypoints.audio_encoding import (
    AUDIO_FORMATS,
    STREAM_FORMAT,
    encode_audio,
    sample_rate_of,
)
from vllm_omni_plugin.entrypoints.chat_audio import CHAT_PATH
from vllm_omni_plugin.entrypoints.media_input import (
    RequestError,
    is_choice,
    not_a_choice,
    required_text,
)

SPEECH_PATH = "/v1/audio/speech"
#: OpenAI's limit on ``input``.
MAX_INPUT_CHARS = 4096
#: OpenAI's ``response_format`` names -> keys of ``audio_encoding.AUDIO_FORMATS``
#: (OpenAI's ``aac`` has no encoder in libsndfile and is refused).
SPEECH_FORMATS = {"mp3": "mp3", "opus": "opus", "flac": "flac", "wav": "wav",
                  "pcm": "pcm16"}
DEFAULT_SPEECH_FORMAT = "mp3"
STREAM_FORMATS = ("audio", "sse")


@dataclass(frozen=True)
class SpeechRequest:
    """A validated ``/v1/audio/speech`` body; ``format`` is a key of
    ``audio_encoding.AUDIO_FORMATS``."""

    model: str
    input: str
    voice: str | None
    format: str
    stream_format: str
    instructions: str | None


def _optional_str(body: dict, field: str) -> str | None:
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise RequestError(field, "must be a non-empty string (or left out)")
    return value


def parse_speech_request(body: dict, max_voice_chars: int) -> SpeechRequest:
    """Validate a ``/v1/audio/speech`` body.

    Raises:
        RequestError: naming the offending field.
    """
    model = required_text(body, "model", "the served model's name")
    text = required_text(body, "input", "the text to speak", MAX_INPUT_CHARS)
    voice = _optional_str(body, "voice")
    if voice is not None and len(voice) > max_voice_chars:
        raise RequestError("voice", f"is {len(voice)} characters long; voice names have "
                           f"at most {max_voice_chars}")
    fmt = body.get("response_format", DEFAULT_SPEECH_FORMAT)
    if not is_choice(fmt, SPEECH_FORMATS):
        raise not_a_choice("response_format", fmt, SPEECH_FORMATS)
    stream_format = body.get("stream_format", "audio")
    if not is_choice(stream_format, STREAM_FORMATS):
        raise not_a_choice("stream_format", stream_format, STREAM_FORMATS)
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or speed != 1.0:
        raise RequestError("speed", "only 1.0 is supported")
    return SpeechRequest(model, text, voice, SPEECH_FORMATS[fmt], stream_format,
                         _optional_str(body, "instructions"))


def speech_chat_body(speech: SpeechRequest) -> dict:
    """The chat completion request that speaks ``speech.input`` (see the module
    docstring)."""
    return {
        "model": speech.model,
        "messages": [{"role": "user", "content": speech.instructions or speech.input},
                     {"role": "assistant", "content": speech.input}],
        "add_generation_prompt": False, "continue_final_message": True,
        "max_tokens": 1, "temperature": 0.0,
        "modalities": [TEXT, AUDIO], "audio": {"format": speech.format,
                                               **({"voice": speech.voice}
                                                  if speech.voice else {})},
    }


def sse_delta(encoded: bytes) -> bytes:
    """OpenAI's ``speech.audio.delta`` event (``audio``: base64 of ``encoded``)."""
    return sse({"type": "speech.audio.delta",
                 "audio": base64.b64encode(encoded).decode("ascii")})


def sse_done(usage: dict | None) -> bytes:
    """OpenAI's ``speech.audio.done`` event with ``usage`` (``input_tokens``,
    ``output_tokens``, ``total_tokens``: the entry stage's, from a chat ``usage``)."""
    usage = usage or {}
    return sse({"type": "speech.audio.done", "usage": {
        "input_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "total_tokens": usage.get("total_tokens", 0)}})


def sse_error(error: bytes) -> bytes:
    """An ``error`` event carrying an OpenAI error body (``{"error": {...}}``)."""
    return sse({"type": "error", **json.loads(error)})


async def serve_speech(app, scope, receive, send, speech: SpeechRequest) -> None:
    """``POST /v1/audio/speech``: the chat completion of :func:`speech_chat_body`,
    answered as audio bytes or as OpenAI's speech events; ``pcm`` chunk by chunk as
    the pipeline produces them (see the module docstring)."""
    streamed = speech.format == STREAM_FORMAT
    request = OmniRequest(modalities=(TEXT, AUDIO), voice=speech.voice,
                          partials=asyncio.Queue() if streamed else None)
    chat_scope = {**scope, "path": CHAT_PATH, "raw_path": CHAT_PATH.encode()}
    chat = asyncio.ensure_future(captured(
        app, chat_scope, receive, json.dumps(speech_chat_body(speech)).encode(), request))
    try:
        sent = await _speech_chunks(send, speech, request, chat) if streamed else None
        answer = await chat
    finally:
        if not chat.done():  # the client went away mid-stream
            chat.cancel()
    result = request.result
    if sent is not None:  # the response started: finish it
        if result is None or result.error:
            if speech.stream_format == "sse":
                status = result.status if result is not None else 500
                error = result.error if result is not None else "no speech was produced"
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse_error(error_body(error, status))})
            else:  # raw audio cannot carry an error: the client sees it cut short
                await send({"type": "http.response.body", "body": b"",
                            "more_body": False})
            return
        rest = encode_audio(result.payload["waveform"][sent:].numpy(),
                            result.sample_rate, speech.format)
        body = rest if speech.stream_format == "audio" else (
            sse_delta(rest) + sse_done(json.loads(answer.body).get("usage")))
        return await send({"type": "http.response.body", "body": body,
                           "more_body": False})
    if await sent_failure(send, answer, request):
        return
    if result is None:
        return await answer.replay(send, answer.body)
    encoded = encode_audio(result.payload["waveform"].numpy(), result.sample_rate,
                           speech.format)
    if speech.stream_format == "sse":
        usage = json.loads(answer.body).get("usage")
        body = sse_delta(encoded) + sse_done(usage)
    else:
        body = encoded
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", _media_type(speech)),
        (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _speech_chunks(send, speech: SpeechRequest, request: OmniRequest,
                         chat: asyncio.Future) -> int | None:
    """Send each chunk of speech the orchestrator produces while ``chat`` runs (the
    response starts with the first); the samples sent, or None when none came."""
    partials, sent = request.partials, None
    while True:
        getter = asyncio.ensure_future(partials.get())
        await asyncio.wait({getter, chat}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            return sent  # the rest of the waveform is in the result
        payload = getter.result()
        if sent is None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", _media_type(speech))]})
            sent = 0
        samples = payload["waveform"]
        encoded = encode_audio(samples.numpy(), sample_rate_of(payload), speech.format)
        sent += samples.shape[0]
        await send({"type": "http.response.body", "more_body": True,
                    "body": encoded if speech.stream_format == "audio"
                    else sse_delta(encoded)})
        partials.task_done()


def _media_type(speech: SpeechRequest) -> bytes:
    """The content type of a speech answer: SSE, or the audio format's media type."""
    return b"text/event-stream" if speech.stream_format == "sse" else \
        AUDIO_FORMATS[speech.format].media_type.encode()
