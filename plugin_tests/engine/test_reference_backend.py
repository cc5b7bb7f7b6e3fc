"""The reference backend under real vLLM engines, checked token for token against HF.

Child processes (``scripts/thinker_generate.py``) run the engine
configurations below one after another with ``VLLM_OMNI_PLUGIN_BACKEND=reference``
(vLLM resolves its platform at import, so engines cannot run in the test process):
one per scheduler/worker protocol (see :data:`PROTOCOLS`). Meanwhile the test process
computes Hugging Face's own greedy tokens with
``Qwen3OmniMoeForConditionalGeneration.thinker.generate``. Each test compares one
scheduler feature's output to HF and checks, from what the scheduler sent the worker,
that the feature was really exercised:

* plain greedy generation (several prompt lengths, decode across block boundaries),
* batching (4 prompts together == each alone),
* chunked prefill (token budget 16, prompts of 41-60 tokens),
* preemption (a KV cache too small for the running requests) and resumption, under
  both protocols, recomputing in chunks or reusing prefix-cached blocks,
* prefix caching (new requests start with ``num_computed_tokens > 0``).

Also unit tests for ``reference.platform.activate``. ~2 min on 2 busy cores.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_omni_plugin.reference import platform as ref_platform

SCRIPT = Path(__file__).resolve().parent / "scripts" / "thinker_generate.py"
ENGINE_TIMEOUT_S = 900

#: Token ids from the tiny tokenizer's BPE range (0..691), no special tokens.
_rng = random.Random(1234)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(0, 692) for _ in range(n)]


# -- scenarios -----------------------------------------------------------------
#: Small KV cache for the engines that do not set num_gpu_blocks_override (512 blocks).
SMALL_KV = {"kv_cache_memory_bytes": 4 * 1024 * 1024}

# 1 + 3: different lengths; 16 new tokens cross block boundaries (block_size 16).
BATCH_PROMPTS = [_prompt(n) for n in (3, 11, 17, 33)]
BATCH_NEW = 16

# 2: each prompt is longer than the 16-token budget, so vLLM must chunk it; the
# three run concurrently, so chunks of one interleave with decodes of the others
# and start at positions that are not block aligned.
CHUNKED_PROMPTS = [_prompt(n) for n in (41, 50, 60)]
CHUNKED_NEW = 12
CHUNKED_BUDGET = 16

# 4: 4 requests of up to 29 + 40 tokens need 5 blocks each (20 in all) but the
# cache has 11 usable blocks (12 minus vLLM's null block): the scheduler must
# preempt running requests and resume them later. Without prefix caching a resumed
# request recomputes its prompt and generated tokens, here in chunks (token budget
# 32); with prefix caching it may reuse its own blocks that were not evicted yet.
PREEMPT_PROMPTS = [_prompt(n) for n in (20, 23, 26, 29)]
PREEMPT_NEW = 40
PREEMPT_BLOCKS = 12

# 5: prompts sharing a 48-token (3-block) prefix, and one sharing 40 tokens of it.
_PREFIX = _prompt(48)
PREFIX_PROMPTS = [
    _PREFIX + _prompt(5),
    _PREFIX + _prompt(9),
    _PREFIX[:40] + _prompt(7),
]
PREFIX_NEW = 12

# 6: requests whose extra_args carry bad values in the plugin's namespace (the
# API refuses them; this is the worker's own check behind it), then good ones.
POISON_ARGS = [{"omni_plugin_payload": "x"}, {"omni_plugin_payload": {"out": "../escape"}},
               {"omni_plugin_payload": {"bogus": "key"}}, {"omni_plugin_payload": [1, 2]}, None]

ENGINES = [
    {
        "name": "default",
        "engine_args": {"enable_prefix_caching": False, **SMALL_KV},
        # batch 0: all together; batches 1-4: each prompt alone.
        "batches": [{"prompts": BATCH_PROMPTS, "max_tokens": BATCH_NEW}]
        + [{"prompts": [p], "max_tokens": BATCH_NEW} for p in BATCH_PROMPTS],
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
            "block_size": 16,
            "num_gpu_blocks_override": PREEMPT_BLOCKS,
            "max_model_len": 128,  # must fit in the small cache
            "max_num_seqs": 4,
        },
        "batches": [{"prompts": PREEMPT_PROMPTS, "max_tokens": PREEMPT_NEW}],
    },
    {
        # Same pressure with prefix caching: a resumed request finds some of its
        # own freed blocks still cached and resumes with num_computed_tokens > 0.
        "name": "preempt_prefix_cache",
        "engine_args": {
            "enable_prefix_caching": True,
            "block_size": 16,
            "num_gpu_blocks_override": PREEMPT_BLOCKS,
            "max_model_len": 128,
            "max_num_seqs": 4,
        },
        "batches": [{"prompts": PREEMPT_PROMPTS, "max_tokens": PREEMPT_NEW}],
    },
    {
        "name": "prefix_cache",
        "engine_args": {"enable_prefix_caching": True, "block_size": 16, **SMALL_KV},
        # one request at a time: each later one hits the blocks the earlier ones
        # cached; then prompt 0 again (48 of 53 tokens cached).
        "batches": [{"prompts": [p], "max_tokens": PREFIX_NEW} for p in PREFIX_PROMPTS]
        + [{"prompts": [PREFIX_PROMPTS[0]], "max_tokens": PREFIX_NEW}],
    },
    {
        "name": "poison",
        "engine_args": {"enable_prefix_caching": False, **SMALL_KV},
        "batches": [{"prompts": [BATCH_PROMPTS[0]] * len(POISON_ARGS), "max_tokens": BATCH_NEW,
                     "extra_args": POISON_ARGS},
                    {"prompts": [BATCH_PROMPTS[1]], "max_tokens": BATCH_NEW}],
    },
]

# (prompt, max_new_tokens) pairs HF must generate.
_HF_CASES = (
    [(p, BATCH_NEW) for p in BATCH_PROMPTS]
    + [(p, CHUNKED_NEW) for p in CHUNKED_PROMPTS]
    + [(p, PREEMPT_NEW) for p in PREEMPT_PROMPTS]
    + [(p, PREFIX_NEW) for p in PREFIX_PROMPTS]
)


# -- fixtures --------------------------------------------------------------------
#: vLLM's scheduler speaks one of two protocols to the worker, chosen by
#: ``VllmConfig.use_v2_model_runner`` (``VLLM_USE_V2_MODEL_RUNNER``, else whether
#: Triton looks usable): with the V1 model runner a resumed (preempted) request
#: comes back as a cached request in ``resumed_req_ids`` with ``all_token_ids``;
#: with V2 it comes back as a *new* request whose ``prefill_token_ids`` hold its
#: prompt and the tokens generated before preemption. The worker must handle both.
#: Value: ``VLLM_USE_V2_MODEL_RUNNER``. Only preemption differs, so only the
#: preemption engines run under both (saves ~40 s on 2 cores).
PROTOCOLS = {"v1": "0", "v2": "1"}
PROTOCOL_ENGINES = {
    "v1": [e["name"] for e in ENGINES],
    "v2": ["preempt", "preempt_prefix_cache"],
}


def _child_env(protocol: str) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_OMNI_PLUGIN_BACKEND": "reference",
        "VLLM_USE_V2_MODEL_RUNNER": PROTOCOLS[protocol],
        # the reference platform activates only when no accelerator is usable
        "CUDA_VISIBLE_DEVICES": "",
        # engine core in the child process itself: the same scheduler and worker
        # code, one process spawn (and its imports) less per engine
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _hf_greedy(model_dir: str) -> dict[tuple[tuple[int, ...], int], list[int]]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
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


def _with_payloads(engine: dict, root) -> dict:
    """The "preempt" engine also publishes thinker payloads (omni-mode path)."""
    if engine["name"] != "preempt":
        return engine
    return {**engine, "payload_dir": str(root / "payloads"),
            "batches": [{**b, "publish": True} for b in engine["batches"]]}


@pytest.fixture(scope="module")
def runs(tiny_qwen3_omni, tmp_path_factory):
    """``{"hf": HF tokens by (prompt, n), protocol: engine results by name}``.

    Both protocols' engine scripts and HF's generation run concurrently.
    """
    logdir = tmp_path_factory.mktemp("engines")
    procs = {}
    try:
        for protocol in PROTOCOLS:
            engines = [_with_payloads(e, logdir / protocol) for e in ENGINES
                       if e["name"] in PROTOCOL_ENGINES[protocol]]
            spec = json.dumps({"model": tiny_qwen3_omni, "engines": engines})
            # files, not pipes: vLLM logs to stdout and nobody reads while HF runs
            with open(logdir / f"{protocol}.out", "w") as out, \
                    open(logdir / f"{protocol}.err", "w") as err:
                procs[protocol] = subprocess.Popen(
                    [sys.executable, str(SCRIPT), spec], stdout=out, stderr=err,
                    text=True, env=_child_env(protocol),
                )
        result = {"hf": _hf_greedy(tiny_qwen3_omni), "logdir": logdir}
        for protocol, proc in procs.items():
            proc.wait(timeout=ENGINE_TIMEOUT_S)
            stdout = (logdir / f"{protocol}.out").read_text()
            lines = stdout.strip().splitlines()
            if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
                err = (logdir / f"{protocol}.err").read_text()
                pytest.fail(f"engine script ({protocol}) exited {proc.returncode}:\n"
                            f"{stdout[-3000:]}\n{err[-6000:]}")
            result[protocol] = json.loads(lines[-1])["engines"]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return result


def _engine(runs, protocol: str, name: str) -> dict:
    result = runs[protocol][name]
    if "error" in result:
        pytest.fail(f"engine {name!r} ({protocol} protocol) failed:\n{result['error']}")
    sched = result["scheduler"]
    assert sched is not None and "observer_error" not in sched, sched
    return result


def _assert_same(got: list[list[int]], prompts, n: int, hf) -> None:
    for i, (tokens, prompt) in enumerate(zip(got, prompts, strict=True)):
        want = hf[(tuple(prompt), n)]
        assert tokens == want, (
            f"prompt {i} ({len(prompt)} tokens): vLLM reference backend {tokens} "
            f"!= HF greedy {want}"
        )


# -- engine tests ----------------------------------------------------------------
@pytest.mark.engine
def test_greedy_tokens_equal_hf(runs):
    result = _engine(runs, "v1", "default")
    alone = [b["token_ids"][0] for b in result["batches"][1:]]
    assert all(len(t) == BATCH_NEW for t in alone)
    _assert_same(alone, BATCH_PROMPTS, BATCH_NEW, runs["hf"])


@pytest.mark.engine
def test_bad_internal_extra_args_fail_only_their_request(runs):
    """Bad values under the plugin's extra_args key fail their own request: it
    emits its stop-token fallback every step (which id depends on the vLLM
    release's stop ids under ignore_eos); the engine keeps serving: the good
    request of the same batch and the next batch equal HF."""
    result = _engine(runs, "v1", "poison")
    first, second = result["batches"]
    *poisoned, good = first["token_ids"]
    fallback = poisoned[0][0]
    assert all(tokens == [fallback] * BATCH_NEW for tokens in poisoned), poisoned
    assert good != [fallback] * BATCH_NEW
    _assert_same([good], [BATCH_PROMPTS[0]], BATCH_NEW, runs["hf"])
    _assert_same(second["token_ids"], [BATCH_PROMPTS[1]], BATCH_NEW, runs["hf"])
    log = (runs["logdir"] / "v1.out").read_text() + (runs["logdir"] / "v1.err").read_text()
    assert log.count("omni_plugin_payload") >= len(poisoned)


@pytest.mark.engine
def test_batched_requests_equal_each_alone(runs):
    result = _engine(runs, "v1", "default")
    batched = result["batches"][0]["token_ids"]
    alone = [b["token_ids"][0] for b in result["batches"][1:]]
    assert batched == alone
    _assert_same(batched, BATCH_PROMPTS, BATCH_NEW, runs["hf"])
    assert result["metrics"]["vllm:request_success"] == 2 * len(BATCH_PROMPTS)


@pytest.mark.engine
def test_chunked_prefill_equals_hf(runs):
    result = _engine(runs, "v1", "chunked")
    assert min(len(p) for p in CHUNKED_PROMPTS) > CHUNKED_BUDGET  # every prefill chunked
    sched = result["scheduler"]
    assert sched["max_step_tokens"] <= CHUNKED_BUDGET
    assert sched["partial_prefills"] >= len(CHUNKED_PROMPTS) * 2, sched
    _assert_same(result["batches"][0]["token_ids"], CHUNKED_PROMPTS, CHUNKED_NEW, runs["hf"])


@pytest.mark.engine
@pytest.mark.parametrize("name", ["preempt", "preempt_prefix_cache"])
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_preemption_and_resume_equal_hf(runs, protocol, name):
    result = _engine(runs, protocol, name)
    preemptions = result["metrics"].get("vllm:num_preemptions", 0)
    assert preemptions > 0, f"the scheduler never preempted: {result['metrics']}"
    sched = result["scheduler"]
    assert sched["resumed"] >= preemptions, sched
    # the protocol under test really is the one the scheduler spoke
    assert (sched["resumed_as_new"] > 0) == (protocol == "v2"), sched
    if name == "preempt":
        assert sched["resumed_partial"] > 0, sched  # chunked recompute
    else:
        assert sched["resumed_with_computed"] > 0, sched
    _assert_same(result["batches"][0]["token_ids"], PREEMPT_PROMPTS, PREEMPT_NEW, runs["hf"])


@pytest.mark.engine
def test_prefix_cache_hits_equal_hf(runs):
    result = _engine(runs, "v1", "prefix_cache")
    batches = result["batches"]
    cached = [b["num_cached_tokens"][0] for b in batches]
    # prompt 1 reuses the 3 shared blocks, prompt 2 the 2 full blocks of its 40
    # shared tokens, prompt 0 again its 3 full prompt blocks.
    assert cached == [0, 48, 32, 48], cached
    assert result["scheduler"]["new_with_computed"] == 3, result["scheduler"]
    got = [b["token_ids"][0] for b in batches]
    _assert_same(got, PREFIX_PROMPTS + [PREFIX_PROMPTS[0]], PREFIX_NEW, runs["hf"])


# -- platform activation ------------------------------------------------------------
@pytest.fixture
def platform_env(monkeypatch):
    """Set the backend env var and argv; no accelerator unless told otherwise."""

    def setup(backend: str | None, argv: list[str], accelerator: bool = False):
        if backend is None:
            monkeypatch.delenv("VLLM_OMNI_PLUGIN_BACKEND", raising=False)
        else:
            monkeypatch.setenv("VLLM_OMNI_PLUGIN_BACKEND", backend)
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(ref_platform, "_accelerator_usable", lambda: accelerator)

    # activate() exports the variable: make monkeypatch restore it whatever the case.
    monkeypatch.setenv("VLLM_OMNI_PLUGIN_BACKEND", "auto")
    return setup


SERVE = ["vllm", "serve", "/models/x"]
OMNI = SERVE + ["--stage-configs-path", "s.yaml"]


def test_activate_accelerator_backend_stays_out(platform_env):
    platform_env("accelerator", OMNI)
    assert ref_platform.activate() is None


@pytest.mark.parametrize("backend", [None, "auto", "AUTO", ""])
def test_activate_auto_without_omni_flag_stays_out(platform_env, backend):
    platform_env(backend, SERVE + ["--stage-configs", "x"])
    assert ref_platform.activate() is None
    assert os.environ.get("VLLM_OMNI_PLUGIN_BACKEND") == backend


@pytest.mark.parametrize("argv", [OMNI, SERVE + ["--stage-configs-path=s.yaml"]])
@pytest.mark.parametrize("backend", [None, "auto"])
def test_activate_auto_with_omni_flag(platform_env, backend, argv):
    platform_env(backend, argv)
    assert ref_platform.activate() == ref_platform.QUALNAME
    # exported so engine-core and worker processes resolve the same platform
    assert os.environ["VLLM_OMNI_PLUGIN_BACKEND"] == "reference"


@pytest.mark.parametrize("backend", ["reference", " Reference "])
def test_activate_reference(platform_env, backend):
    platform_env(backend, ["python", "script.py"])
    assert ref_platform.activate() == ref_platform.QUALNAME
    assert os.environ["VLLM_OMNI_PLUGIN_BACKEND"] == "reference"


def test_activate_auto_with_usable_accelerator_stays_out(platform_env):
    platform_env("auto", OMNI, accelerator=True)
    assert ref_platform.activate() is None


def test_activate_reference_wins_over_accelerator(platform_env):
    """An explicit VLLM_OMNI_PLUGIN_BACKEND=reference is honoured on a GPU host."""
    platform_env("reference", OMNI, accelerator=True)
    assert ref_platform.activate() == ref_platform.QUALNAME


@pytest.mark.parametrize("backend", ["cpu", "gpu", "referenc"])
def test_activate_invalid_backend_stays_out(platform_env, backend):
    platform_env(backend, OMNI)
    assert ref_platform.activate() is None
    assert os.environ["VLLM_OMNI_PLUGIN_BACKEND"] == backend


def test_platform_qualnames_resolve():
    """The qualnames activate() hands vLLM name real classes (imports vLLM's CPU platform)."""
    pytest.importorskip("vllm")
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = resolve_obj_by_qualname(ref_platform.QUALNAME)
    from vllm.platforms.cpu import CpuPlatform

    assert issubclass(cls, CpuPlatform)
    from vllm_omni_plugin.reference.worker import ReferenceWorker

    assert resolve_obj_by_qualname(ref_platform.WORKER_QUALNAME) is ReferenceWorker


@pytest.mark.engine
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_payload_after_preemption_equals_hf_hidden_states(runs, protocol, tiny_qwen3_omni):
    """Recompute after a preemption must not publish rows twice: the thinker's
    payload has one row per fed position (prompt + generated[:-1]) equal to HF's
    hidden states, whichever scheduler protocol resumed the request."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from vllm_omni_plugin.payload_store import PayloadStore

    if "preempt" not in PROTOCOL_ENGINES[protocol]:
        pytest.skip(f"no preemption engine under the {protocol} protocol")
    result = _engine(runs, protocol, "preempt")
    assert result["metrics"].get("vllm:num_preemptions", 0) > 0
    batch = result["batches"][0]
    preempt = next(e for e in ENGINES if e["name"] == "preempt")
    payload_dir = _with_payloads(preempt, runs["logdir"] / protocol)["payload_dir"]
    store = PayloadStore(payload_dir)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_qwen3_omni, dtype=torch.float32).eval()
    layer = model.config.talker_config.accept_hidden_layer
    for prompt, tokens, key in zip(PREEMPT_PROMPTS, batch["token_ids"], batch["payload_keys"],
                                   strict=True):
        payload = store.get(key)
        fed = torch.tensor([prompt + tokens[:-1]])
        assert payload["embed"].shape[0] == fed.shape[1]
        assert payload["tts_embed"].shape[0] == 3
        with torch.no_grad():
            hf = model.thinker.model(input_ids=fed, output_hidden_states=True)
        torch.testing.assert_close(payload["embed"], hf.hidden_states[0][0])
        torch.testing.assert_close(payload["hidden"], hf.hidden_states[layer][0],
                                   atol=1e-4, rtol=1e-4)
