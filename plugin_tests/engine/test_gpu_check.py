"""``scripts/gpu_check.sh``'s dry run on vLLM's CPU build (``python -m
plugin_tests.gpu_check --cpu``) in the cases this host can run: the thinker on tensor
parallelism 2 (two worker processes, one core each) and the whole pipeline in bfloat16
(where the CPU computes in it: AVX-512 BF16 or AMX), each on the media requests (an
image, an audio clip), the bfloat16 one also on spoken answers cold and warm from the
prefix cache (``--cases tp2:media bf16:media,prefix``), and the tiny BAGEL pipeline (AR,
then the DiT with CFG) at 64 and 512 px. Every answer is compared with HF transformers
teacher-forced along it (``pipeline_reference.agreement``); the parity requests (alone
and 8 at once), which a GPU run serves too, took the dry run's longest minutes here and
are the float32 pipeline's parity test on every engine row (test_pipeline_engine.py).
BAGEL's images are compared with the CPU's float32 record the GPU run is compared with
(``plugin_tests/fixtures/gpu_check/``): this keeps the record current. Each case must
report the CPU build's modes, and the same reports fail the GPU's expectation.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from plugin_tests.conftest import PYTHON, REPO
from plugin_tests.engine.pipeline_reference import ENGINE_TIMEOUT_S, NEAR_TIES, TALKER_FRAMES
from plugin_tests.helpers import run_process_group

# The dry run (about 400 s of one CI worker) runs on the newest release CI runs engines
# on (`newest_only`): the older releases run the same pipeline in float32
# (test_pipeline_engine.py), and a GPU user runs the newest; CI's 45 minutes did not hold
# it on every row.
pytestmark = [pytest.mark.engine, pytest.mark.newest_only]

#: the media scenario's answers (an image, an audio clip)
MEDIA_ANSWERS = 2


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str]:
    """``(results, report)``: the dry run's JSON results and its printed report."""
    out = tmp_path_factory.mktemp("gpu-check")
    proc = run_process_group(
        [PYTHON, "-m", "plugin_tests.gpu_check", "--cpu", "--cases", "tp2:media",
         "bf16:media,prefix", "bagel", "--allow-skip", "--json",
         str(out / "results.json"), "--out", str(out)],
        timeout=2 * ENGINE_TIMEOUT_S, cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-6000:]}"
    return json.loads((out / "results.json").read_text()), proc.stdout


def _assert_agree(result: dict, answers: int) -> None:
    assert result["answers"] == answers and result["agreed"] == answers, result["problems"]
    # every thinker token and every code of every frame was compared (at least 24
    # frames of 16 codes an answer with speech compared, and the thinker's tokens; the
    # audio clip's answer compares the thinker's tokens only)
    assert result["choices"] >= (answers - 1) * TALKER_FRAMES * 16, result


def test_a_tp2_thinker_speaks_as_hf(dry_run):
    """The thinker on two TP ranks (one publishes), in float32, on the media requests:
    each choice is HF's own or, in the image answer, trails it by less than
    gpu_check.media_near_ties. Before the fix its worker hung on the first audio request
    (the publishing rank alone ran the vocabulary-parallel embedding's all-reduce)."""
    results, report = dry_run
    result = results["tp2"]
    assert result["settings"]["0"]["tensor_parallel_size"] == 2
    assert [s["tensor_parallel_size"] for k, s in result["settings"].items() if k != "0"] \
        == [1, 1]
    _assert_agree(result, MEDIA_ANSWERS)
    assert result["media_choices"] == result["choices"], result  # the media requests only
    assert "tp2   ok" in report


def test_a_bf16_pipeline_speaks_as_hf_within_bf16_rounding(dry_run):
    """Every stage in bfloat16, on the media requests: each choice is HF's own (bfloat16
    too) or trails it by less than bfloat16's near-tie gap for media; the waveform is
    HF's decode of the same codes within bfloat16's rounding. Its spoken answers after a
    long system message (a text turn, an audio turn, a second audio turn), served again
    reading the thinker's prefix cache, are the cold ones (``gpu_check.prefix_problems``:
    thinker tokens and codes equal, the waveform within bfloat16's rounding)."""
    results, report = dry_run
    result = results["bf16"]
    if "skipped" in result:
        pytest.skip(f"bf16 case: {result['skipped']}")
    assert {s["dtype"] for s in result["settings"].values()} == {"bfloat16"}
    _assert_agree(result, MEDIA_ANSWERS)
    assert result["media_choices"] == result["choices"], result  # the media requests only
    ties = NEAR_TIES["bfloat16"]
    assert all(result["worst"][kind] <= getattr(ties, kind) for kind in ties._fields)
    assert result["exact"] >= 0.9 * result["choices"], result  # most choices are HF's
    assert sorted(result["prefix"]) == ["audio", "text", "two_turns"], result["prefix"]
    assert "bf16  ok" in report


def test_bagel_images_equal_the_cpu_float32_record(dry_run):
    """The tiny BAGEL pipeline (AR, then the DiT with CFG and a negative prompt: masked
    attention over contexts of different lengths) draws a 64 px and a 512 px image equal
    to the record the GPU run is compared with, within float32 rounding."""
    from plugin_tests.gpu_check import BAGEL_TOLERANCE

    results, report = dry_run
    result = results["bagel"]
    assert result["answers"] == result["agreed"] == 2, result["problems"]
    assert result["latent_err"] <= BAGEL_TOLERANCE["cpu"].latent
    assert [s["dtype"] for s in result["settings"].values()] == ["float32", "float32"]
    assert "bagel ok: 2/2 images" in report


def test_each_case_reports_the_cpu_builds_modes_and_fails_the_gpus(dry_run):
    """The modes the stages reported are the CPU build's (V1 CPUModelRunner, sync, no
    graphs), what ``--cpu`` requires; judged by the GPU's expectation (what a GPU run
    with a forced V1 runner or sync scheduling reports too) every case fails, naming
    each mode."""
    from plugin_tests.gpu_check import EXPECTED_MODES, case_status, exit_status

    results, report = dry_run
    ran = {name: r for name, r in results.items() if "skipped" not in r}
    assert "modes required (cpu): CPU model runner, async scheduling off" in report
    for name, result in ran.items():
        assert case_status(result, EXPECTED_MODES["cpu"]) == ("ok", []), name
        status, problems = case_status(result, EXPECTED_MODES["gpu"])
        assert status == "FAILED", name
        assert "stage 0 runs the CPU model runner, not V2" in problems, problems
        assert "stage 1 has async scheduling off, not on" in problems, problems
    assert exit_status(ran, EXPECTED_MODES["gpu"]) == 1
