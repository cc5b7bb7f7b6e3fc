"""A Realtime session's configuration (what ``session.update`` sets, OpenAI's defaults)
and the checks of the client's fields, each failure a :class:`~.protocol.RealtimeError`
naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_omni_plugin.entrypoints.media_input import is_choice
from vllm_omni_plugin.entrypoints.realtime.protocol import (
    MAX_OUTPUT_TOKENS,
    PCM_FORMAT,
    RealtimeError,
)
from vllm_omni_plugin.entrypoints.realtime.semantic_vad import (
    MAX_PAUSE_MS,
    SemanticVad,
    model_path,
)
from vllm_omni_plugin.entrypoints.realtime.vad import INPUT_RATE, ServerVad, VadParams
from vllm_omni_plugin.processors import Voices


@dataclass
class TurnDetection:
    """Turn detection of a session: ``server_vad`` (:mod:`.vad`, with ``vad``'s
    parameters) or ``semantic_vad`` (:mod:`.semantic_vad`, with ``eagerness``)."""

    vad: VadParams = field(default_factory=VadParams)
    create_response: bool = True
    interrupt_response: bool = True
    type: str = "server_vad"
    eagerness: str = "auto"

    def as_dict(self) -> dict:
        """The ``turn_detection`` object of the session."""
        flags = {"create_response": self.create_response,
                 "interrupt_response": self.interrupt_response}
        if self.type == "semantic_vad":
            return {"type": self.type, "eagerness": self.eagerness, **flags}
        return {"type": self.type, "threshold": self.vad.threshold,
                "prefix_padding_ms": self.vad.prefix_padding_ms,
                "silence_duration_ms": self.vad.silence_duration_ms, **flags}

    def detector(self) -> ServerVad | SemanticVad:
        """A new detector of this kind (loads its models: call it off the event loop)."""
        if self.type == "semantic_vad":
            return SemanticVad(self.eagerness)
        return ServerVad(self.vad)


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
    """``audio.input.turn_detection``: ``server_vad`` or ``semantic_vad`` with its
    parameters, or null."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeError(where, "must be an object or null")
    kind = value.get("type", "server_vad")
    if kind == "semantic_vad":
        return semantic_turn_detection(value, where)
    if kind != "server_vad":
        raise RealtimeError(f"{where}.type", f"{str(kind)[:40]!r} is not supported; use "
                            "\"server_vad\", \"semantic_vad\" or null")
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
    for name in value:
        if name not in ("type", "threshold", "prefix_padding_ms", "silence_duration_ms",
                        "create_response", "interrupt_response", "idle_timeout_ms"):
            raise RealtimeError(f"{where}.{name}", "is not supported")
    return TurnDetection(VadParams(float(threshold), **ms), **response_flags(value, where))


def semantic_turn_detection(value: dict, where: str) -> TurnDetection:
    """A ``semantic_vad`` ``turn_detection`` object: ``eagerness`` and the response flags;
    refused naming ``type`` where the end-of-turn model is not installed."""
    eagerness = value.get("eagerness", "auto")
    if not is_choice(eagerness, MAX_PAUSE_MS):
        raise RealtimeError(f"{where}.eagerness", "must be one of " + ", ".join(MAX_PAUSE_MS))
    for name in value:
        if name not in ("type", "eagerness", "create_response", "interrupt_response"):
            raise RealtimeError(f"{where}.{name}", "is not supported with semantic_vad")
    try:
        model_path()
    except RuntimeError as exc:
        raise RealtimeError(f"{where}.type", str(exc)) from exc
    return TurnDetection(type="semantic_vad", eagerness=eagerness,
                         **response_flags(value, where))


def response_flags(value: dict, where: str) -> dict:
    """``create_response`` and ``interrupt_response`` of a ``turn_detection`` object."""
    flags = {}
    for name in ("create_response", "interrupt_response"):
        got = value.get(name, True)
        if not isinstance(got, bool):
            raise RealtimeError(f"{where}.{name}", "must be true or false")
        flags[name] = got
    return flags


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


@dataclass(frozen=True)
class ResponseParams:
    """What one response asks of the model: the session's configuration with the
    ``response.create`` event's overrides."""

    modalities: tuple[str, ...]
    instructions: str
    max_tokens: int | None  # None: "inf"
    voice: str | None
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict = "auto"
    model: str | None = None

    @classmethod
    def of(cls, config: SessionConfig, overrides: dict, model: str | None) -> ResponseParams:
        """The session's ``config`` with a ``response.create``'s ``response`` object
        (``overrides``), for the session's ``model``.

        Raises:
            RealtimeError: naming an override that is bad or not supported.
        """
        chosen = {"modalities": config.output_modalities,
                  "instructions": config.instructions,
                  "max_tokens": config.max_output_tokens}
        for key, value in overrides.items():
            if key == "output_modalities":
                chosen["modalities"] = modalities(value, "response.output_modalities")
            elif key == "instructions":
                chosen["instructions"] = string(value, "response.instructions")
            elif key == "max_output_tokens":
                chosen["max_tokens"] = max_tokens(value, "response.max_output_tokens")
            elif key not in ("metadata", "conversation"):
                raise RealtimeError(f"response.{key}", "is not supported by this server")
        return cls(voice=config.voice, tools=tuple(config.tools),
                   tool_choice=config.tool_choice, model=model, **chosen)
