"""Prefill/decode disaggregation between two real vLLM engines through ``OmniMooncakeConnector``.

A child process (``scripts/pd_generate.py``) starts a prefill engine (``kv_producer``, with
vLLM's prefix caching) and a decode engine (``kv_consumer``) of the thinker stage on vLLM's
own worker and model runner, with Mooncake's real transfer engine over TCP on loopback.
The decode engine's own generation (no KV transfer) is the reference; with PD the decode
engine computes only the last prompt token and pulls the rest of the prompt's KV cache
from the prefill engine. Writes are limited to a few descriptors per batch, so the
connector's batching is exercised too. Both engines have the plugin's transfer timeout;
after the batches, the same pair goes through the failure cases
(``scripts/pd_failures.py``), the prefill engine's kill last.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from plugin_tests.helpers import engine_result, engine_script_results

SCRIPT = Path(__file__).resolve().parent / "scripts" / "pd_generate.py"
ENGINE_TIMEOUT_S = 600
BLOCK = 32
NEW = 24
#: Small enough that most writes are split into several batches.
MAX_DESCS_PER_PEER = 2

_rng = random.Random(2026)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(0, 692) for _ in range(n)]


#: shorter than, equal to and longer than one block, and over 100 tokens
ALONE = [_prompt(n) for n in (5, BLOCK, BLOCK + 1, 117)]
#: 8 requests prefilled together, then decoded together
CONCURRENT = [_prompt(n) for n in (3, 17, 31, 32, 33, 64, 101, 130)]
#: the negative control: the prefill engine computes another prompt of the same length
OTHER = _prompt(len(ALONE[3]))

BATCHES = (
    [{"mode": "local", "prompts": CONCURRENT, "max_tokens": NEW}]
    + [{"mode": "local", "prompts": [p], "max_tokens": NEW} for p in ALONE]
    + [{"mode": "pd", "prompts": CONCURRENT, "max_tokens": NEW}]
    + [{"mode": "pd", "prompts": [p], "max_tokens": NEW} for p in ALONE]
    + [{"mode": "pd", "prompts": [ALONE[3]], "prefill_prompts": [OTHER], "max_tokens": NEW}]
    # the longest prompt again: the prefill engine reads its full blocks from the cache
    + [{"mode": "pd", "prompts": [ALONE[3]], "max_tokens": NEW}]
)

#: The transfer timeout both engines get (``omni_plugin_transfer_timeout_s``); vLLM's own
#: limits are 3 bootstrap attempts of 30 s (5 s on 0.30) and 540 s per pull. The prefill
#: engine holds a finished request's KV cache half that long: each PD batch's pulls start
#: within it.
TRANSFER_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def pd_result(tiny_qwen3_omni, tmp_path_factory):
    """The script's result: ``"batches"`` (:data:`BATCHES`), then ``"failures"``."""
    pytest.importorskip("mooncake.engine", reason="the plugin's `pd` extra is not installed "
                        "(scripts/setup_env.sh installs it)")
    spec = {"model": tiny_qwen3_omni, "block_size": BLOCK,
            "max_descs_per_peer": MAX_DESCS_PER_PEER, "timeout_s": TRANSFER_TIMEOUT_S,
            "engines": [{"name": "pd"}], "batches": BATCHES,
            "failures": {"max_tokens": 12, "prompt": ALONE[3]}}
    # each engine core in its own process: the prefill engine must keep stepping (to
    # hand finished requests to its sender) while the decode engine runs
    results = engine_script_results(SCRIPT, spec, tmp_path_factory.mktemp("pd"), name="pd",
                                    timeout=ENGINE_TIMEOUT_S,
                                    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    return engine_result(results, "pd")


@pytest.fixture(scope="module")
def pd_run(pd_result):
    """The results of :data:`BATCHES`, in order."""
    return pd_result["batches"]


def _split(batches):
    """``(local, pd, control)``: the batches run locally, the same through PD, and the
    negative control."""
    n = 1 + len(ALONE)
    return batches[:n], batches[n:2 * n], batches[2 * n]


@pytest.mark.engine
def test_pd_greedy_tokens_equal_local(pd_run):
    """Every prompt length, alone and 8 at once: decode after a remote prefill yields the
    same greedy tokens as the decode engine prefilling locally."""
    local, pd, _ = _split(pd_run)
    for ref, got in zip(local, pd, strict=True):
        assert got["prefill_finish"] == ["length"] * len(got["token_ids"]), got
        assert got["finish"] == ["length"] * len(got["token_ids"]), got
        for i, (want, tokens) in enumerate(zip(ref["token_ids"], got["token_ids"],
                                               strict=True)):
            assert len(want) == NEW
            assert tokens == want, f"request {i}: PD {tokens} != local {want}"


@pytest.mark.engine
def test_pd_uses_the_transferred_kv(pd_run):
    """Negative control: when the prefill engine computed another prompt of the same
    length, the decode engine continues from that KV cache, so its tokens differ."""
    local, _, control = _split(pd_run)
    want = local[-1]["token_ids"][0]
    assert control["prefill_finish"] == ["length"]
    assert control["finish"] == ["length"]
    assert len(control["token_ids"][0]) == NEW
    assert control["token_ids"][0] != want


@pytest.mark.engine
def test_pd_prefill_engine_reads_its_prefix_cache_and_sends_those_blocks_too(pd_run):
    """The prefill engine caches (as the shipped PD pipeline's prefill stage): a prompt it
    prefilled before is served from its cache (its full blocks), computed cold the first
    time; the decode engine, pulling the cached blocks with the computed one, generates
    the tokens of a local prefill."""
    local, pd, _ = _split(pd_run)
    warm = pd_run[-1]
    assert pd[-1]["prefill_cached"] == [0]  # ALONE[3] the first time
    assert all(c == 0 for c in pd[0]["prefill_cached"]), pd[0]  # random prompts
    assert warm["prefill_cached"] == [len(ALONE[3]) // BLOCK * BLOCK], warm
    assert warm["finish"] == ["length"]
    assert warm["token_ids"] == local[-1]["token_ids"]


# -- failures: real processes, the connector's transfer timeout -------------------------
#: Slack over the timeout for the engine step that reports the failure (2 busy cores).
SLACK_S = 6.0
FAILURES = ("unreachable_bootstrap", "transfer_never_completes", "prefill_killed")


@pytest.fixture(scope="module")
def pd_failures(pd_result):
    """The failure cases' results (``scripts/pd_failures.py``), on the pair after
    :data:`BATCHES`."""
    return engine_result(pd_result, "failures")


@pytest.mark.engine
def test_pd_failures_end_the_request_within_the_transfer_timeout(pd_failures):
    """A bootstrap address that never answers, a prefill engine stopped (SIGSTOP) before the
    pull and one killed (SIGKILL) before the pull: each decode request ends with vLLM's
    finish reason ``error`` and no token within the transfer timeout (vLLM alone waits 90 s
    or 540 s); the decode engine then serves on with nothing left: no unfinished request, no
    KV block in use, the same tokens as before."""
    reference = pd_failures["reference"]["token_ids"]
    assert len(reference) == 12 and pd_failures["warm"]["token_ids"] == reference
    for case in FAILURES:
        got = pd_failures[case]
        assert got["finish"] == "error" and got["token_ids"] == [], (case, got)
        assert got["elapsed_s"] < TRANSFER_TIMEOUT_S + SLACK_S, (case, got)
    assert pd_failures["after"]["token_ids"] == reference
    assert pd_failures["decode_unfinished"] == 0
    assert pd_failures["decode_kv_usage"] == 0.0


@pytest.mark.engine
def test_pd_prefill_engine_resumed_after_a_failed_pull_serves_correctly(pd_failures):
    """The stopped prefill engine, continued after the decode side gave up, serves the next
    PD request with the right tokens (its stale transfer is neither written late nor
    left in the way)."""
    assert pd_failures["after_resume"]["token_ids"] == pd_failures["reference"]["token_ids"]
    assert pd_failures["after_resume"]["finish"] == "length"
