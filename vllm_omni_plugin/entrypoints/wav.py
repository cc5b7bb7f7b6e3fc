"""WAV encoding for audio responses (soundfile, 16-bit PCM mono)."""

from __future__ import annotations

import io

import numpy as np


def encode_wav(samples, sample_rate: int) -> bytes:
    """Encode float samples in ``[-1, 1]`` (``[num_samples]``) as a mono 16-bit PCM WAV.

    Args:
        samples: 1-D float array-like; values outside ``[-1, 1]`` are clipped.
        sample_rate: Hz.
    """
    import soundfile as sf

    data = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    buf = io.BytesIO()
    sf.write(buf, data, sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()
