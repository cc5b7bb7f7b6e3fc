"""Semantic turn detection (``entrypoints/realtime/semantic_vad.py``): Silero's pauses,
smart-turn v3.2 from the installed ``pipecat-ai`` wheel (real, on the CPU) deciding at
each whether the turn is over, and ``eagerness`` bounding how long a pause it judged
mid-turn may last.

The speech is the eSpeak NG fixture (``fixtures/speech/hello.flac``, "Hello there. What
is the weather like today?"). On it the model says: the whole sentence is finished
(0.71); cut 1.2 s in, within "What", it is not (0.26)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from plugin_tests.realtime_client import RATE, SPEECH, speech_pcm
from vllm_omni_plugin.entrypoints.realtime import semantic_vad
from vllm_omni_plugin.entrypoints.realtime.semantic_vad import (
    MAX_PAUSE_MS,
    SemanticVad,
)
from vllm_omni_plugin.entrypoints.realtime.vad import VAD_RATE

#: appends of this many ms, as a client streams its microphone
PIECE_MS = 100


def _cut_speech(seconds: float, after_s: float) -> bytes:
    """The fixture's first ``seconds`` (after 0.5 s of silence), then ``after_s`` of
    silence, as 24 kHz pcm16."""
    speech = speech_pcm(before_s=0.5, after_s=0.0)
    return speech[:2 * int((0.5 + seconds) * RATE)] + bytes(2 * int(after_s * RATE))


def _feed(vad: SemanticVad, pcm: bytes) -> list[tuple[int, object]]:
    """Each event with the input audio (ms) fed when it came out."""
    size = 2 * RATE * PIECE_MS // 1000
    found = []
    for begin in range(0, len(pcm), size):
        fed_ms = (begin + size) * 1000 // (2 * RATE)
        found += [(fed_ms, event) for event in vad.feed(pcm[begin:begin + size])]
    return found


def test_a_finished_sentence_ends_the_turn_at_its_pause():
    """Eagerness low (a pause may last 8 s) and yet the turn ends at the first pause
    after the sentence, within a second of its end: the model said finished."""
    found = _feed(SemanticVad("low"), speech_pcm(before_s=0.5, after_s=3.0))
    assert [e.kind for _, e in found] == ["start", "stop"], found
    (_, start), (emitted, stop) = found
    assert 0 < start.ms < 500 < 3000 < stop.ms < 3500, found
    assert emitted - stop.ms < 1000, found


@pytest.mark.parametrize("eagerness", ["high", "medium"])
def test_a_sentence_cut_off_holds_the_turn_open_up_to_the_eagerness_limit(eagerness):
    """Cut within "What": the model says unfinished, and the turn ends only once the
    pause has lasted the eagerness limit (2 s high, 4 s medium), at the pause."""
    limit = MAX_PAUSE_MS[eagerness]
    found = _feed(SemanticVad(eagerness), _cut_speech(1.2, after_s=limit / 1000 + 1.0))
    assert [e.kind for _, e in found] == ["start", "stop"], found
    emitted, stop = found[1]
    assert 1500 < stop.ms < 2100, found  # 0.5 s + 1.2 s of speech + Silero's padding
    assert stop.ms + limit <= emitted < stop.ms + limit + 2 * PIECE_MS, found


def test_speech_after_a_pause_mid_turn_goes_on_with_the_same_turn():
    """Cut within "What", a second of silence (under the 2 s limit), then the whole
    sentence: one turn, ended after the sentence."""
    pcm = _cut_speech(1.2, after_s=1.0) + speech_pcm(before_s=0.0, after_s=3.0)
    found = _feed(SemanticVad("high"), pcm)
    assert [e.kind for _, e in found] == ["start", "stop"], found
    assert found[1][1].ms > 2700 + 2700, found  # after the second sentence


def test_the_model_reads_the_last_eight_seconds():
    """Audio before the last 8 s changes nothing: the sentence alone (zero-padded in
    front) and behind 3 s of loud noise get the same probability, "finished"."""
    model = semantic_vad.EndOfTurnModel()
    fixture, rate = sf.read(SPEECH, dtype="float32")
    assert rate == VAD_RATE
    speech = np.concatenate([np.zeros(6 * rate, np.float32), fixture,
                             np.zeros(rate // 4, np.float32)])
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, 3 * rate).astype(np.float32)
    alone = model.probability(speech)
    assert 0.5 <= alone <= 1.0
    assert model.probability(np.concatenate([noise, speech])) == alone
