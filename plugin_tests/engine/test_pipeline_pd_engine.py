"""The Qwen3-Omni pipeline with prefill/decode disaggregation (the built-in pipeline
``qwen3_omni_moe_pd``) and a tight talker engine, driven in-process through
OmniEngineClient: thinker tokens, codec codes and waveforms equal HF's, with the
thinker's KV cache pulled from the prefill engine and the talker chunked and preempted.

One run of the engine script (:func:`tight_run`) serves both parity tests, a second
(:func:`prefix_run`, the shipped talker) the prefill stage's prefix caching; the
pipeline's tests without PD are in test_pipeline_engine.py (a module of its own, so that
`-n 2` runs the two pipelines side by side)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from plugin_tests.conftest import QWEN3_OMNI_PD_YAML, QWEN3_OMNI_YAML
from plugin_tests.engine.pipeline_reference import (
    TALKER_MAX_TOKENS,
    WAVEFORM_ATOL,
    assert_served_equal_hf,
    pipeline_yaml,
    run_script,
    text_reference,
)
from plugin_tests.helpers import inductor_env

#: `newest_only`: on the oldest release CI runs engines on, the PD connector between two
#: thinker engines (test_pd_engine.py) and the pipeline without PD (test_pipeline_engine.py)
#: cover what this run combines; CI's 45 minutes did not hold it on both.
pytestmark = [pytest.mark.engine, pytest.mark.newest_only]


def _pd_installed() -> bool:
    """Whether the plugin's `pd` extra (Mooncake's transfer engine) is installed."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


#: The talker engine of :func:`tight_run`: a 16-token budget (talker prompts of 14-25
#: positions are chunked) and 5 KV blocks of 32 (4 usable; 8 requests of about 50
#: positions need 16), so vLLM preempts and recomputes talker requests.
TIGHT_TALKER = {"max_num_batched_tokens": 16, "max_num_seqs": 8, "block_size": 32,
                "num_gpu_blocks_override": 5, "max_model_len": 128}


@pytest.fixture(scope="module")
def tight_run(tiny_qwen3_omni, tmp_path_factory):
    """One run of the parity scenario on the PD pipeline (built-in ``qwen3_omni_moe_pd``;
    the shipped one where the `pd` extra is not installed) with
    the :data:`TIGHT_TALKER` talker engine: ``(report, OUT_DIR, output)``."""
    out = tmp_path_factory.mktemp("pipeline-tight")
    source = QWEN3_OMNI_PD_YAML if _pd_installed() else QWEN3_OMNI_YAML
    report, output = run_script(
        tiny_qwen3_omni, pipeline_yaml(out, TALKER_MAX_TOKENS, TIGHT_TALKER, source=source),
        out, ("parity",), env=inductor_env())
    return report, out, output


def test_prefill_decode_disaggregation_keeps_parity(tight_run, hf_reference):
    """The PD pipeline (built-in ``qwen3_omni_moe_pd``: the thinker's prefill on its
    own engine, KV cache pulled by the entry engine through OmniMooncakeConnector over
    TCP): text-only and text+audio requests, alone and 8 at once, give HF's thinker tokens,
    talker codes and waveform, as without PD; every request went through the prefill
    stage. (The run's talker is also chunked and preempted: see
    :func:`test_talker_chunked_prefill_and_preemption_keep_parity`.)"""
    pytest.importorskip("mooncake.engine", reason="the plugin's `pd` extra is not installed")
    report, out, _ = tight_run
    served = np.load(out / "served.npz")
    assert_served_equal_hf(report, served, text_reference(report, hf_reference))
    assert report["prefill_requests"] == len(report["thinker_tokens"])  # one per request


def test_talker_chunked_prefill_and_preemption_keep_parity(tight_run, hf_reference):
    """A talker engine with a 16-token budget (talker prompts of 14-25 positions are
    chunked) and 5 KV blocks of 32 (4 usable; 8 requests of about 50 positions need 16): vLLM
    preempts and recomputes talker requests; the codes still equal HF's. (The run is
    also the PD pipeline's, where installed: see :func:`tight_run`.)"""
    report, out, output = tight_run
    resumed = [line for line in output.splitlines() if "resumed after preemption" in line]
    assert resumed, "the talker was never preempted"
    served = np.load(out / "served.npz")
    assert_served_equal_hf(report, served, text_reference(report, hf_reference))


@pytest.fixture(scope="module")
def prefix_run(tiny_qwen3_omni, hf_reference, tmp_path_factory):
    """The prefix-caching scenario (``omni_pipeline.py``: each prompt after a long system
    message, cold then warm) on the built-in ``qwen3_omni_moe_pd``: ``(report, OUT_DIR)``."""
    pytest.importorskip("mooncake.engine", reason="the plugin's `pd` extra is not installed")
    out = tmp_path_factory.mktemp("pipeline-pd-prefix")
    shutil.copytree(hf_reference.media_dir, out / "media")
    report, _ = run_script(
        tiny_qwen3_omni, pipeline_yaml(out, TALKER_MAX_TOKENS, source=QWEN3_OMNI_PD_YAML),
        out, ("prefix",), env=inductor_env())
    return report, out


def test_the_prefill_stage_reads_its_prefix_cache_for_spoken_answers(prefix_run):
    """With PD the prefill stage caches: a spoken answer to a text prompt seen before reads
    at least one block of rows from the prefill stage's row cache (none cold), and its
    thinker tokens, talker codes and waveform equal the cold run's. Prompts with audio are
    prefilled by the decode stage itself (not plain token ids), which does not cache: the
    same answers, no cached block."""
    report, out = prefix_run
    arrays = np.load(out / "prefix.npz")
    for case in ("text", "audio", "two_turns"):
        seen = report["prefix"][case]
        cold, warm = seen["cold"], seen["warm"]
        assert cold["prefill_hit_blocks"] == 0, (case, seen)
        assert warm["prefill_hit_blocks"] >= (1 if case == "text" else 0), (case, seen)
        if case != "text":
            assert warm["prefill_hit_blocks"] == 0 and warm["cached"] == 0, (case, seen)
        assert warm["tokens"] == cold["tokens"], (case, seen)
        np.testing.assert_array_equal(arrays[f"{case}_warm_codes"],
                                      arrays[f"{case}_cold_codes"])
        np.testing.assert_allclose(arrays[f"{case}_warm_waveform"],
                                   arrays[f"{case}_cold_waveform"], atol=WAVEFORM_ATOL)
