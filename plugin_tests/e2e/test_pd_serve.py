"""End to end with prefill/decode disaggregation: a real `vllm serve` of
the built-in pipeline ``qwen3_omni_moe_pd`` (the thinker's prefill engine, the entry engine
pulling each prompt's KV cache from it through OmniMooncakeConnector over TCP, talker,
code2wav) answering chats through the official ``openai`` SDK.

Token-for-token parity of PD with the non-PD pipeline and with HF is in
``engine/test_pipeline_pd_engine.py``; here: the served flow, streamed and not, with audio,
and that every request went through the prefill stage.
"""

from __future__ import annotations

import re

import pytest
import yaml

from plugin_tests.conftest import QWEN3_OMNI_PD_YAML
from plugin_tests.helpers import inductor_env
from plugin_tests.serve_utils import check_stall_recovery, serving

pytestmark = pytest.mark.e2e

PREFILL_STAGE = "3"
#: runtime.stall_timeout of the module server's prefill stage, and of its entry (decode)
#: engine, whose stall takes the server down, seconds: far above their longest step on a
#: 2-core host shared with another server
STALL_S = 30
ENTRY_STALL_S = 45


@pytest.fixture(scope="module")
def server(tiny_qwen3_omni, tmp_path_factory):
    pytest.importorskip("mooncake.engine", reason="the plugin's `pd` extra is not installed")
    root = tmp_path_factory.mktemp("pd")
    with open(QWEN3_OMNI_PD_YAML) as f:
        pipeline = yaml.safe_load(f)
    pipeline["stages"][1]["default_sampling_params"]["max_tokens"] = 16
    for stage in pipeline["stages"]:
        if stage["stage_id"] in (0, int(PREFILL_STAGE)):
            stage.setdefault("runtime", {})["stall_timeout"] = \
                ENTRY_STALL_S if stage["stage_id"] == 0 else STALL_S
    yaml_path = root / "pipeline.yaml"
    yaml_path.write_text(yaml.safe_dump(pipeline))
    # a request resubmitted while the prefill stage restarts waits 3 s for it
    with serving(tiny_qwen3_omni, ["--stage-configs-path", str(yaml_path),
                                   "--max-model-len", "2048", "--dtype", "float32",
                                   "--omni-replica-wait-timeout", "3"],
                 str(root / "serve.log"), env=inductor_env()) as proc:
        yield proc


def _prefilled(server) -> float:
    return sum(v for (name, labels), v in server.metrics().items()
               if name == "vllm_omni:replica_requests_total"
               and ("stage", PREFILL_STAGE) in labels)


def test_pd_chat_streamed_and_not_with_audio(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    messages = [{"role": "user", "content": "Tell me a story about a cat"}]
    before = _prefilled(server)
    # a client's kv_transfer_params are dropped: the head pairs the engines itself
    plain = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=12, temperature=0,
        extra_body={"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "x"}})
    stream = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in stream if chunk.choices)
    spoken = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=12, temperature=0,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})
    text = plain.choices[0].message.content
    assert text and streamed == text and spoken.choices[0].message.content == text
    assert spoken.choices[0].message.audio.data
    assert plain.choices[0].finish_reason == "length"
    assert _prefilled(server) - before == 3  # every request ran on the prefill stage
    log = server.log()
    assert "OmniMooncakeConnector" in log and "stage 3 (thinker_prefill) engine ready" in log


def test_the_prefill_stages_row_cache_is_on_metrics(server):
    """With PD the prefill stage computes the prompts (the decode stage, the head's own
    engine, keeps no row cache): its row cache's counts are on ``/metrics`` under its
    stage, and a spoken prompt asked again is handed its blocks' rows from there."""
    story = " ".join(["tell me a story about the sea and the stars"] * 40)
    body = server.audio_body(messages=[{"role": "user", "content": story}])
    for _ in range(2):
        answer = server.chat(body)
        assert answer.status_code == 200, answer.text
    server.wait_until(lambda: (server.metric("vllm_omni:row_cache_hit_blocks_total",
                                             stage=PREFILL_STAGE) or 0) >= 2, timeout=60)
    assert server.metric("vllm_omni:row_cache_blocks", stage=PREFILL_STAGE) >= 3
    assert server.metric("vllm_omni:row_cache_bytes", stage=PREFILL_STAGE) > 0
    assert server.metric("vllm_omni:row_cache_blocks", stage=0) is None


def test_a_stalled_prefill_stage_is_restarted_and_its_request_answered(server):
    """SIGSTOP of the prefill stage's EngineCore with a chat's prompt in it (before any
    KV transfer): see :func:`check_stall_recovery`; the answer is a 503 naming the
    prefill stage and the stall (resubmitted while the stage restarts)."""
    answer = check_stall_recovery(server, int(PREFILL_STAGE), "thinker_prefill", STALL_S,
                                  lambda: server.chat(server.chat_body()))
    assert answer.status_code == 503


def test_a_stalled_entry_engine_is_killed_and_the_server_exits(server):
    """The head's own engine (vLLM's, the decode stage here) stalls: the head kills its
    EngineCore, vLLM fails the request in it and shuts the API server down, so that
    whatever runs the server restarts it, instead of a server that hangs while its
    /health answers 200. The module's last test: the server is gone after it."""
    import requests

    answer, seconds = server.stall(0, lambda: server.chat(server.chat_body(), timeout=120),
                                   in_stage=lambda: True)
    assert seconds <= ENTRY_STALL_S + 10, seconds
    if isinstance(answer, requests.Response):  # else the connection closed unanswered
        assert answer.status_code >= 500, answer.text
    server.proc.wait(timeout=120)
    assert re.search(r"stage 0 \(thinker\), the head's engine: stalled: its EngineCore "
                     rf"answered no liveness probe for {ENTRY_STALL_S:g} s", server.log())
