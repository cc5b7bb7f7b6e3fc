"""``entrypoints/media_input.check_media``: the API's media checks, on vLLM's own loaders."""

from __future__ import annotations

import pytest

from plugin_tests import media
from vllm_omni_plugin.entrypoints.media_input import (
    MediaLimits,
    RequestError,
    check_media,
    has_media_parts,
)

LIMITS = MediaLimits(max_items={"image": 2, "audio": 2, "video": 1}, max_audio_seconds=10.0)


def _body(*parts, **extra) -> dict:
    return {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}],
            **extra}


IMAGE = {"type": "image_url", "image_url": {"url": media.data_url("image/png",
                                                                  media.png_bytes(32, 32))}}
AUDIO = {"type": "input_audio", "input_audio": {"data": media.b64(media.wav_bytes(1.0)),
                                                "format": "wav"}}
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}


def test_good_parts_pass():
    check_media(_body(IMAGE, AUDIO, VIDEO, IMAGE), LIMITS)
    # remote URLs and text-only requests are vLLM's to fetch and parse
    check_media(_body({"type": "image_url", "image_url": {"url": "https://x/y.png"}}), LIMITS)
    check_media({"messages": [{"role": "user", "content": "hi"}]}, LIMITS)


@pytest.mark.parametrize("part, field, fragment", [
    ({"type": "input_file", "file": {}}, "messages[1].content[0].type",
     "unsupported content part type 'input_file'"),
    ({"type": {"a": 1}}, "messages[1].content[0].type", "unsupported content part type"),
    ({"type": "input_audio", "input_audio": {"data": media.b64(media.wav_bytes(1)),
                                             "format": ["wav"]}},
     "messages[1].content[0].input_audio.format", "unsupported audio format"),
    ({"type": "image_url", "image_url": {"url": "data:audio/wav;base64,UklGRg=="}},
     "messages[1].content[0].image_url.url", "unsupported media type 'audio/wav'"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,raw"}},
     "messages[1].content[0].image_url.url", "data:<media type>;base64"),
    ({"type": "image_url", "image_url": {"url": media.data_url("image/png", b"x" * 64)}},
     "messages[1].content[0].image_url.url", "cannot decode the image"),
    ({"type": "image_url", "image_url": {}}, "messages[1].content[0].image_url.url",
     "must be a URL"),
    ({"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}},
     "messages[1].content[0].input_audio.data", "not valid base64"),
    ({"type": "input_audio", "input_audio": {"data": media.b64(b"x" * 400), "format": "wav"}},
     "messages[1].content[0].input_audio.data", "cannot decode the audio"),
    ({"type": "input_audio", "input_audio": {"data": media.b64(media.wav_bytes(1)), "format": 3}},
     "messages[1].content[0].input_audio.format", "unsupported audio format '3'"),
    ({"type": "input_audio", "input_audio": {"data": media.b64(media.wav_bytes(11, rate=1000))}},
     "messages[1].content[0].input_audio.data", "11.0 s long; this model takes at most 10 s"),
    ({"type": "audio_url", "audio_url": {"url": media.data_url("audio/wav",
                                                               media.wav_bytes(11, 1000))}},
     "messages[1].content[0].audio_url.url", "at most 10 s"),
])
def test_bad_part_names_its_field(part, field, fragment):
    with pytest.raises(RequestError) as info:
        check_media(_body(part), LIMITS)
    assert info.value.field == field and fragment in str(info.value), str(info.value)


def test_item_limits_count_a_videos_sound_as_audio():
    with pytest.raises(RequestError, match="image item 3") as info:
        check_media(_body(IMAGE, IMAGE, IMAGE), LIMITS)
    assert info.value.field == "messages[1].content[2]"
    check_media(_body(VIDEO, AUDIO, AUDIO), LIMITS)
    with pytest.raises(RequestError, match="audio item 3") as info:
        check_media(_body(VIDEO, AUDIO, AUDIO,
                          mm_processor_kwargs={"use_audio_in_video": True}), LIMITS)
    assert info.value.field == "messages[1].content[2]"


def test_media_parts_are_found_without_decoding_anything():
    """What decides whether a chat's media are checked (in a thread, they decode): any
    typed part but text, an unknown type included (check_media refuses it)."""
    def chat(*contents):
        return {"messages": [{"role": "user", "content": c} for c in contents]}

    assert not has_media_parts(chat("hi", [{"type": "text", "text": "hi"}, {"text": "x"}]))
    assert not has_media_parts({"messages": "not a list"})
    assert has_media_parts(chat("hi", [{"type": "image_url", "image_url": {"url": "x"}}]))
    assert has_media_parts(chat([{"type": "a_new_kind"}]))


def test_without_decoding_the_fields_and_counts_are_still_checked():
    """``decode=False`` (media the caller made itself): an undecodable clip, a too long
    one or a broken image passes, as nothing is decoded; a bad format, a missing field
    and one audio item too many are still refused, naming the field."""
    undecodable = {"type": "input_audio", "input_audio": {"data": media.b64(b"x" * 400)}}
    too_long = {"type": "input_audio",
                "input_audio": {"data": media.b64(media.wav_bytes(11, rate=1000))}}
    image = {"type": "image_url", "image_url": {"url": media.data_url("image/png", b"x")}}
    check_media(_body(undecodable, too_long, image), LIMITS, decode=False)
    for body, field in [
            (_body({"type": "input_audio", "input_audio": {"data": "", "format": "au"}}),
             "messages[1].content[0].input_audio.format"),
            (_body({"type": "input_audio", "input_audio": {}}),
             "messages[1].content[0].input_audio.data"),
            (_body(AUDIO, AUDIO, AUDIO), "messages[1].content[2]")]:
        with pytest.raises(RequestError) as info:
            check_media(body, LIMITS, decode=False)
        assert info.value.field == field
    with pytest.raises(RequestError, match="cannot decode the audio"):
        check_media(_body(undecodable), LIMITS)
