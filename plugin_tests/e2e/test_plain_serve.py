"""End to end: with the plugin installed and no ``--stage-configs-path``, ``vllm serve`` is
plain vLLM.

Two real servers of the tiny Qwen3-Omni checkpoint (vLLM's own thinker model), one after
the other with the same flags: the plugin installed (vLLM loads it, as in every process),
and the plugin switched off (``VLLM_PLUGINS=none``). The same requests go to both; their
routes (``/openapi.json``), greedy completions and chats (tokens), and answers to requests
the omni middleware would read or refuse must be equal, and no omni code may show in the
server's log. ``vllm serve --help`` is compared in
``cli/test_plugin_registration.py``.
"""

from __future__ import annotations

import os

import pytest
import requests

from plugin_tests.serve_utils import serving

pytestmark = pytest.mark.e2e

FLAGS = ["--max-model-len", "1024", "--dtype", "float32"]
PROMPT = "The quick brown fox"


def _observe(server) -> dict:
    """What a client sees of ``server``: its routes, a greedy completion's and chat's
    tokens, and the status and error of requests the omni middleware reads in omni mode."""
    url = server.url

    def post(path, body):
        r = requests.post(f"{url}{path}", json={"model": server.model, **body}, timeout=120)
        answer = r.json()
        for volatile in ("id", "created", "system_fingerprint"):
            answer.pop(volatile, None)
        return r.status_code, answer

    spec = requests.get(f"{url}/openapi.json", timeout=30).json()
    return {
        "routes": {path: sorted(ops) for path, ops in spec["paths"].items()},
        "completion": post("/v1/completions", {
            "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 1}),
        "chat": post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16,
            "temperature": 0, "logprobs": True}),
        # read and refused (400) by the omni middleware in omni mode, vLLM's to answer here
        "namespaced xargs": post("/v1/completions", {
            "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": {"omni_plugin_payload": "x"}}),
        "audio out": post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
            "modalities": ["text", "audio"]}),
        "voices": requests.get(f"{url}/v1/audio/voices", timeout=30).status_code,
        "realtime": requests.get(f"{url}/v1/realtime", timeout=30).status_code,
    }


@pytest.fixture(scope="module")
def observed(tiny_qwen3_omni, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("plain")
    seen = {}
    for name, plugins in (("with plugin", None), ("plugin off", "none")):
        env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        if plugins:
            env["VLLM_PLUGINS"] = plugins
        log = root / f"{name.replace(' ', '-')}.log"
        with serving(tiny_qwen3_omni, FLAGS, str(log), env=env) as server:
            seen[name] = {**_observe(server), "log": server.log()}
    return seen


def test_the_same_routes(observed):
    with_plugin, plain = observed["with plugin"], observed["plugin off"]
    assert with_plugin["routes"] == plain["routes"]
    assert "/v1/chat/completions" in plain["routes"]


@pytest.mark.parametrize("request_name", ["completion", "chat"])
def test_the_same_greedy_tokens(observed, request_name):
    with_plugin, plain = observed["with plugin"][request_name], \
        observed["plugin off"][request_name]
    assert with_plugin[0] == plain[0] == 200
    assert with_plugin == plain
    assert with_plugin[1]["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("request_name", ["namespaced xargs", "audio out", "voices",
                                          "realtime"])
def test_what_the_omni_middleware_reads_is_vllms_to_answer(observed, request_name):
    """Requests that omni mode answers or refuses itself get vLLM's own answers."""
    assert observed["with plugin"][request_name] == observed["plugin off"][request_name]


def test_no_omni_code_runs_in_plain_mode(observed):
    log = observed["with plugin"]["log"]
    assert "omni mode" not in log and "OmniApiMiddleware" not in log
    assert "vllm_omni_plugin" not in log and "omni_plugin" not in log
