"""The Realtime API's wire protocol as this server speaks it: constants, the error event,
the session configuration that ``session.update`` sets, and the checks of the client's
fields (each failure a :class:`RealtimeError` naming the field).

Audio in and out is ``audio/pcm``: 16-bit little-endian mono at 24 kHz
(:data:`~.vad.INPUT_RATE`), OpenAI's only ``audio/pcm`` rate.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from vllm_omni_plugin.entrypoints.realtime.vad import INPUT_RATE, VadParams
from vllm_omni_plugin.processors import Voices

#: OpenAI's limit on one client event (an ``input_audio_buffer.append`` of 15 MiB).
MAX_EVENT_BYTES = 15 * 1024 * 1024
#: Input audio shorter than this cannot be committed (OpenAI's rule: 100 ms).
MIN_COMMIT_MS = 100
#: The one audio format in and out: OpenAI's ``audio/pcm`` at 24 kHz.
PCM_FORMAT = {"type": "audio/pcm", "rate": INPUT_RATE}
#: WebSocket close codes (RFC 6455 §7.4.1; 1013 is IANA's "try again later").
CLOSE_NORMAL = 1000
CLOSE_TRY_AGAIN_LATER = 1013
#: The largest ``max_output_tokens`` a session or response may ask for.
MAX_OUTPUT_TOKENS = 4096


class RealtimeError(Exception):
    """A client event the session refuses: ``code`` (OpenAI's error codes where one
    exists), ``param`` the field it names, ``message`` the reason."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def event_id() -> str:
    """A new server event id."""
    return f"event_{uuid.uuid4().hex[:20]}"


def item_id() -> str:
    """A new conversation item id."""
    return f"item_{uuid.uuid4().hex[:20]}"


def error_event(exc: RealtimeError, client_event_id: str | None = None) -> dict:
    """The ``error`` server event for ``exc``, answering the client event
    ``client_event_id`` (None: no event, or one without an id)."""
    kind = "server_error" if exc.code == "server_error" else "invalid_request_error"
    return {"type": "error", "event_id": event_id(), "error": {
        "type": kind, "code": exc.code, "message": str(exc),
        "param": exc.param, "event_id": client_event_id}}


@dataclass
class TurnDetection:
    """``server_vad`` turn detection of a session (see :mod:`.vad`)."""

    vad: VadParams = field(default_factory=VadParams)
    create_response: bool = True
    interrupt_response: bool = True

    def as_dict(self) -> dict:
        """The ``turn_detection`` object of the session (``type`` ``server_vad``)."""
        return {"type": "server_vad", "threshold": self.vad.threshold,
                "prefix_padding_ms": self.vad.prefix_padding_ms,
                "silence_duration_ms": self.vad.silence_duration_ms,
                "create_response": self.create_response,
                "interrupt_response": self.interrupt_response}


@dataclass
class SessionConfig:
    """What ``session.update`` sets (OpenAI's defaults)."""

    voice: str | None  # None: the model has no voices
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    tools: list[dict] = field(default_factory=list)
    tool_choice: str | dict = "auto"
    max_output_tokens: int | None = None  # None: "inf"

    def as_dict(self, session_id: str, model: str | None) -> dict:
        """The session object of ``session.created`` / ``session.updated``."""
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id,
            "model": model, "instructions": self.instructions,
            "output_modalities": list(self.output_modalities),
            "audio": {"input": {"format": dict(PCM_FORMAT), "turn_detection":
                                self.turn_detection.as_dict() if self.turn_detection else None},
                      "output": {"format": dict(PCM_FORMAT), "voice": self.voice}},
            "tools": self.tools, "tool_choice": self.tool_choice,
            "max_output_tokens": self.max_output_tokens or "inf"}


# -- field checks ------------------------------------------------------------------------
def object_field(parent: dict, key: str, where: str | None = None) -> dict:
    """``parent[key]``, which must be an object (``where``: the parent's own name)."""
    value = parent.get(key)
    if not isinstance(value, dict):
        raise RealtimeError(f"{where}.{key}" if where else key, "must be an object")
    return value


def string(value, where: str) -> str:
    """``value``, which must be a string (``where``: the field it is)."""
    if not isinstance(value, str):
        raise RealtimeError(where, "must be a string")
    return value


def modalities(value, where: str) -> tuple[str, ...]:
    """``output_modalities``: ``["audio"]`` or ``["text"]``."""
    if value not in (["audio"], ["text"]):
        raise RealtimeError(where, f"must be [\"audio\"] or [\"text\"], got {value!r}"[:200])
    return tuple(value)


def max_tokens(value, where: str) -> int | None:
    """An ``max_output_tokens`` value: an integer, or ``"inf"`` (None)."""
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise RealtimeError(where, f"must be an integer from 1 to {MAX_OUTPUT_TOKENS}, or "
                            "\"inf\"")
    return value


def check_format(value, where: str) -> None:
    """An ``audio.input/output.format``: ``audio/pcm`` at :data:`INPUT_RATE` only."""
    if not isinstance(value, dict) or value.get("type") != "audio/pcm":
        kind = value.get("type") if isinstance(value, dict) else value
        raise RealtimeError(f"{where}.type", f"{str(kind)[:40]!r} is not supported; the "
                            f"audio format is audio/pcm (16-bit mono at {INPUT_RATE} Hz)")
    if value.get("rate", INPUT_RATE) != INPUT_RATE:
        raise RealtimeError(f"{where}.rate", f"audio/pcm is {INPUT_RATE} Hz here, got "
                            f"{str(value.get('rate'))[:20]}")


def turn_detection(value, where: str) -> TurnDetection | None:
    """``audio.input.turn_detection``: ``server_vad`` with its parameters, or null."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeError(where, "must be an object or null")
    if value.get("type", "server_vad") != "server_vad":
        raise RealtimeError(f"{where}.type", f"{str(value.get('type'))[:40]!r} is not "
                            "supported; use \"server_vad\" or null")
    defaults = VadParams()
    threshold = value.get("threshold", defaults.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not 0.0 <= threshold <= 1.0:
        raise RealtimeError(f"{where}.threshold", "must be a number from 0 to 1")
    ms = {}
    for name in ("prefix_padding_ms", "silence_duration_ms"):
        got = value.get(name, getattr(defaults, name))
        if isinstance(got, bool) or not isinstance(got, int) or not 0 <= got <= 10000:
            raise RealtimeError(f"{where}.{name}", "must be an integer from 0 to 10000")
        ms[name] = got
    flags = {}
    for name in ("create_response", "interrupt_response"):
        got = value.get(name, True)
        if not isinstance(got, bool):
            raise RealtimeError(f"{where}.{name}", "must be true or false")
        flags[name] = got
    for name in value:
        if name not in ("type", "threshold", "prefix_padding_ms", "silence_duration_ms",
                        "create_response", "interrupt_response", "idle_timeout_ms"):
            raise RealtimeError(f"{where}.{name}", "is not supported")
    return TurnDetection(VadParams(float(threshold), **ms), **flags)


def tools(value) -> list[dict]:
    """``session.tools``: function tools (``name``, ``description``, ``parameters``)."""
    if not isinstance(value, list):
        raise RealtimeError("session.tools", "must be a list of function tools")
    checked = []
    for i, tool in enumerate(value):
        where = f"session.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RealtimeError(f"{where}.type", "only \"function\" tools are supported")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RealtimeError(f"{where}.name", "must be a non-empty string")
        if not isinstance(tool.get("parameters", {}), dict):
            raise RealtimeError(f"{where}.parameters", "must be a JSON schema object")
        checked.append({k: tool[k] for k in ("type", "name", "description", "parameters")
                        if k in tool})
    return checked


def tool_choice(value, where: str) -> str | dict:
    """``tool_choice``: ``auto``, ``none``, ``required`` or one function by name."""
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" \
            and isinstance(value.get("name"), str):
        return {"type": "function", "name": value["name"]}
    raise RealtimeError(where, "must be \"auto\", \"none\", \"required\" or "
                        "{\"type\": \"function\", \"name\": ...}")


def audio_config(audio: dict, voices: Voices | None) -> dict:
    """The :class:`SessionConfig` changes of a ``session.update``'s ``session.audio``
    (``voices``: the served model's, None when it has none)."""
    changes: dict = {}
    for side, value in audio.items():
        if side not in ("input", "output"):
            raise RealtimeError(f"session.audio.{side}", "is not supported")
        if not isinstance(value, dict):
            raise RealtimeError(f"session.audio.{side}", "must be an object")
        for key, setting in value.items():
            where = f"session.audio.{side}.{key}"
            if key == "format":
                check_format(setting, where)
            elif side == "input" and key == "turn_detection":
                changes["turn_detection"] = turn_detection(setting, where)
            elif side == "output" and key == "voice":
                changes["voice"] = voice(setting, where, voices)
            elif side == "output" and key == "speed":
                if setting != 1.0:
                    raise RealtimeError(where, "only 1.0 is supported")
            elif side == "input" and key in ("transcription", "noise_reduction"):
                if setting is not None:
                    raise RealtimeError(where, "is not supported (use null)")
            else:
                raise RealtimeError(where, "is not supported")
    return changes


def voice(value, where: str, voices: Voices | None) -> str:
    """``audio.output.voice``: one of ``voices`` (its canonical name)."""
    if not isinstance(value, str) or not value.strip():
        raise RealtimeError(where, "must be a non-empty voice name")
    if voices is None:
        raise RealtimeError(where, "the served model has no voices")
    try:
        return voices.resolve(value)
    except ValueError as exc:
        raise RealtimeError(where, str(exc)) from exc
