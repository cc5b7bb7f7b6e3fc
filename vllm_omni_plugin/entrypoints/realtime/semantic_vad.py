"""Semantic turn detection for the Realtime API (``turn_detection: semantic_vad``).

Silero VAD (:class:`~.vad.ServerVad`, :data:`PAUSE_MS` of silence) finds the pauses in
the user's speech; at each pause an end-of-turn model reads the audio and says whether
the user has finished. A finished turn ends at the pause; otherwise the detector waits
for more speech (the same turn goes on) or for the pause to reach the session's
``eagerness`` limit, and then ends the turn there anyway.

The model is Pipecat's smart-turn v3.2 (BSD-2-Clause): a Whisper-tiny-sized audio
encoder with a one-logit head, 8.7 MB of ONNX, shipped inside the ``pipecat-ai`` wheel
(``pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx``; nothing of Pipecat is
imported, only the file is read) and run on the CPU with ``onnxruntime``. It takes the
last :data:`MODEL_SECONDS` of 16 kHz audio (zero-padded in front) as Whisper log-mel
features (80 bins, 10 ms hop: transformers' ``WhisperFeatureExtractor`` with
``chunk_length=8``, ``do_normalize``, as smart-turn was trained) and returns the
probability that the turn is complete.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from vllm_omni_plugin.entrypoints.realtime.vad import VAD_RATE, ServerVad, VadEvent, VadParams
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: The package that carries the model, and the file's path inside it.
MODEL_PACKAGE = "pipecat"
MODEL_FILE = "audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
#: How to install what the model needs (Pipecat without its own dependencies: only its
#: model file is read).
INSTALL = "pip install onnxruntime && pip install --no-deps pipecat-ai"
#: Seconds of audio the model reads (smart-turn v3's input window).
MODEL_SECONDS = 8
#: A probability at or above this ends the turn (smart-turn's own cut).
COMPLETE = 0.5
#: Silence (ms) after which the model is asked.
PAUSE_MS = 200
#: ``eagerness`` -> the longest pause (ms) the model can hold a turn open: OpenAI's
#: documented maximum timeouts of ``semantic_vad`` (low 8 s, medium 4 s, high 2 s;
#: ``auto`` is ``medium``).
MAX_PAUSE_MS = {"low": 8000, "medium": 4000, "high": 2000, "auto": 4000}


def model_path() -> str:
    """The smart-turn ONNX file in the installed ``pipecat-ai`` package.

    Raises:
        RuntimeError: ``onnxruntime`` or ``pipecat-ai`` is not installed, or the file is
            missing (the message says how to install them).
    """
    specs = {name: importlib.util.find_spec(name) for name in ("onnxruntime", MODEL_PACKAGE)}
    missing = [name for name, spec in specs.items() if spec is None]
    if missing:
        raise RuntimeError(f"semantic_vad needs {' and '.join(missing)} ({INSTALL})")
    root = list(specs[MODEL_PACKAGE].submodule_search_locations)[0]
    path = os.path.join(root, MODEL_FILE)
    if not os.path.isfile(path):
        raise RuntimeError(f"semantic_vad needs smart-turn v3.2 at {path}, which the "
                           f"installed pipecat-ai lacks ({INSTALL})")
    return path


class EndOfTurnModel:
    """smart-turn v3.2 on the CPU (one thread).

    Raises:
        RuntimeError: from :func:`model_path`.
    """

    def __init__(self) -> None:
        import onnxruntime
        from transformers import WhisperFeatureExtractor

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            model_path(), sess_options=options, providers=["CPUExecutionProvider"])
        self._features = WhisperFeatureExtractor(chunk_length=MODEL_SECONDS)

    def probability(self, audio: np.ndarray) -> float:
        """The probability (0-1) that the speaker has finished at the end of ``audio``
        (float32 mono at 16 kHz, -1..1; its last :data:`MODEL_SECONDS` are read)."""
        size = MODEL_SECONDS * VAD_RATE
        window = np.zeros(size, dtype=np.float32)
        tail = audio[-size:]
        window[size - len(tail):] = tail
        features = self._features(window, sampling_rate=VAD_RATE, return_tensors="np",
                                  do_normalize=True).input_features
        (logit,) = self._session.run(None, {"input_features": features.astype(np.float32)})
        return float(logit.reshape(-1)[0])  # the exported head ends in a sigmoid


class SemanticVad:
    """The start and the end of each user turn in one session's input audio, fed as it
    arrives: the interface of :class:`~.vad.ServerVad`.

    Args:
        eagerness: a key of :data:`MAX_PAUSE_MS`.

    Raises:
        RuntimeError: from :func:`model_path`.
    """

    def __init__(self, eagerness: str) -> None:
        # server_vad's default prefix padding: audio kept before the detected start
        self.params = VadParams(silence_duration_ms=PAUSE_MS)
        self.max_pause_ms = MAX_PAUSE_MS[eagerness]
        self._model = EndOfTurnModel()
        self._pauses = ServerVad(self.params, history_s=MODEL_SECONDS)
        self._pause: VadEvent | None = None  # a pause the model judged mid-turn

    def feed(self, pcm16: bytes) -> list[VadEvent]:
        """Detect in ``pcm16`` (see :meth:`~.vad.ServerVad.feed`): a ``start`` when a turn
        begins, a ``stop`` (at the pause) when it is over."""
        events = []
        for found in self._pauses.feed(pcm16):
            if found.kind == "start":
                if self._pause is None:
                    events.append(found)
                self._pause = None  # the same turn goes on
                continue
            done = self._model.probability(self._pauses.audio_until(found.ms))
            logger.debug("semantic_vad: pause at %d ms, end of turn %.2f", found.ms, done)
            if done >= COMPLETE:
                events.append(found)
            else:
                self._pause = found
        if self._pause is not None and self._pauses.fed_ms() - self._pause.ms \
                >= self.max_pause_ms:
            events.append(self._pause)
            self._pause = None
        return events
