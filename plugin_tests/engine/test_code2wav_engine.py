"""The code2wav stage on vLLM's own worker and model runner, waveform for waveform against HF.

A child process (``scripts/code2wav_generate.py``) runs engines of the code2wav stage
architecture (``OmniPluginQwen3OmniCode2Wav``) on the plugin's ``OmniWorker``, publishing
into a payload store. Meanwhile the test process computes Hugging Face's own waveforms
with ``Qwen3OmniMoeForConditionalGeneration.code2wav.chunked_decode(codes, chunk_size=300,
left_context_size=25)`` (what HF ``generate`` runs). The ``default`` engine (the stage's
settings: chunked prefill off) serves

* batch 0: requests of 5, 17, 40 and 650 frames (650: three of HF's 300-frame chunks,
  two with left context) and two malformed prompts, all in one ``generate`` call;
* batches 1-4: each well-formed request alone;
* batch 5: the 40-frame request as the chunks of a streamed request (:data:`CHUNKS`: 15
  frames after up to 25 frames of left context, input payload ``left_context``) with no
  stream state (what a chunk whose previous one ran on another replica gets);
* batches 6-8: two streams at once (input payload ``stream``): the 40-frame request in
  :data:`CHUNKS` and the 17-frame one in :data:`CHUNKS_17`, chunk ``i`` of both in batch
  ``6 + i``, each engine continuing its streams' state.

Checked: every waveform equals HF's, batched equals alone, the batch ran as one engine
step, each malformed prompt fails only its own request with its error in the store, and
the streamed chunks, joined, are HF's waveform of the whole request (no gap at the chunk
boundaries, where HF's own chunked loop drops the samples a decode cannot end with):
with the stream's state as exactly as the request decoded at once, without it within
the left context's reach; the engine holds no stream state after the last chunks.
vLLM's engine core turns chunked prefill off for a model without KV cache, so a prompt
never reaches the model split; the model's guard against it is probed inside the engine
(``probe_model`` in the script): a split prompt fails alone with an error that says so.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from plugin_tests.helpers import process_group, script_report

#: `newest_only`: on the oldest release CI runs engines on, the whole pipeline's engine
#: test serves code2wav (waveforms equal HF's decode, streamed chunks); CI's 45 minutes
#: did not hold this module's engine run there too.
pytestmark = [pytest.mark.engine, pytest.mark.newest_only]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "code2wav_generate.py"
#: the checkout under test, importable in the child even where the installed plugin is
#: another checkout
REPO = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = 900

#: Frames per well-formed request; 650 > 2 * HF's chunk size of 300.
FRAMES = (5, 17, 40, 650)
#: float32 end to end, same operations as HF up to the order of float additions
#: (vLLM's fused linear layers, RMSNorm and rotary kernels, padded batches): differences
#: are a few float32 ulps of the waveform (peak ~0.18 on the tiny checkpoint).
ATOL_HF = 1e-5
#: A padded batch runs the same operations as a request alone on other GEMM shapes.
ATOL_BATCH = 1e-6
#: Chunks of the 40-frame request as the orchestrator sends them for a streamed request
#: with ``streaming: {chunk_size: 15, left_context: 25}``: (first frame, end, context).
CHUNKS = ((0, 15, 0), (15, 30, 15), (30, 40, 25))
#: Streamed chunks without their stream's state see at most 25 earlier frames (the last
#: one not all 30); measured on the tiny checkpoint: 1.5e-6 from the whole decode.
ATOL_STREAM = 1e-4
#: Chunks of the 17-frame request, the second stream of batches 6-8.
CHUNKS_17 = ((0, 5, 0), (5, 17, 5))
#: max_model_len and token budget: the longest prompt, and the whole batch in one step.
MAX_TOKENS_PER_STEP = 16 * 1024

BAD_LENGTH = "length"  # 37 ids: not a multiple of num_quantizers (16)
BAD_ORDER = "order"    # frame 0's first two ids swapped: quantizer 1's id at position 0


def _codes():
    import torch

    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 2048, (t, 16), generator=g) for t in FRAMES]


def _chunk(codes, begin: int, end: int, context: int, config, stream: str | None = None,
           chunks=()) -> dict:
    """The prompt of a chunk of a streamed request (``codes[begin:end]`` after ``context``
    frames); with ``stream``, its input payload ``stream`` (the last of ``chunks``?), and
    other codes as its context frames: an engine that continues the stream's state must
    not decode them again."""
    from vllm_omni_plugin.models.qwen3_omni.code2wav import code2wav_prompt_ids, stream_key

    frames = codes[begin - context:end].clone()
    prompt = {"left_context": context}
    if stream is not None:
        frames[:context] = (frames[:context] + 7) % 2048
        prompt["stream"] = [stream_key(stream), begin, int(end == chunks[-1][1])]
    prompt["ids"] = code2wav_prompt_ids(frames, config)
    return prompt


def _child_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the child: steps observable
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_omni):
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_qwen3_omni, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runs(tiny_qwen3_omni, hf_model, tmp_path_factory):
    """``{"result": the script's output, "store": PayloadStore, "hf": [waveform per
    FRAMES], "prompts": batch 0's prompts, "kinds": what each of them is}``.

    The engine script and HF's decoding run concurrently.
    """
    import torch

    from vllm_omni_plugin.models.qwen3_omni.code2wav import code2wav_prompt_ids
    from vllm_omni_plugin.payload_store import PayloadStore

    config = hf_model.config
    codes = _codes()
    good = [code2wav_prompt_ids(c, config) for c in codes]
    bad_order = list(good[0])
    bad_order[0], bad_order[1] = bad_order[1], bad_order[0]
    prompts = [good[0], good[0][:37], good[1], good[2], bad_order, good[3]]
    kinds = [0, BAD_LENGTH, 1, 2, BAD_ORDER, 3]  # index into FRAMES, or the defect
    logdir = tmp_path_factory.mktemp("code2wav")
    spec = {
        "model": tiny_qwen3_omni,
        "payload_dir": str(logdir / "payloads"),
        "engines": [
            {"name": "default",
             "engine_args": {"max_model_len": MAX_TOKENS_PER_STEP,
                             "max_num_batched_tokens": MAX_TOKENS_PER_STEP},
             "batches": [prompts] + [[p] for p in good] + [[
                 _chunk(codes[2], *chunk, config) for chunk in CHUNKS]] + [
                 [_chunk(codes[2], *CHUNKS[i], config, "stream-40", CHUNKS)]
                 + ([_chunk(codes[1], *CHUNKS_17[i], config, "stream-17", CHUNKS_17)]
                    if i < len(CHUNKS_17) else [])
                 for i in range(len(CHUNKS))],
             "probe": True},
        ],
    }
    (logdir / "spec.json").write_text(json.dumps(spec))  # too long for one argv string
    with open(logdir / "spec.json") as stdin, open(logdir / "engine.out", "w") as out, \
            open(logdir / "engine.err", "w") as err, \
            process_group([sys.executable, str(SCRIPT)], stdin=stdin, stdout=out, stderr=err,
                          text=True, env=_child_env()) as proc:
        with torch.inference_mode():
            hf = [hf_model.code2wav.chunked_decode(c.T.unsqueeze(0), chunk_size=300,
                                                   left_context_size=25).reshape(-1).float()
                  for c in codes]
        proc.wait(timeout=ENGINE_TIMEOUT_S)
    result = script_report(SCRIPT, proc.returncode, (logdir / "engine.out").read_text(),
                           (logdir / "engine.err").read_text())["engines"]
    return {"engines": result, "store": PayloadStore(spec["payload_dir"]), "hf": hf,
            "prompts": prompts, "kinds": kinds}


def _engine(runs, name: str = "default") -> dict:
    result = runs["engines"][name]
    if "error" in result:
        pytest.fail(f"engine {name!r} failed:\n{result['error']}")
    return result


def _waveform(runs, batch: int, index: int, engine: str = "default"):
    import torch

    key = _engine(runs, engine)["batches"][batch]["keys"][index]
    assert runs["store"].error(key) is None, runs["store"].error(key)
    payload = runs["store"].get(key)
    assert set(payload) == {"waveform", "sample_rate"}, sorted(payload)
    assert payload["waveform"].dtype == torch.float32 and payload["waveform"].dim() == 1
    assert payload["sample_rate"].dtype == torch.int64
    assert payload["sample_rate"].tolist() == [24000]
    return payload["waveform"]


def test_waveforms_equal_hf(runs):
    """Each request served alone equals HF's chunked decode of its codes."""
    import torch

    for i, frames in enumerate(FRAMES):
        got, want = _waveform(runs, 1 + i, 0), runs["hf"][i]
        assert got.shape == want.shape, (frames, got.shape, want.shape)
        torch.testing.assert_close(got, want, atol=ATOL_HF, rtol=0,
                                   msg=lambda m, f=frames: f"{f} frames: {m}")
        assert want.abs().max() > 0.01  # the tiny checkpoint makes audible-scale output


def test_batched_requests_equal_each_alone(runs):
    """The batch ran as one engine step; each of its waveforms equals its solo run and HF."""
    import torch

    result = _engine(runs)
    prompts = runs["prompts"]
    assert result["steps"] is not None, "steps are observed in-process only"
    assert [len(prompts), sum(map(len, prompts))] in result["steps"], result["steps"]
    for index, kind in enumerate(runs["kinds"]):
        if isinstance(kind, int):
            batched, alone = _waveform(runs, 0, index), _waveform(runs, 1 + kind, 0)
            torch.testing.assert_close(batched, alone, atol=ATOL_BATCH, rtol=0)
            torch.testing.assert_close(batched, runs["hf"][kind], atol=ATOL_HF, rtol=0)


@pytest.mark.parametrize("kind,message", [(BAD_LENGTH, "not a positive multiple of 16"),
                                          (BAD_ORDER, "quantizer 0")])
def test_malformed_prompt_fails_only_its_request(runs, kind, message):
    """A malformed prompt fails its own request (error in the store, no waveform); the
    other requests of the batch succeed (test_batched_requests_equal_each_alone)."""
    batch = _engine(runs)["batches"][0]
    index = runs["kinds"].index(kind)
    key = batch["keys"][index]
    error = runs["store"].error(key)
    assert error is not None and "ValueError" in error and message in error, error
    assert batch["finished"][index]
    assert all(batch["finished"])
    for other, k in enumerate(runs["kinds"]):
        if isinstance(k, int):
            assert runs["store"].error(batch["keys"][other]) is None


def test_split_prompt_fails_only_its_request(runs):
    """Rows of a prompt split over steps fail that request with an error naming the
    setting; a whole prompt in the same step is decoded. Outside a step (vLLM's dummy
    runs) the forward returns zeros and decodes nothing; logits are ``[n, 16 * 2048]``."""
    probe = _engine(runs)["probe"]
    assert set(probe["failures"]) == {"split-first", "split-rest"}, probe
    assert all("enable_chunked_prefill: false" in e for e in probe["failures"].values())
    assert set(probe["outputs"]) == {"whole"}, probe
    assert probe["hidden"] == [128, 1] and probe["dummy"] == [208, 1] and probe["dummy_zero"]
    assert probe["dummy_outputs"] == 0
    assert probe["logits"] == [2, 16 * 2048]


def test_memory_profile_decodes_the_largest_batch_of_a_step(runs):
    """vLLM profiles the memory of engines with a KV cache only (``EngineCore.
    _initialize_kv_caches`` calls ``determine_available_memory`` then), and code2wav has
    none: the worker profiles it in ``compile_or_warm_up_model``, which vLLM's start-up
    calls for every engine. There the model decodes the largest padded batch a step of
    ``MAX_TOKENS_PER_STEP`` ids makes (1024 frames: 3 rows of HF's 325-frame chunk with
    context), so its peak is counted (review 2, N3: in a served engine nothing ran; the
    test called the method itself). vLLM's profiling forward outside it decodes nothing;
    vLLM's CPU build has no device memory to measure."""
    profile = _engine(runs)["probe"]["memory_profile"]
    assert profile["startup"] == {"decoder": [[3, 325, 16]]}
    assert profile["vllm_profiled"] is False
    record = profile["record"]
    assert record is not None and record["stage_id"] == 2, record
    assert record["model"] == "Qwen3OmniCode2WavStage" and record["peak_bytes"] is None
    assert profile["outside"] == {} and profile["after"] is False


def test_prompt_ids_round_trip_and_errors(hf_model):
    import torch

    from vllm_omni_plugin.models.qwen3_omni.code2wav import (
        code2wav_prompt_ids,
        codes_from_prompt_ids,
    )

    config = hf_model.config
    codes = _codes()[1]
    ids = code2wav_prompt_ids(codes, config)
    assert len(ids) == 16 * codes.shape[0]
    assert ids[:3] == [int(codes[0, 0]), 2048 + int(codes[0, 1]), 4096 + int(codes[0, 2])]
    assert max(ids) < 16 * 2048
    assert torch.equal(codes_from_prompt_ids(torch.tensor(ids), config), codes)
    for bad, message in [(codes[:, :15], r"\[T >= 1, 16\]"), (codes[:0], r"\[T >= 1, 16\]"),
                         (codes.float(), "integers"), (codes + 2048, r"\[0, 2048\)"),
                         (codes - 5000, r"\[0, 2048\)")]:
        with pytest.raises(ValueError, match=message):
            code2wav_prompt_ids(bad, config)
    with pytest.raises(ValueError, match="multiple of 16"):
        codes_from_prompt_ids(torch.tensor(ids[:-1]), config)


def test_streamed_chunks_without_state_join_into_the_whole_waveform(runs):
    """The chunks of a streamed request with no stream state (``left_context`` input
    only), joined, have the samples of the request decoded at once: the same count,
    values within :data:`ATOL_STREAM`."""
    import torch

    pieces = [_waveform(runs, 1 + len(FRAMES), i) for i in range(len(CHUNKS))]
    joined, whole = torch.cat(pieces), runs["hf"][FRAMES.index(40)]
    assert joined.shape == whole.shape
    torch.testing.assert_close(joined, whole, atol=ATOL_STREAM, rtol=0)
    # the first chunk has all its history: HF's samples up to float noise
    torch.testing.assert_close(pieces[0], whole[:pieces[0].shape[0]], atol=ATOL_HF, rtol=0)


def test_streamed_chunks_continuing_their_state_join_into_the_whole_waveform(runs):
    """Two streams at once, each chunk continuing its stream's state (its left context
    frames are other codes, not decoded again): joined, each is its request decoded at
    once up to float rounding (:data:`ATOL_HF`); the chunks of one step ran as one engine
    step; no state is left after the last chunks."""
    import torch

    first = 2 + len(FRAMES)
    for frames, chunks, row in ((40, CHUNKS, 0), (17, CHUNKS_17, 1)):
        joined = torch.cat([_waveform(runs, first + i, row) for i in range(len(chunks))])
        whole = runs["hf"][FRAMES.index(frames)]
        assert joined.shape == whole.shape, frames
        torch.testing.assert_close(joined, whole, atol=ATOL_HF, rtol=0,
                                   msg=lambda m, f=frames: f"{f} frames: {m}")
    result = _engine(runs)
    tokens = 16 * sum(end - begin + context for begin, end, context in (CHUNKS[1], CHUNKS_17[1]))
    assert [2, tokens] in result["steps"], result["steps"]
    assert result["streams"] == 0
