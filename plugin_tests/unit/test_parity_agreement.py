"""How a served answer is compared with HF teacher-forced along it
(``pipeline_reference.agreement``, what ``plugin_tests/gpu_check.py`` reports), on
synthetic logits: each rule alone."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plugin_tests.engine.pipeline_reference import (
    NEAR_TIES,
    TALKER_FRAMES,
    HFSpeech,
    agreement,
    first_near_tie,
)

FRAMES, GROUPS = 3, 16
#: a talker vocabulary of 100 codes below the 1024 ids HF suppresses for code 0, EOS
#: among those (allowed)
VOCAB, EOS, SUPPRESSED = 1124, 1120, 500
TOL = NEAR_TIES["float32"]
MODEL = SimpleNamespace(config=SimpleNamespace(talker_config=SimpleNamespace(
    text_config=SimpleNamespace(vocab_size=VOCAB), codec_eos_token_id=EOS)))


def _peaked(choice: int, size: int = VOCAB) -> torch.Tensor:
    values = torch.zeros(size)
    values[choice] = 1.0
    return values


def _answer(frames=FRAMES):
    """A served answer of ``frames`` frames and HF's logits forced along it, each choice
    HF's own: ``(tokens, codes, waveform, forced)``."""
    tokens = [5, 6, 7]
    codes = np.arange(frames * GROUPS).reshape(frames, GROUPS) % 90
    waveform = np.linspace(-1, 1, 1000, dtype=np.float32)
    code0 = [_peaked(int(codes[t, 0])) for t in range(frames)] + [_peaked(EOS)]
    residual = [[_peaked(int(codes[t, g]), 100) for t in range(frames)]
                for g in range(1, GROUPS)]
    forced = HFSpeech(None, codes.copy(), waveform.copy(), [code0, *residual],
                      [_peaked(token, 10) for token in tokens])
    return tokens, codes, waveform, forced


def _compare(tokens, codes, waveform, forced, atol=1e-5):
    return agreement(tokens, codes, waveform, forced, MODEL, "float32", atol)


def test_an_answer_of_hfs_own_choices_agrees_in_every_choice():
    got = _compare(*_answer())
    # 3 thinker tokens, 3 code-0 choices and the talker's end, 15 codes per frame
    assert got.choices == 3 + FRAMES + 1 + 15 * FRAMES == got.exact
    assert got.problem == "" and got.waveform_err == 0.0


@pytest.mark.parametrize("kind", ["thinker", "code0", "residual"])
def test_a_choice_trailing_hfs_by_less_than_a_near_tie_agrees_and_by_more_does_not(kind):
    tokens, codes, waveform, forced = _answer()
    values = {"thinker": forced.thinker_logits[1], "code0": forced.code_logits[0][1],
              "residual": forced.code_logits[3][2]}[kind]
    served = int(values.argmax())
    values[served + 1] = 1.0 + getattr(TOL, kind) / 2  # HF's own choice is another
    got = _compare(tokens, codes, waveform, forced)
    assert got.problem == "" and got.exact == got.choices - 1
    assert got.worst[kind] == pytest.approx(getattr(TOL, kind) / 2, rel=1e-2)  # float32
    values[served + 1] = 1.0 + getattr(TOL, kind) * 2
    assert f"{kind} choices trail HF's" in _compare(tokens, codes, waveform, forced).problem


def test_code_0_is_compared_after_hfs_mask_and_repetition_penalty():
    tokens, codes, waveform, forced = _answer()
    frame2 = forced.code_logits[0][2]
    frame2[SUPPRESSED] = 5.0  # HF never picks a suppressed id
    frame2[int(codes[0, 0])] = 1.04  # generated at frame 0: 1.04 / 1.05 < 1.0
    got = _compare(tokens, codes, waveform, forced)
    assert got.problem == "" and got.exact == got.choices


def test_the_talker_must_end_where_hf_would():
    tokens, codes, waveform, forced = _answer()
    forced.code_logits[0][FRAMES][int(codes[0, 1])] = 2.0  # HF would speak on
    assert "code0 choices trail HF's by more than 0.001 (index, gap): [(3, 1.0)]" in \
        _compare(tokens, codes, waveform, forced).problem


def test_a_talker_stopped_at_its_frame_limit_makes_no_end_choice():
    tokens, codes, waveform, forced = _answer(TALKER_FRAMES)
    forced.code_logits[0][TALKER_FRAMES][int(codes[0, 1])] = 2.0  # its never-fed choice
    got = _compare(tokens, codes, waveform, forced)
    assert got.problem == "" and got.choices == 3 + TALKER_FRAMES + 15 * TALKER_FRAMES


def test_the_waveform_must_be_hfs_decode_of_the_same_codes():
    tokens, codes, waveform, forced = _answer()
    waveform = waveform.copy()
    waveform[10] += 1e-3
    got = _compare(tokens, codes, waveform, forced)
    assert got.problem.startswith("waveform differs from HF's decode by 1.00e-03")
    assert _compare(tokens, codes, waveform, forced, atol=1e-2).problem == ""
    assert "waveform differs" in _compare(tokens, codes, waveform[:-1], forced).problem


def test_hf_must_have_followed_the_served_answer():
    tokens, codes, waveform, forced = _answer()
    assert "HF forced along 2 thinker tokens made 3 choices" in \
        _compare(tokens[:2], codes, waveform, forced).problem
    assert "HF forced along codes" in \
        _compare(tokens, codes, waveform, forced._replace(codes=codes[:2])).problem


def test_the_first_near_tie_is_the_first_frame_hf_chose_by_a_hairs_breadth():
    """``first_near_tie``: the frame count when every choice is clear; else the first
    frame where code 0 (after HF's mask: a tie among suppressed ids is no choice HF
    could make) or a residual code was chosen by a gap under the float32 near tie."""
    _, codes, _, forced = _answer()
    logits = forced.code_logits
    assert first_near_tie(logits, codes, MODEL) == FRAMES
    logits[0][0][SUPPRESSED:SUPPRESSED + 2] = 9.0  # suppressed: not a choice HF had
    assert first_near_tie(logits, codes, MODEL) == FRAMES
    logits[5][2][int(logits[5][2].argmax()) + 1] = 1.0 - TOL.residual / 2
    assert first_near_tie(logits, codes, MODEL) == 2
    logits[0][1][int(codes[1, 0]) + 1] = 1.0 - TOL.code0 / 2
    assert first_near_tie(logits, codes, MODEL) == 1
    logits[0][1][int(codes[1, 0]) + 1] = 1.0 - TOL.code0 * 2  # a clear choice again
    assert first_near_tie(logits, codes, MODEL) == 2
