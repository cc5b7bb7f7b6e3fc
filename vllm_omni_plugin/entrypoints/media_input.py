"""Checks of a chat request's media content parts, before vLLM loads them.

vLLM's chat parser and its Qwen3-Omni processor take ``image_url``, ``input_audio``,
``audio_url`` and ``video_url`` parts (and ``mm_processor_kwargs.use_audio_in_video``).
What they refuse they refuse without saying which part was at fault, and some
failures surface as HTTP 500 (an audio clip neither soundfile nor PyAV decodes).
:func:`check_media` runs first, in the API middleware, and answers each of these
with a :class:`RequestError` naming the field (``messages[i].content[j]...``):

* a content part type the model does not take (``input_file``, ...);
* a ``data:`` URL whose media type does not fit the part (``application/pdf`` in an
  ``image_url``), an ``input_audio.format`` that is not an audio format name;
* inline (base64) images and audio that vLLM's own loaders (``ImageMediaIO``,
  ``AudioMediaIO``, the ones vLLM uses next) cannot decode;
* more items of a modality than ``--limit-mm-per-prompt`` allows (each video with
  ``use_audio_in_video`` also counts as one audio item, as vLLM adds its sound);
* an audio clip longer than the model takes: the entry model's
  ``get_speech_to_text_config(...).max_audio_clip_s`` (for Qwen3-Omni the feature
  extractor's ``chunk_length``, 300 s in the released checkpoints), which is also
  the clip length vLLM budgets its encoder cache for.

Inline media are decoded here and again by vLLM (a few milliseconds for an image or
a short clip); remote URLs are left to vLLM, which fetches them once.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass, field

from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.processors.hookspecs import RequestError

logger = init_logger(__name__)


def is_choice(value, choices) -> bool:
    """Whether ``value`` is a string among ``choices`` (a dict's keys, a set, a tuple). A
    client may send any JSON value in a field that names a choice: a list or an object
    looked up in a dict or a set raises TypeError, which would answer HTTP 500."""
    return isinstance(value, str) and value in choices


def not_a_choice(field: str, value, choices) -> RequestError:
    """The error for ``value`` of ``field`` that :func:`is_choice` refused: the value
    quoted back (at most :data:`_SHOWN` characters; the JSON type of a non-string), and
    the ``choices``."""
    shown = value[:_SHOWN] if isinstance(value, str) else type(value).__name__
    return RequestError(field, f"{shown!r} is not supported; use one of {', '.join(choices)}")


def required_text(body: dict, field: str, what: str, max_chars: int | None = None) -> str:
    """``body[field]``, a non-blank string of at most ``max_chars`` characters.

    Raises:
        RequestError: naming ``field`` (``what``: what the field should hold).
    """
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise RequestError(field, f"is required: {what}")
    if max_chars is not None and len(value) > max_chars:
        raise RequestError(field, f"is {len(value)} characters long; at most {max_chars}")
    return value


#: Text-like part types vLLM's chat parser takes; passed through unchecked.
TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")
#: Media part type -> (modality, the key holding its payload, expected data-URL type).
MEDIA_PARTS = {
    "image_url": ("image", "image_url", "image/"),
    "input_image": ("image", "image_url", "image/"),
    "audio_url": ("audio", "audio_url", "audio/"),
    "input_audio": ("audio", "input_audio", "audio/"),
    "video_url": ("video", "video_url", "video/"),
}
#: ``input_audio.format`` values: audio container/codec names (OpenAI documents wav
#: and mp3; vLLM decodes what soundfile or PyAV read).
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm", "pcm16")
#: Longest value quoted back in an error message.
_SHOWN = 60


@dataclass(frozen=True)
class MediaLimits:
    """What the served model takes per request.

    max_items: modality -> the most items per request (vLLM's ``--limit-mm-per-prompt``;
        a modality not listed is unlimited).
    max_audio_seconds: the longest audio clip in seconds, or None (no limit known).
    """

    max_items: dict[str, int] = field(default_factory=dict)
    max_audio_seconds: float | None = None

    @classmethod
    def from_vllm_config(cls, vllm_config) -> MediaLimits:
        """Read the limits from the API server's ``VllmConfig`` (the entry stage's)."""
        model_config = vllm_config.model_config
        mm_config = getattr(model_config, "multimodal_config", None)
        if mm_config is None:
            return cls()
        items = {m: int(mm_config.get_limit_per_prompt(m)) for m in ("image", "audio", "video")}
        seconds = None
        try:
            from vllm.model_executor.model_loader import get_model_cls

            speech = getattr(get_model_cls(model_config), "get_speech_to_text_config", None)
            if speech is not None:
                seconds = float(speech(model_config, "transcribe").max_audio_clip_s)
        except Exception as exc:  # the limit is a courtesy check; vLLM still guards
            logger.warning("no audio length limit for the served model: %s", exc)
        return cls(max_items=items, max_audio_seconds=seconds)


def has_media_parts(body: dict) -> bool:
    """Whether a chat request's ``messages`` have a content part :func:`check_media` checks
    (any typed part but text); cheap: it decodes nothing."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                isinstance(part, dict) and part.get("type") not in (None, *TEXT_PARTS)
                for part in content):
            return True
    return False


def check_media(body: dict, limits: MediaLimits, decode: bool = True) -> None:
    """Check every content part of a chat request's ``messages``; see the module docstring.
    ``decode=False`` checks the parts' types, fields and counts only, decoding nothing:
    for media the caller made itself, whose clip lengths it checked
    (:func:`check_clip_seconds`) as it made them.

    Raises:
        RequestError: naming the offending field, e.g. ``messages[0].content[1].image_url.url``.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return  # vLLM answers a malformed request itself
    kwargs = body.get("mm_processor_kwargs")
    audio_in_video = isinstance(kwargs, dict) and bool(kwargs.get("use_audio_in_video"))
    counts = {"image": 0, "audio": 0, "video": 0}
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is None or kind in TEXT_PARTS:
                continue  # vLLM parses (or refuses) parts without a type itself
            if not is_choice(kind, MEDIA_PARTS):
                shown = str(kind)[:_SHOWN]
                raise RequestError(f"{where}.type", (
                    f"unsupported content part type {shown!r}; this model takes text, "
                    f"{', '.join(MEDIA_PARTS)} parts"))
            modality, key, mime = MEDIA_PARTS[kind]
            for counted in (modality, "audio") if kind == "video_url" and audio_in_video \
                    else (modality,):
                counts[counted] += 1
                limit = limits.max_items.get(counted)
                if limit is not None and counts[counted] > limit:
                    raise RequestError(where, (
                        f"{counted} item {counts[counted]} of the request; this server takes "
                        f"at most {limit} {counted} item(s) per request "
                        "(--limit-mm-per-prompt)"))
            _check_part(part.get(key), f"{where}.{key}", kind, mime, limits, decode)


def _check_part(value, where: str, kind: str, mime: str, limits: MediaLimits,
                decode: bool) -> None:
    if kind == "input_audio":
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            raise RequestError(f"{where}.data", "must be base64-encoded audio")
        fmt = value.get("format")
        if fmt is not None and not is_choice(fmt, AUDIO_FORMATS):
            shown = str(fmt)[:_SHOWN]
            raise RequestError(f"{where}.format", (
                f"unsupported audio format {shown!r}; use one of {', '.join(AUDIO_FORMATS)}"))
        if decode:
            _check_audio(value["data"], f"{where}.data", limits)
        return
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise RequestError(f"{where}.url", "must be a URL string")
    if not url.startswith("data:"):
        return  # fetched (and checked) by vLLM
    header, sep, data = url[len("data:"):].partition(",")
    media_type = header.split(";")[0].strip().lower()
    if not sep or not header.endswith(";base64"):
        raise RequestError(f"{where}.url", "a data URL must be 'data:<media type>;base64,...'")
    if not media_type.startswith(mime):
        raise RequestError(f"{where}.url", (
            f"unsupported media type {media_type[:_SHOWN]!r} for a part of type {kind!r} "
            f"(expected {mime}*)"))
    if not decode:
        return
    if kind in ("image_url", "input_image"):
        _check_image(data, media_type, f"{where}.url")
    elif kind == "audio_url":
        _check_audio(data, f"{where}.url", limits, media_type)


def _check_image(data: str, media_type: str, where: str) -> None:
    from vllm.multimodal.media.image import ImageMediaIO

    _decode(lambda: ImageMediaIO().load_base64(media_type, data), where, "image")


def _check_audio(data: str, where: str, limits: MediaLimits,
                 media_type: str = "audio/wav") -> None:
    from vllm.multimodal.media.audio import AudioMediaIO

    samples, rate = _decode(lambda: AudioMediaIO().load_base64(media_type, data), where,
                            "audio")
    check_clip_seconds(samples.shape[-1] / float(rate), where, limits)


def check_clip_seconds(seconds: float, where: str, limits: MediaLimits) -> None:
    """Check an audio clip's length (seconds) against the model's.

    Raises:
        RequestError: naming ``where``, when the clip is longer than the model takes.
    """
    if limits.max_audio_seconds is not None and seconds > limits.max_audio_seconds:
        raise RequestError(where, (
            f"the audio is {seconds:.1f} s long; this model takes at most "
            f"{limits.max_audio_seconds:g} s per clip"))


def _decode(load, where: str, what: str):
    try:
        return load()
    except (binascii.Error, ValueError) as exc:
        if "base64" in str(exc).lower() or isinstance(exc, binascii.Error):
            raise RequestError(where, f"is not valid base64: {exc}") from None
        raise RequestError(where, f"cannot decode the {what}: {str(exc)[:200]}") from None
    except Exception as exc:  # a decoder's own error type (soundfile, PyAV, PIL)
        raise RequestError(where, (
            f"cannot decode the {what}: {type(exc).__name__}: {str(exc)[:200]}")) from None
