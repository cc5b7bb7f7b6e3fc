"""A Realtime session's input audio buffer, resampled for the model as it arrives.

The client appends audio/pcm (16-bit mono at :data:`~.vad.INPUT_RATE`); a committed
buffer becomes a user item whose chat part is a WAV at :data:`MODEL_RATE`
(:func:`model_audio_part`). Resampling the whole turn at the commit put soxr's work for
the turn on the path from the end of the turn to the first audio of the answer. The
buffer instead feeds each append to soxr's streaming resampler, so a commit flushes its
last few samples and encodes the WAV (the commit's work for 2.76 s of speech on a 2-core
CPU: 0.75 ms resampled whole, 0.46 ms flushed, most of it libsndfile's WAV and base64).
"""

from __future__ import annotations

import base64

import numpy as np

from vllm_omni_plugin.entrypoints.audio_encoding import encode_audio
from vllm_omni_plugin.entrypoints.realtime.vad import INPUT_RATE, pcm_samples

#: The rate (Hz) the user's audio goes to the model at: Whisper's, which Whisper-style
#: audio encoders such as Qwen3-Omni's take. Resampled here (soxr), so that vLLM's
#: processor has nothing to resample (its default resampler needs torchaudio).
MODEL_RATE = 16000


def model_audio_part(samples: np.ndarray) -> dict:
    """The chat completion part of ``samples`` (float32 at :data:`MODEL_RATE`): an
    ``input_audio`` WAV (16-bit PCM), base64."""
    wav = encode_audio(samples, MODEL_RATE, "wav")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(),
                                                   "format": "wav"}}


def chat_audio_part(pcm: bytes) -> dict:
    """The chat completion part the user's audio ``pcm`` (audio/pcm at
    :data:`~.vad.INPUT_RATE`, all of it at hand) becomes: resampled in one go."""
    import soxr

    return model_audio_part(soxr.resample(pcm_samples(pcm), INPUT_RATE, MODEL_RATE))


class InputAudioBuffer:
    """The input audio buffer: what the client appended since the last commit or clear,
    held at :data:`MODEL_RATE` (soxr's streaming resampler, its high-quality default, fed
    append by append); its length is counted in the client's samples."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Empty the buffer."""
        self._resampler = None
        self._model: list[np.ndarray] = []  # resampled chunks, in order
        self._model_samples = 0  # their samples
        self._samples_in = 0  # samples appended (at INPUT_RATE)
        self._held = 0  # of them, those held (not dropped by keep_last)

    def __len__(self) -> int:
        """The bytes of audio/pcm held."""
        return 2 * self._held

    @property
    def ms(self) -> int:
        """The milliseconds of audio held (rounded down)."""
        return self._held * 1000 // INPUT_RATE

    def append(self, pcm: bytes) -> None:
        """Add ``pcm`` (audio/pcm, whole 16-bit samples) and resample it."""
        self._samples_in += len(pcm) // 2
        self._held += len(pcm) // 2
        out = self._stream().resample_chunk(pcm_samples(pcm))
        if len(out):
            self._model.append(out)
            self._model_samples += len(out)

    def keep_last(self, nbytes: int) -> None:
        """Drop all but the last ``nbytes`` of audio/pcm (and the resampled audio of the
        same span, to the sample: the resampler still holds the last few samples of its
        output, its delay)."""
        self._held = min(self._held, nbytes // 2)
        out = self._samples_in * MODEL_RATE // INPUT_RATE  # all of them, once flushed
        drop = min(self._model_samples, out - nbytes // 2 * MODEL_RATE // INPUT_RATE)
        if drop > 0:
            kept = np.concatenate(self._model)[drop:]
            self._model, self._model_samples = [kept], len(kept)

    def take(self) -> dict:
        """The chat part of the buffer's audio (:func:`model_audio_part`); the buffer is
        empty after."""
        tail = self._stream().resample_chunk(np.zeros(0, np.float32), last=True)
        samples = np.concatenate([*self._model, tail])
        self.clear()
        return model_audio_part(samples)

    def _stream(self):
        if self._resampler is None:
            import soxr

            self._resampler = soxr.ResampleStream(INPUT_RATE, MODEL_RATE, 1, dtype="float32")
        return self._resampler
