"""Audio input at any common rate and format reaches Qwen3-Omni at 16 kHz (issue 41).

vLLM's loader (``AudioMediaIO``: soundfile, else PyAV) decodes a clip at its own rate;
vLLM's Qwen3-Omni data parser then resamples it to the feature extractor's
``sampling_rate`` with vLLM's ``AudioResampler``, whose default method is torchaudio.
The CPU install used to lack torchaudio, so every clip not at 16 kHz answered HTTP 500;
setup.cfg now requires it. These tests run vLLM's own loader and parser, as the API
server does, on tones encoded in-process.
"""

from __future__ import annotations

import configparser
import importlib
import re
from pathlib import Path

import numpy as np
import pytest

from plugin_tests import media
from vllm_omni_plugin.entrypoints.media_input import MediaLimits, check_media

ROOT = Path(__file__).resolve().parents[2]
#: the rates a client's files come in (telephony, half and full CD, DAT/video)
RATES = (8000, 22050, 44100, 48000)
#: format x rate; Opus itself takes 8, 12, 16, 24 or 48 kHz only (RFC 6716)
CASES = ([(fmt, rate) for fmt in ("wav", "flac", "mp3", "ogg") for rate in RATES]
         + [("opus", 8000), ("opus", 48000)])
#: lossy codecs keep the tone's level to within this fraction
LEVEL_TOL = {"wav": 0.01, "flac": 0.01, "mp3": 0.15, "ogg": 0.15, "opus": 0.15}
#: vLLM's AudioResampler method -> (module it imports, distribution that provides it)
RESAMPLER_LIBRARIES = {"torchaudio": ("torchaudio", "torchaudio"), "soxr": ("soxr", "soxr"),
                       "scipy": ("scipy.signal", "scipy"), "pyav": ("av", "av")}


def _parser():
    """vLLM's Qwen3-Omni data parser as its processing info builds it (``get_data_parser``:
    the Whisper feature extractor's 16 kHz, mono, the vision tower's merge size 2): a
    Qwen3-Omni subclass in vLLM 0.31-0.32, Qwen2.5-Omni's own parser in 0.30 and 0.33."""
    from vllm.model_executor.models import qwen2_5_omni_thinker, qwen3_omni_moe_thinker

    parser = getattr(qwen3_omni_moe_thinker, "Qwen3OmniMoeThinkerMultiModalDataParser",
                     qwen2_5_omni_thinker.Qwen2_5OmniThinkerMultiModalDataParser)
    return parser(spatial_merge_size=2, target_sr=media.AUDIO_RATE, target_channels=1)


def _to_model(samples: np.ndarray, rate: float) -> np.ndarray:
    """What the parser hands the Qwen3-Omni processor for one decoded clip."""
    items = _parser().parse_mm_data({"audio": [(samples, rate)]})
    return np.asarray(items["audio"].get(0))


def _peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


def _decode(data: bytes) -> tuple[np.ndarray, float]:
    from vllm.multimodal.media.audio import AudioMediaIO

    return AudioMediaIO().load_base64("audio/wav", media.b64(data))


@pytest.mark.parametrize("fmt, rate", CASES, ids=[f"{f}-{r}" for f, r in CASES])
def test_clip_reaches_the_model_at_16_khz_with_its_pitch_and_length(fmt, rate):
    """A 1 s 440 Hz tone: decoded at its own rate, then 16,000 samples at 16 kHz whose
    peak is still 440 Hz (a clip passed on at the wrong rate would peak at 440 x 16 kHz /
    rate, e.g. 160 Hz for 44.1 kHz, and have ``rate`` samples)."""
    data = media.audio_bytes(fmt, 1.0, rate)
    samples, native = _decode(data)
    assert native == rate and samples.ndim == 1
    assert abs(samples.shape[0] - rate) <= rate // 100, samples.shape  # within 10 ms
    out = _to_model(samples, native)
    assert out.ndim == 1
    assert abs(out.shape[0] - media.AUDIO_RATE) <= media.AUDIO_RATE // 100, out.shape
    assert abs(_peak_hz(out, media.AUDIO_RATE) - 440.0) <= 2.0
    level = float(np.sqrt(np.mean(out[800:-800] ** 2)))  # away from codec edges
    assert abs(level - 0.3 / np.sqrt(2)) <= LEVEL_TOL[fmt] * 0.3 / np.sqrt(2) + 1e-3, level
    # the API's own check decodes the same clip and takes it
    check_media({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": media.b64(data), "format": fmt}}]}]},
        MediaLimits(max_items={"audio": 1}, max_audio_seconds=2.0))


def test_stereo_44_1_khz_becomes_one_16_khz_channel():
    samples, native = _decode(media.audio_bytes("wav", 0.5, 44100, hz=1000.0, channels=2))
    out = _to_model(samples, native)
    assert native == 44100 and out.ndim == 1 and abs(out.shape[0] - 8000) <= 1
    assert abs(_peak_hz(out, media.AUDIO_RATE) - 1000.0) <= 4.0


def test_16_khz_input_passes_through_unchanged():
    samples = media.tone(0.5)
    assert np.array_equal(_to_model(samples, media.AUDIO_RATE), samples)


def test_the_resampler_vllm_picks_is_installed_and_required():
    """vLLM's Qwen3-Omni parser resamples with its ``AudioResampler`` default method, which
    no vLLM setting changes: that method's library imports here and is one of the plugin's
    own requirements (vLLM's CUDA wheel pins torchaudio, the CPU install does not)."""
    method = _parser().audio_resampler.method
    assert method in RESAMPLER_LIBRARIES, f"vLLM resamples with {method!r}: map its library"
    module, dist = RESAMPLER_LIBRARIES[method]
    importlib.import_module(module)
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    required = {re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0].lower()
                for line in cfg["options"]["install_requires"].splitlines() if line.strip()}
    assert dist in required, f"setup.cfg's install_requires lacks {dist} (vLLM's {method!r})"
