"""Audio output formats: a waveform encoded for an HTTP answer.

Encoding is libsndfile's, through ``soundfile`` (its wheels bundle libsndfile 1.2 with
FLAC, Ogg/Opus and MPEG layer III), ``pcm16`` included (libsndfile's headerless ``RAW``
container), so its samples are the WAV's samples.

==========  ==========================================  ==============
format      bytes                                       media type
==========  ==========================================  ==============
``wav``     RIFF WAVE, 16-bit PCM, mono                 ``audio/wav``
``pcm16``   raw little-endian 16-bit PCM, mono, no      ``audio/pcm``
            header (OpenAI's ``pcm16``)
``flac``    FLAC, 16 bit, mono                          ``audio/flac``
``mp3``     MPEG-1/2 layer III, mono                    ``audio/mpeg``
``opus``    Ogg Opus, mono                              ``audio/ogg``
==========  ==========================================  ==============

Opus takes 8, 12, 16, 24 or 48 kHz; Qwen3-Omni's code2wav writes 24 kHz.

An answer with no speech (a reply too short to speak) is 0 samples. WAV and ``pcm16`` hold
that; libsndfile writes no readable FLAC, MP3 or Ogg file of 0 frames (0 bytes, or a
malformed stream), so those get one sample of silence.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AudioFormat:
    """One output format: libsndfile's container and subtype, and the media type of the
    encoded bytes."""

    container: str
    subtype: str
    media_type: str


#: Output formats by the name clients use (OpenAI's chat ``audio.format`` names).
AUDIO_FORMATS: dict[str, AudioFormat] = {
    "wav": AudioFormat("WAV", "PCM_16", "audio/wav"),
    "pcm16": AudioFormat("RAW", "PCM_16", "audio/pcm"),
    "flac": AudioFormat("FLAC", "PCM_16", "audio/flac"),
    "mp3": AudioFormat("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": AudioFormat("OGG", "OPUS", "audio/ogg"),
}
#: The format of streamed audio deltas (as OpenAI's chat audio streaming).
STREAM_FORMAT = "pcm16"


def encode_audio(samples, sample_rate: int, fmt: str) -> bytes:
    """Encode a mono waveform.

    Args:
        samples: 1-D float array-like ``[num_samples]`` in ``[-1, 1]`` (values outside are
            clipped).
        sample_rate: Hz.
        fmt: a key of :data:`AUDIO_FORMATS`.

    Raises:
        KeyError: ``fmt`` is not a key of :data:`AUDIO_FORMATS`.
        soundfile.LibsndfileError: libsndfile refuses the sample rate for the format.
    """
    spec = AUDIO_FORMATS[fmt]
    import soundfile as sf

    data = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    if data.size == 0 and spec.container not in ("WAV", "RAW"):
        data = np.zeros(1, dtype=np.float32)  # see the module docstring
    buf = io.BytesIO()
    sf.write(buf, data, sample_rate, format=spec.container, subtype=spec.subtype,
             endian="LITTLE" if spec.container == "RAW" else "FILE")
    return buf.getvalue()


def sample_rate_of(payload: dict) -> int:
    """The sample rate (Hz) in a final stage's output payload (``sample_rate`` ``[k]``)."""
    return int(payload["sample_rate"].reshape(-1)[0])
