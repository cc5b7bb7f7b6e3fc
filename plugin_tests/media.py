"""Deterministic media for input tests: a tone (WAV), a noise image (PNG), a short video
with sound (MP4), and data URLs of them, as a client would send them."""

from __future__ import annotations

import base64
import io

import numpy as np

#: Qwen3-Omni's audio encoder input rate (WhisperFeatureExtractor ``sampling_rate``).
AUDIO_RATE = 16000


def tone(seconds: float, rate: int = AUDIO_RATE, hz: float = 440.0) -> np.ndarray:
    """``[seconds * rate]`` float32 sine at ``hz``, amplitude 0.3."""
    t = np.arange(int(round(seconds * rate))) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def wav_bytes(seconds: float, rate: int = AUDIO_RATE, subtype: str = "PCM_16") -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, tone(seconds, rate), rate, format="WAV", subtype=subtype)
    return buf.getvalue()


#: ``input_audio.format`` -> (libsndfile container, subtype) of :func:`audio_bytes`.
#: Opus itself takes 8, 12, 16, 24 or 48 kHz only (RFC 6716); Vorbis any rate.
AUDIO_CODECS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"),
                "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS"),
                "ogg": ("OGG", "VORBIS")}


def audio_bytes(fmt: str, seconds: float, rate: int, hz: float = 440.0,
                channels: int = 1) -> bytes:
    """A :func:`tone` at ``rate`` Hz encoded as ``fmt`` (a key of :data:`AUDIO_CODECS`)
    with soundfile (libsndfile >= 1.1 writes MP3 and Ogg/Opus); ``channels`` copies."""
    import soundfile as sf

    container, subtype = AUDIO_CODECS[fmt]
    samples = np.repeat(tone(seconds, rate, hz)[:, None], channels, axis=1)
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=container, subtype=subtype)
    return buf.getvalue()


def noise_image(width: int, height: int, seed: int = 0):
    """An RGB ``PIL.Image`` of uniform noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    noise_image(width, height, seed).save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(frames: int, width: int, height: int, fps: int = 2, audio: bool = True,
              seed: int = 0) -> bytes:
    """A noise video (MPEG-4 part 2 in MP4, written with PyAV), with a 440 Hz AAC track
    as long as the video when ``audio``."""
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        sound = container.add_stream("aac", rate=AUDIO_RATE) if audio else None
        for _ in range(frames):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        container.mux(video.encode())
        if sound is not None:
            samples = tone(frames / fps)[None, :]
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate = AUDIO_RATE
            for packet in sound.encode(frame):
                container.mux(packet)
            container.mux(sound.encode())
    return buf.getvalue()


def b64(data: bytes) -> str:
    """``data`` as base64 text (an ``input_audio.data`` value)."""
    return base64.b64encode(data).decode("ascii")


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{b64(data)}"
