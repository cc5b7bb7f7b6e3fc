"""The Realtime API's input audio: server VAD (``entrypoints/realtime/vad.py``, Silero through its
streaming wrapper, fed 24 kHz pcm16 resampled to 16 kHz) and the 24 -> 16 kHz WAV a user
audio item becomes in every later prompt (``realtime.input_audio``: the input audio
buffer resampled as it is appended, and ``chat_audio_part`` for audio at hand).

The speech is the fixture the end-to-end tests send (``fixtures/speech/hello.flac``,
2.76 s of eSpeak NG): where it starts and ends is measured from its samples here (the
first and last above 2 % of full scale), and the detector must find the same bounds,
within its 32 ms windows, whatever the padding and however the audio is cut into
appends. Swapped or wrong rates would move every time by 1.5x."""

from __future__ import annotations

import base64
import io
import itertools

import numpy as np
import pytest
import soundfile as sf

from plugin_tests.realtime_client import RATE, SPEECH, speech_pcm
from vllm_omni_plugin.entrypoints.realtime.vad import (
    INPUT_RATE,
    VAD_RATE,
    WINDOW,
    ServerVad,
    VadParams,
)

#: one Silero window, ms
WINDOW_MS = WINDOW * 1000 // VAD_RATE
#: silence before the speech in :func:`speech_pcm`'s audio, ms
BEFORE_MS = 500


def _speech_bounds_ms() -> tuple[int, int]:
    """The fixture's first and last sample above 2 % of full scale, ms from its start."""
    samples, rate = sf.read(SPEECH, dtype="float32")
    loud = np.nonzero(np.abs(samples) > 0.02)[0]
    return int(loud[0]) * 1000 // rate, int(loud[-1]) * 1000 // rate


def _events(params: VadParams, pcm: bytes, piece_ms: int | None = None,
            onnx: bool | None = None) -> list:
    vad = ServerVad(params, onnx=onnx)
    if piece_ms is None:
        return vad.feed(pcm)
    size = 2 * INPUT_RATE * piece_ms // 1000
    return [e for i in range(0, len(pcm), size) for e in vad.feed(pcm[i:i + size])]


def test_the_realtime_input_rate_is_openais():
    assert INPUT_RATE == RATE == 24000


@pytest.mark.parametrize("onnx", [False, True], ids=["torchscript", "onnx"])
@pytest.mark.parametrize("pad,silence", [(300, 500), (100, 200)])
def test_speech_start_and_stop_are_where_the_speech_is(pad, silence, onnx):
    """``start`` at the speech's onset less ``prefix_padding_ms``, ``stop`` at its end plus
    it (Silero pads both sides), each within the detector's windows; with Silero's
    TorchScript and ONNX models alike."""
    onset, offset = _speech_bounds_ms()
    events = _events(VadParams(prefix_padding_ms=pad, silence_duration_ms=silence),
                     speech_pcm(before_s=BEFORE_MS / 1000, after_s=1.0), onnx=onnx)
    assert [e.kind for e in events] == ["start", "stop"], events
    start, stop = events[0].ms + pad, events[1].ms - pad
    assert BEFORE_MS + onset - WINDOW_MS <= start <= BEFORE_MS + onset + 2 * WINDOW_MS, events
    assert BEFORE_MS + offset - WINDOW_MS <= stop <= BEFORE_MS + offset + 3 * WINDOW_MS, events


def test_appends_of_any_size_find_what_one_append_finds():
    """The resampler and the detector keep their state between appends: 37 ms pieces (not
    a multiple of a window, nor of the resampler's ratio) give the same events."""
    pcm = speech_pcm(before_s=BEFORE_MS / 1000, after_s=1.0)
    whole = _events(VadParams(), pcm)
    assert _events(VadParams(), pcm, piece_ms=37) == whole
    assert _events(VadParams(), pcm, piece_ms=100) == whole


def test_the_onnx_model_runs_where_onnxruntime_is_and_decides_as_torchscript():
    """With ``onnxruntime`` installed (the test extra has it) a session's detector runs
    Silero's ONNX model, and finds the events TorchScript finds, fed in 100 ms appends."""
    assert ServerVad(VadParams()).backend == "onnx"
    assert ServerVad(VadParams(), onnx=False).backend == "torchscript"
    pcm = speech_pcm(before_s=BEFORE_MS / 1000, after_s=1.0)
    assert _events(VadParams(), pcm, 100, onnx=True) == _events(VadParams(), pcm, 100,
                                                                onnx=False)


def test_silence_is_no_speech_and_a_stop_waits_for_enough_of_it():
    assert _events(VadParams(), bytes(2 * INPUT_RATE * 2)) == []
    vad = ServerVad(VadParams(silence_duration_ms=500))
    # 0.3 s of silence after the speech: too short to end it
    assert [e.kind for e in vad.feed(speech_pcm(before_s=0.5, after_s=0.3))] == ["start"]
    assert [e.kind for e in vad.feed(bytes(2 * INPUT_RATE // 2))] == ["stop"]


def test_a_user_audio_item_becomes_a_16_khz_wav_of_the_same_sound():
    """A 1 kHz tone of 1 s at 24 kHz: the WAV of its chat part is at 16 kHz, 1 s long, and
    its strongest frequency is still 1 kHz (rates swapped, it would be 1.5 s and 667 Hz)."""
    from vllm_omni_plugin.entrypoints.realtime.input_audio import MODEL_RATE, chat_audio_part

    wav, rate = _wav_of(chat_audio_part(_tone_pcm(1.0)))
    assert rate == MODEL_RATE == 16000
    assert abs(len(wav) - MODEL_RATE) <= 1, len(wav)
    spectrum = np.abs(np.fft.rfft(wav))
    assert np.argmax(spectrum) * rate / len(wav) == pytest.approx(1000, abs=2)


def test_the_input_audio_buffer_resampled_as_appended_equals_the_turn_resampled_whole():
    """Appends of uneven sizes, resampled as they come (soxr's streaming resampler), give
    the WAV of the whole turn resampled at once: the same length and the same samples
    (to 16-bit rounding); a clear empties it, and with VAD's trimming only the last span
    of audio is kept, as long at 16 kHz as at 24 kHz."""
    from vllm_omni_plugin.entrypoints.realtime.input_audio import (
        MODEL_RATE,
        InputAudioBuffer,
        chat_audio_part,
    )

    pcm = _tone_pcm(1.3)
    whole, _ = _wav_of(chat_audio_part(pcm))
    buffer = InputAudioBuffer()
    buffer.append(_tone_pcm(0.2))
    buffer.clear()
    cut = [0, 2, 962, 4800, 4802, 17000, len(pcm)]  # bytes: whole samples
    for begin, end in itertools.pairwise(cut):
        buffer.append(pcm[begin:end])
    assert len(buffer) == len(pcm) and buffer.ms == 1300
    streamed, rate = _wav_of(buffer.take())
    assert rate == MODEL_RATE and len(buffer) == 0
    assert len(streamed) == len(whole)
    assert np.max(np.abs(streamed - whole)) <= 2 / 32768

    buffer.append(pcm)
    buffer.keep_last(2 * INPUT_RATE // 2)  # the last 0.5 s
    assert buffer.ms == 500
    kept, _ = _wav_of(buffer.take())
    assert abs(len(kept) - MODEL_RATE // 2) <= 1, len(kept)


def _tone_pcm(seconds: float) -> bytes:
    """A 1 kHz tone at half scale, audio/pcm at 24 kHz."""
    t = np.arange(int(seconds * INPUT_RATE)) / INPUT_RATE
    return (0.5 * np.sin(2 * np.pi * 1000 * t) * 32767).astype("<i2").tobytes()


def _wav_of(part: dict) -> tuple[np.ndarray, int]:
    """The samples and rate of an ``input_audio`` WAV chat part."""
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    return sf.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])),
                   dtype="float32")
