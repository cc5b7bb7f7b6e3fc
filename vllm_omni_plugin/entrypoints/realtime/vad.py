"""Server voice activity detection for the Realtime API (``turn_detection: server_vad``).

The detector is Silero VAD (the ``silero-vad`` package, which ships its model, about
2 MB, as TorchScript and as ONNX: a network scoring 32 ms windows of 16 kHz audio with the
probability of speech), through the package's own streaming wrapper ``VADIterator``. The
ONNX model runs where ``onnxruntime`` is installed (the plugin's ``semantic-vad`` extra):
on a 2-core CPU it takes about 0.2 ms of CPU a window against 0.7-0.85 ms for TorchScript
(3.3 s of speech: 23 ms against 74-107 ms), the same decisions; TorchScript otherwise.
OpenAI's ``server_vad`` parameters map onto it:

* ``threshold`` (0-1, default 0.5): a window with a speech probability at or above it is
  speech; speech ends after windows below ``threshold - 0.15`` (Silero's hysteresis);
* ``silence_duration_ms`` (default 500): how long such silence lasts before the speech
  is over (Silero's ``min_silence_duration_ms``);
* ``prefix_padding_ms`` (default 300): audio kept before the detected start, and after
  the end (Silero's ``speech_pad_ms``, which pads both sides).

The session's input audio is 16-bit PCM at :data:`INPUT_RATE`; it is resampled to
16 kHz with ``soxr`` (a streaming resampler, so windows join without clicks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The Realtime API's ``audio/pcm`` input rate (Hz): OpenAI's, 24 kHz mono 16-bit.
INPUT_RATE = 24000
#: Silero VAD's rate (Hz) and window (samples): 32 ms.
VAD_RATE = 16000
WINDOW = 512


def pcm_samples(pcm: bytes) -> np.ndarray:
    """audio/pcm (16-bit little-endian) as float32 samples in [-1, 1)."""
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


@dataclass(frozen=True)
class VadParams:
    """OpenAI's ``server_vad`` turn detection parameters (see the module docstring)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500


@dataclass(frozen=True)
class VadEvent:
    """Speech began (``kind`` ``"start"``) or ended (``"stop"``) at ``ms``, milliseconds
    from the start of the session's input audio."""

    kind: str
    ms: int


class ServerVad:
    """Speech start and stop in one session's input audio, fed as it arrives.

    Args:
        params: the session's ``turn_detection`` parameters.
        history_s: seconds of the latest 16 kHz audio kept for :meth:`audio_until`.
        onnx: run Silero's ONNX model (True) or its TorchScript one (False); None: ONNX
            where ``onnxruntime`` is installed.

    Raises:
        ImportError: ``silero-vad`` or ``soxr`` is not installed (both are requirements
            of the plugin), or ``onnx`` is True without ``onnxruntime``.
    """

    def __init__(self, params: VadParams, history_s: float = 0.0,
                 onnx: bool | None = None) -> None:
        import importlib.util

        import soxr
        from silero_vad import VADIterator, load_silero_vad

        self.params = params
        if onnx is None:
            onnx = importlib.util.find_spec("onnxruntime") is not None
        #: which of Silero's models runs: ``"onnx"`` or ``"torchscript"``
        self.backend = "onnx" if onnx else "torchscript"
        # the model keeps its recurrent state per stream: one per session
        self._iterator = VADIterator(
            load_silero_vad(onnx=onnx), threshold=params.threshold, sampling_rate=VAD_RATE,
            min_silence_duration_ms=params.silence_duration_ms,
            speech_pad_ms=params.prefix_padding_ms)
        self._resampler = soxr.ResampleStream(INPUT_RATE, VAD_RATE, 1, dtype="float32")
        self._pending = np.zeros(0, dtype=np.float32)  # 16 kHz samples short of a window
        self._history = np.zeros(0, dtype=np.float32)  # the latest detected samples
        self._keep = int(history_s * VAD_RATE)
        self._detected = 0  # samples through the detector

    def fed_ms(self) -> int:
        """Milliseconds of audio through the detector (the time base of its events)."""
        return self._detected * 1000 // VAD_RATE

    def audio_until(self, ms: int) -> np.ndarray:
        """The kept audio (float32 at :data:`VAD_RATE`) up to ``ms`` (clamped to what
        went through the detector)."""
        end = len(self._history) - max(0, self._detected - ms * VAD_RATE // 1000)
        return self._history[:max(0, end)]

    def feed(self, pcm16: bytes) -> list[VadEvent]:
        """Detect in ``pcm16`` (little-endian 16-bit mono at :data:`INPUT_RATE`, the
        samples that follow the ones fed before); the starts and stops found, in order."""
        import torch

        resampled = self._resampler.resample_chunk(pcm_samples(pcm16))
        audio = np.concatenate([self._pending, resampled])
        events = []
        whole = len(audio) - len(audio) % WINDOW
        for begin in range(0, whole, WINDOW):
            found = self._iterator(torch.from_numpy(audio[begin:begin + WINDOW]))
            if not found:
                continue
            kind = "start" if "start" in found else "stop"
            events.append(VadEvent(kind, int(found.get("start", found.get("end"))) * 1000
                                   // VAD_RATE))
        self._pending = audio[whole:]
        self._detected += whole
        if self._keep:
            self._history = np.concatenate([self._history, audio[:whole]])[-self._keep:]
        return events
