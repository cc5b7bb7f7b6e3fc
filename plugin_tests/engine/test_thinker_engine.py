"""The thinker stage on vLLM's own worker and model runner, token for token against HF.

A child process (``scripts/thinker_generate.py``) runs the engine configurations below
one after another: vLLM's ``Qwen3OmniMoeThinkerForConditionalGeneration`` extended by
the plugin (``OmniPluginQwen3OmniThinker``) on the plugin's ``OmniWorker`` (the
platform's own worker plus the stage payload channel). Meanwhile the test process
computes Hugging Face's own greedy tokens with
``Qwen3OmniMoeForConditionalGeneration.thinker.generate``. Each test compares one
scheduler feature's output to HF and checks, from what the scheduler sent the worker,
that the feature was really exercised:

* plain greedy generation (several prompt lengths, decode across block boundaries),
* batching (8 prompts together == each alone),
* chunked prefill (token budget 32, prompts of 71-90 tokens),
* preemption (a KV cache too small for the running requests) and resumption,
  recomputing in chunks,
* the published hidden states (the talker's input) equal HF's, one row per fed
  position, across chunked prefills and recomputes after preemption,
* bad payload keys fail only their own request (on the default engine, after its
  other batches: the engine serves on).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from plugin_tests.helpers import process_group, script_report

#: `newest_only`: on the oldest release CI runs engines on, the whole pipeline's engine
#: test serves the thinker (its greedy tokens, and the talker's codes from the rows it
#: publishes, alone and batched, equal HF's); CI's 45 minutes did not hold this module's
#: engine run there too.
pytestmark = [pytest.mark.engine, pytest.mark.newest_only]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "thinker_generate.py"
ENGINE_TIMEOUT_S = 900

#: Token ids from the tiny tokenizer's BPE range (0..691), no special tokens.
_rng = random.Random(1234)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(0, 692) for _ in range(n)]


# -- scenarios -----------------------------------------------------------------
#: KV cache for the engines that do not set num_gpu_blocks_override.
SMALL_KV = {"kv_cache_memory_bytes": 16 * 1024 * 1024}
#: vLLM's CPU attention takes block sizes in multiples of 32.
BLOCK = 32

# 1 + 3: 8 prompts of different lengths; 24 new tokens cross block boundaries.
BATCH_PROMPTS = [_prompt(n) for n in (3, 11, 17, 25, 31, 33, 40, 47)]
BATCH_NEW = 24

# 2: each prompt is longer than twice the 32-token budget, so vLLM must chunk it; the
# three run concurrently, so chunks of one interleave with decodes of the others
# and start at positions that are not block aligned.
CHUNKED_PROMPTS = [_prompt(n) for n in (71, 80, 90)]
CHUNKED_NEW = 12
CHUNKED_BUDGET = 32

# 4: 4 requests of up to 29 + 40 tokens need 3 blocks of 32 each (12 in all) but the
# cache has 6 usable blocks (7 minus vLLM's null block): the scheduler must preempt
# running requests and resume them later. Without prefix caching a resumed request
# recomputes its prompt and generated tokens, here in chunks (token budget 32).
PREEMPT_PROMPTS = [_prompt(n) for n in (20, 23, 26, 29)]
PREEMPT_NEW = 40
PREEMPT_BLOCKS = 7

# 6: requests whose extra_args carry bad values in the plugin's namespace (the
# API refuses them; this is the worker's own check behind it), then good ones.
POISON_ARGS = [{"omni_plugin_payload": "x"}, {"omni_plugin_payload": {"out": "../escape"}},
               {"omni_plugin_payload": {"bogus": "key"}}, {"omni_plugin_payload": [1, 2]}, None]

#: The default engine's batches: 0, all of BATCH_PROMPTS together; then each alone
#: (ALONE); then the poison batch and the good batch after it (POISON).
ALONE = slice(1, 1 + len(BATCH_PROMPTS))
POISON = slice(ALONE.stop, ALONE.stop + 2)

ENGINES = [
    {
        "name": "default",
        "engine_args": {"enable_prefix_caching": False, **SMALL_KV},
        "batches": [{"prompts": BATCH_PROMPTS, "max_tokens": BATCH_NEW}]
        + [{"prompts": [p], "max_tokens": BATCH_NEW} for p in BATCH_PROMPTS]
        + [{"prompts": [BATCH_PROMPTS[0]] * len(POISON_ARGS), "max_tokens": BATCH_NEW,
            "extra_args": POISON_ARGS},
           {"prompts": [BATCH_PROMPTS[1]], "max_tokens": BATCH_NEW}],
    },
    {
        "name": "chunked",
        "engine_args": {
            "enable_prefix_caching": False,
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": CHUNKED_BUDGET,
            "max_num_seqs": 4,  # vLLM requires max_num_seqs <= max_num_batched_tokens
            **SMALL_KV,
        },
        "batches": [{"prompts": CHUNKED_PROMPTS, "max_tokens": CHUNKED_NEW}],
    },
    {
        "name": "preempt",
        "engine_args": {
            "enable_prefix_caching": False,
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 32,
            "block_size": BLOCK,
            "num_gpu_blocks_override": PREEMPT_BLOCKS,
            "max_model_len": 128,  # must fit in the small cache
            "max_num_seqs": 4,
        },
        "batches": [{"prompts": PREEMPT_PROMPTS, "max_tokens": PREEMPT_NEW}],
    },
]

# (prompt, max_new_tokens) pairs HF must generate.
_HF_CASES = (
    [(p, BATCH_NEW) for p in BATCH_PROMPTS]
    + [(p, CHUNKED_NEW) for p in CHUNKED_PROMPTS]
    + [(p, PREEMPT_NEW) for p in PREEMPT_PROMPTS]
)


# -- fixtures --------------------------------------------------------------------
#: vLLM's V2 model runner (another batch row order, ``compat/model_runner.py``) needs
#: Triton, which vLLM's CPU build lacks: these engines run the V1 model runner.
#: ``unit/test_compat_shims.py`` covers the V2 layout.


def _child_env() -> dict[str, str]:
    return {
        **os.environ,
        # engine core in the child process itself: the same scheduler and worker
        # code, one process spawn (and its imports) less per engine
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _hf_greedy(model_dir: str) -> dict[tuple[tuple[int, ...], int], list[int]]:
    import torch
    import transformers
    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    )
    thinker = model.thinker.eval()
    # An id outside the vocabulary is never generated: HF runs to max_new_tokens
    # like vLLM's ignore_eos (the tiny model does emit every in-vocab id, padding too).
    never = thinker.config.text_config.vocab_size
    out: dict[tuple[tuple[int, ...], int], list[int]] = {}
    with torch.inference_mode():
        for prompt, n in _HF_CASES:
            key = (tuple(prompt), n)
            if key in out:
                continue
            ids = torch.tensor([prompt])
            gen = thinker.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                do_sample=False, eos_token_id=never, pad_token_id=0,
            )
            out[key] = gen[0, len(prompt):].tolist()
            assert len(out[key]) == n
    return out


#: Every engine; each publishes the thinker's payloads in its first batch.
PUBLISHING = tuple(e["name"] for e in ENGINES)


def _with_payloads(engine: dict, root) -> dict:
    """The engine with its first batch publishing the thinker's payloads (omni-mode
    path)."""
    return {**engine, "payload_dir": str(root / "payloads"),
            "batches": [{**engine["batches"][0], "publish": True}, *engine["batches"][1:]]}


@pytest.fixture(scope="module")
def runs(tiny_qwen3_omni, tmp_path_factory):
    """``{"hf": HF tokens by (prompt, n), "engines": engine results by name}``.

    The engine script and HF's generation run concurrently.
    """
    logdir = tmp_path_factory.mktemp("engines")
    engines = [_with_payloads(e, logdir) for e in ENGINES]
    spec = json.dumps({"model": tiny_qwen3_omni, "engines": engines})
    # files, not pipes: vLLM logs to stdout and nobody reads while HF runs
    with open(logdir / "engines.out", "w") as out, open(logdir / "engines.err", "w") as err, \
            process_group([sys.executable, str(SCRIPT), spec], stdout=out, stderr=err,
                          text=True, env=_child_env()) as proc:
        result = {"hf": _hf_greedy(tiny_qwen3_omni), "logdir": logdir}
        proc.wait(timeout=ENGINE_TIMEOUT_S)
    result["engines"] = script_report(SCRIPT, proc.returncode,
                                      (logdir / "engines.out").read_text(),
                                      (logdir / "engines.err").read_text())["engines"]
    return result


def _engine(runs, name: str) -> dict:
    result = runs["engines"][name]
    if "error" in result:
        pytest.fail(f"engine {name!r} failed:\n{result['error']}")
    sched = result["scheduler"]
    assert sched is not None and "observer_error" not in sched, sched
    return result


def _assert_same(got: list[list[int]], prompts, n: int, hf) -> None:
    for i, (tokens, prompt) in enumerate(zip(got, prompts, strict=True)):
        want = hf[(tuple(prompt), n)]
        assert tokens == want, (
            f"prompt {i} ({len(prompt)} tokens): vLLM {tokens} "
            f"!= HF greedy {want}"
        )


# -- engine tests ----------------------------------------------------------------

def test_greedy_tokens_equal_hf(runs):
    result = _engine(runs, "default")
    alone = [b["token_ids"][0] for b in result["batches"][ALONE]]
    assert all(len(t) == BATCH_NEW for t in alone)
    _assert_same(alone, BATCH_PROMPTS, BATCH_NEW, runs["hf"])


def test_bad_internal_extra_args_fail_only_their_request(runs):
    """Bad values under the plugin's extra_args key fail their own request: it
    emits its stop-token fallback every step (which id depends on the vLLM
    release's stop ids under ignore_eos); the engine keeps serving: the good
    request of the same batch and the next batch equal HF."""
    result = _engine(runs, "default")
    first, second = result["batches"][POISON]
    *poisoned, good = first["token_ids"]
    fallback = poisoned[0][0]
    assert all(tokens == [fallback] * BATCH_NEW for tokens in poisoned), poisoned
    assert good != [fallback] * BATCH_NEW
    _assert_same([good], [BATCH_PROMPTS[0]], BATCH_NEW, runs["hf"])
    _assert_same(second["token_ids"], [BATCH_PROMPTS[1]], BATCH_NEW, runs["hf"])
    log = (runs["logdir"] / "engines.out").read_text() + (
        runs["logdir"] / "engines.err").read_text()
    assert log.count("omni_plugin_payload") >= len(poisoned)


def test_batched_requests_equal_each_alone(runs):
    """8 requests served together: each equals its solo run and HF."""
    result = _engine(runs, "default")
    batched = result["batches"][0]["token_ids"]
    alone = [b["token_ids"][0] for b in result["batches"][ALONE]]
    assert batched == alone
    _assert_same(batched, BATCH_PROMPTS, BATCH_NEW, runs["hf"])
    after = result["batches"][ALONE.stop - 1]["metrics"]  # before the poison batch
    assert after["vllm:request_success"] == 2 * len(BATCH_PROMPTS)


def test_chunked_prefill_equals_hf(runs):
    result = _engine(runs, "chunked")
    assert min(len(p) for p in CHUNKED_PROMPTS) > CHUNKED_BUDGET  # every prefill chunked
    sched = result["scheduler"]
    assert sched["max_step_tokens"] <= CHUNKED_BUDGET
    assert sched["partial_prefills"] >= len(CHUNKED_PROMPTS) * 2, sched
    _assert_same(result["batches"][0]["token_ids"], CHUNKED_PROMPTS, CHUNKED_NEW, runs["hf"])


def test_preemption_and_resume_equal_hf(runs):
    result = _engine(runs, "preempt")
    preemptions = result["metrics"].get("vllm:num_preemptions", 0)
    assert preemptions > 0, f"the scheduler never preempted: {result['metrics']}"
    sched = result["scheduler"]
    assert sched["resumed"] >= preemptions, sched
    assert sched["resumed_partial"] > 0, sched  # chunked recompute
    _assert_same(result["batches"][0]["token_ids"], PREEMPT_PROMPTS, PREEMPT_NEW, runs["hf"])


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_omni):
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_qwen3_omni, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", PUBLISHING)
def test_published_hidden_states_equal_hf(runs, hf_model, name):
    """The talker's input: one row per fed position (prompt + generated[:-1]) equal to
    HF's ``hidden_states[0]`` and ``hidden_states[accept_hidden_layer]`` (and the plain
    positions fed), whether the
    rows came from one batch of 8, chunked prefills or recomputes after preemption
    (which must not publish rows twice)."""
    import torch

    from vllm_omni_plugin.payload_store import PayloadStore

    result = _engine(runs, name)
    batch = result["batches"][0]
    engine = next(e for e in ENGINES if e["name"] == name)
    store = PayloadStore(_with_payloads(engine, runs["logdir"])["payload_dir"])
    layer = hf_model.config.talker_config.accept_hidden_layer
    tts = hf_model.thinker.get_input_embeddings()(torch.tensor(
        [hf_model.config.tts_bos_token_id, hf_model.config.tts_eos_token_id,
         hf_model.config.tts_pad_token_id]))
    prompts = engine["batches"][0]["prompts"]
    for prompt, tokens, key in zip(prompts, batch["token_ids"], batch["payload_keys"],
                                   strict=True):
        payload = store.get(key)
        fed = torch.tensor([prompt + tokens[:-1]])
        assert payload["embed"].shape[0] == fed.shape[1]
        with torch.no_grad():
            hf = hf_model.thinker.model(input_ids=fed, output_hidden_states=True)
        torch.testing.assert_close(payload["embed"], hf.hidden_states[0][0])
        torch.testing.assert_close(payload["hidden"], hf.hidden_states[layer][0],
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(payload["tts_embed"], tts.detach())
        # text-only prompts: the M-RoPE positions fed are plain (t == h == w == p)
        assert torch.equal(payload["positions"], torch.arange(fed.shape[1]).expand(3, -1).T)
