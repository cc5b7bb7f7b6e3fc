"""End to end: no client request can kill a real `vllm serve` in omni mode or
reach the pipeline's internals; dead stage engines are restarted; bursts are
bounded by admission control.

One server for the module (three real EngineCores on vLLM's worker and model runner),
started with ``--api-key``: every request sends it, and the omni routes are shown to
refuse a client without it. Tests run in file order and the last ones kill stage
engines with SIGKILL:

* the talker (stage 1) is restarted by its supervisor (``max_restarts`` default)
  and has an admission bound of 2 requests in flight;
* code2wav (stage 2) has ``runtime.max_restarts: 0``: killed, it stays down.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import threading
import time

import pytest
import requests
import yaml

from plugin_tests.conftest import QWEN3_OMNI_YAML
from plugin_tests.helpers import inductor_env
from plugin_tests.media import wav_bytes
from plugin_tests.serve_utils import serving

pytestmark = pytest.mark.e2e

TALKER_MAX_TOKENS = 48
TALKER_BOUND = 2
ADMISSION_TIMEOUT_S = 0.5
#: seconds a request waits for a restarting replica (default 30)
REPLICA_WAIT_S = 180
#: the server's --api-key
API_KEY = "sk-omni-hardening"


@pytest.fixture(scope="module")
def server(tiny_qwen3_omni, tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    with open(QWEN3_OMNI_YAML) as f:
        pipeline = yaml.safe_load(f)
    talker, code2wav = pipeline["stages"][1], pipeline["stages"][2]
    talker["default_sampling_params"]["max_tokens"] = TALKER_MAX_TOKENS
    talker["runtime"] = {"max_inflight": TALKER_BOUND}
    code2wav["runtime"] = {"max_restarts": 0}
    yaml_path = root / "pipeline.yaml"
    yaml_path.write_text(yaml.safe_dump(pipeline))
    payload_base = root / "payloads"
    payload_base.mkdir()
    # a payload directory left by a process that no longer exists (pid 2**22 + 1
    # is above Linux's pid_max) is removed at start-up; a live one's is kept
    stale = payload_base / f"vllm-omni-plugin-{2**22 + 1}-0123abcd"
    live = payload_base / f"vllm-omni-plugin-{os.getpid()}-0123abcd"
    for d in (stale, live):
        (d / "leftover.out").mkdir(parents=True)
    # the thinker compiled with inductor, as users run it: the fuzz's valid bodies include
    # `max_tokens: null` (up to --max-model-len tokens), which dynamo's eager backend
    # (VLLM_CPU_CI_ENV) made too slow for the client's 120 s timeout
    env = inductor_env()
    env["VLLM_OMNI_PLUGIN_PAYLOAD_DIR"] = str(payload_base)
    with serving(tiny_qwen3_omni, ["--stage-configs-path", str(yaml_path),
                                   "--max-model-len", "2048", "--dtype", "float32",
                                   "--omni-admission-timeout", str(ADMISSION_TIMEOUT_S),
                                   # a request sent while the talker restarts waits for it:
                                   # a restart took 46 s on a 2-core host without AVX-512
                                   "--omni-replica-wait-timeout", str(REPLICA_WAIT_S)],
                 str(root / "serve.log"), env=env, api_key=API_KEY) as proc:
        proc.payload_base = payload_base
        proc.stale_dirs = (stale, live)
        yield proc


def _completion(server, **extra) -> requests.Response:
    return requests.post(f"{server.url}/v1/completions", timeout=300, headers=server.headers,
                         json={"model": server.model, "prompt": "Hello", "max_tokens": 4,
                               **extra})


def _assert_alive(server) -> None:
    assert server.proc.poll() is None, server.log()[-3000:]
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    ok = server.chat(server.audio_body())
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["audio"]["data"]


def _payload_keys_left(server) -> list[str]:
    own = [d for d in server.payload_base.iterdir() if d.name.startswith(
        f"vllm-omni-plugin-{server.proc.pid}-")]
    return sorted(str(p.relative_to(server.payload_base)) for d in own for p in d.iterdir())


def _assert_no_stack_trace_hint(message: str) -> None:
    assert "stack trace" not in message.lower(), message


# -- the closed boundary ---------------------------------------------------------
def test_stale_payload_dirs_of_dead_processes_removed_at_startup(server):
    stale, live = server.stale_dirs
    assert not stale.exists() and live.exists()
    assert "removed 1 payload directories of processes that no longer exist" in server.log()


# -- --api-key: the omni routes behind vLLM's own check ---------------------------------
def _omni_routes(server) -> dict[str, tuple[str, str, dict | None]]:
    """Each route the omni middleware answers or reads: ``(method, path, body)``."""
    audio_in = {"type": "input_audio", "input_audio": {
        "data": base64.b64encode(wav_bytes(0.5)).decode(), "format": "wav"}}
    return {
        "chat with speech": ("POST", "/v1/chat/completions", server.audio_body()),
        "chat with audio in": ("POST", "/v1/chat/completions", server.chat_body(
            messages=[{"role": "user", "content": [audio_in]}])),
        "speech": ("POST", "/v1/audio/speech", {"model": server.model, "input": "Hello",
                                                "voice": "ethan"}),
        "voices": ("GET", "/v1/audio/voices", None),
    }


@pytest.mark.parametrize("route", ["chat with speech", "chat with audio in", "speech",
                                   "voices"])
def test_without_the_key_each_omni_route_gets_vllms_401_and_with_it_an_answer(server, route):
    method, path, body = _omni_routes(server)[route]
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        refused = requests.request(method, f"{server.url}{path}", json=body, timeout=60,
                                   headers=headers)
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    answer = requests.request(method, f"{server.url}{path}", json=body, timeout=300,
                              headers=server.headers)
    assert answer.status_code == 200, answer.text[:500]
    assert answer.content


def test_a_realtime_socket_needs_the_key(server):
    """The openai SDK's realtime client: with the server's key a session starts; with
    another key the handshake is refused with HTTP 401, before any session."""
    import openai

    async def first_event(key: str) -> str:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key)
        async with client.realtime.connect(model=server.model) as connection:
            return (await asyncio.wait_for(connection.recv(), 60)).type

    assert asyncio.run(first_event(API_KEY)) == "session.created"
    with pytest.raises(Exception) as refused:
        asyncio.run(first_event("wrong-key"))
    assert "401" in str(refused.value), repr(refused.value)


def _http_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response read from ``sock``: its head, then ``content-length`` bytes
    of body (the two may come in separate reads: in CI the body came in a second one)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
            re.search(rb"(?i)\r\ncontent-length: *(\d+)", data).group(1)):
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {data[:300]!r}"
        data += chunk
    return data


def test_a_60_mb_body_without_the_key_is_refused_before_it_is_sent(server):
    """The headers and 1 MiB of a 60 MB chat body: vLLM's 401 comes without the server
    waiting for the other 59 MiB (the middleware used to read the whole body first)."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer wrong-key\r\n"
            b"Content-Length: %d\r\n\r\n" % (60 * 2**20))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + b"{" + b" " * 2**20)
        answer = _http_response(sock)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert answer.endswith(b'{"error":"Unauthorized"}'), answer[-200:]
    _assert_alive(server)


@pytest.mark.parametrize("xargs", [{"omni_plugin_payload": "x"},
                                   {"omni_plugin_payload": ["x"]},
                                   {"omni_plugin_modalities": ["text", "audio"]},
                                   {"omni_plugin_anything": 1, "fine": 2}])
def test_internal_extra_args_are_refused_on_every_endpoint(server, xargs):
    """The probe that killed the server (a string under ``omni_plugin_payload``)
    and the hidden pipeline run (``omni_plugin_modalities`` on a text chat)."""
    key = sorted(k for k in xargs if k.startswith("omni_plugin_"))[0]
    no_content_type = requests.post(  # FastAPI parses such a body as JSON too
        f"{server.url}/v1/chat/completions", data=json.dumps(server.chat_body(vllm_xargs=xargs)),
        timeout=300, headers=server.headers)
    for response in (server.chat(server.chat_body(vllm_xargs=xargs)),
                     server.chat(server.audio_body(vllm_xargs=xargs)),
                     _completion(server, vllm_xargs=xargs), no_content_type):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == f"vllm_xargs.{key}" and "reserved" in error["message"]
    _assert_alive(server)


def test_non_object_vllm_xargs_is_a_clean_400(server):
    before = server.log().count("Traceback")
    for value in ("omni", [1, 2], 3):
        r = server.chat(server.chat_body(vllm_xargs=value))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "vllm_xargs"
        assert "must be an object" in r.json()["error"]["message"]
    assert server.log().count("Traceback") == before


def test_other_vllm_xargs_still_reach_vllm(server):
    r = server.chat(server.chat_body(vllm_xargs={"my_plugin_flag": "on"}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("audio, field", [({"voice": ""}, "audio.voice"),
                                          ({"voice": "   "}, "audio.voice"),
                                          ({"voice": "x" * 10_000}, "audio.voice"),
                                          ({"voice": 7}, "audio.voice")])
def test_bad_voice_is_refused_without_echoing_it(server, audio, field):
    r = server.chat(server.audio_body(audio=audio))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert len(r.content) < 1000 and "x" * 100 not in server.log()


def test_n_null_means_one(server):
    r = server.chat(server.audio_body(n=None))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["audio"]["data"]


def test_client_disconnect_is_logged_and_cleans_up(server):
    """The talker's EngineCore is stopped (SIGSTOP) so the request is surely
    still there when the client goes away (read timeout)."""
    talker = server.engine_pid(1)
    os.kill(talker, signal.SIGSTOP)
    try:
        with pytest.raises(requests.Timeout):
            server.chat(server.audio_body(), timeout=(10, 3))
        server.wait_for_log(r"request \S+ cancelled \(client disconnected\) "
                            r"while at stage 1 \(talker\)", timeout_s=60)
    finally:
        os.kill(talker, signal.SIGCONT)
    _assert_alive(server)
    assert _payload_keys_left(server) == []


def test_streamed_client_disconnect_stops_the_stage_and_cleans_up(server):
    """A streamed chat with audio whose client goes away after the text, while the
    request waits at the talker (its EngineCore stopped with SIGSTOP so that it surely
    does): the talker's task is aborted and nothing stays in the payload store."""
    talker = server.engine_pid(1)
    os.kill(talker, signal.SIGSTOP)
    try:
        with requests.post(f"{server.url}/v1/chat/completions", stream=True, timeout=60,
                           headers=server.headers, json=server.audio_body(stream=True)) as r:
            assert r.status_code == 200
            # the iterator is kept: one dropped mid-way closes the connection (urllib3)
            lines = r.iter_lines()
            next(line for line in lines if line.startswith(b"data: "))
            deadline = time.monotonic() + 60
            while server.metric("vllm_omni:replica_requests_running", stage=1,
                                replica=0, location="local") != 1:
                assert time.monotonic() < deadline, "never reached the talker"
        server.wait_for_log(r"request \S+ cancelled \(client disconnected\) "
                            r"while at stage 1 \(talker\)", timeout_s=60)
        # the line is logged as the cancellation reaches the orchestrator; the talker's
        # task ends as the request's clean-up runs after it (CI once read the gauge first)
        server.wait_until(lambda: server.metric("vllm_omni:replica_requests_running",
                                                stage=1, replica=0, location="local") == 0,
                          timeout=30)
    finally:
        os.kill(talker, signal.SIGCONT)
    _assert_alive(server)
    assert _payload_keys_left(server) == []


# -- admission control -------------------------------------------------------------
def test_burst_beyond_the_admission_bound_gets_429_while_admitted_finish(server):
    """3x the talker's bound at once while the talker's EngineCore is stopped
    (SIGSTOP), so the admitted requests surely hold their slots: exactly the
    bound is admitted, the rest are refused after the admission timeout, and
    the admitted ones finish once the talker runs again."""
    burst = 3 * TALKER_BOUND
    refused_before = server.metric("vllm_omni:admission_refused_total") or 0
    responses: list[requests.Response | None] = [None] * burst
    talker = server.engine_pid(1)

    def send(i: int) -> None:
        responses[i] = server.chat(server.audio_body())

    threads = [threading.Thread(target=send, args=(i,)) for i in range(burst)]
    os.kill(talker, signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(r is not None for r in responses) < burst - TALKER_BOUND:
            assert time.monotonic() < deadline, [r and r.status_code for r in responses]
            time.sleep(0.05)
        assert server.metric("vllm_omni:stage_requests_in_flight", stage=1) == TALKER_BOUND
    finally:
        os.kill(talker, signal.SIGCONT)
    for t in threads:
        t.join()
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(admitted) == TALKER_BOUND and len(refused) == burst - TALKER_BOUND, \
        [(r.status_code, r.text[:200]) for r in responses]
    for r in admitted:
        assert r.json()["choices"][0]["message"]["audio"]["data"]
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        error = r.json()["error"]
        assert error["type"] == "RateLimitError" and "stage(s) [1]" in error["message"]
    refused_total = server.metric("vllm_omni:admission_refused_total")
    assert refused_total == refused_before + len(refused)
    assert server.metric("vllm_omni:stage_requests_in_flight", stage=1) == 0
    assert server.metric("vllm_omni:stage_admission_bound", stage=1) == TALKER_BOUND
    assert _payload_keys_left(server) == []


# -- fuzz --------------------------------------------------------------------------
def test_fuzzed_request_bodies_never_take_the_server_down(server):
    """A few hundred generated chat bodies over the fields the plugin reads:
    every answer is 2xx or 4xx, the server stays up, nothing stays in the
    payload store."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3),
                        st.text(max_size=12), st.floats(allow_nan=False, width=32))
    values = st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
        max_leaves=6)
    xargs_keys = st.one_of(st.sampled_from(["omni_plugin_payload", "omni_plugin_modalities",
                                            "omni_plugin_speaker", "seed_hint", ""]),
                           st.text(max_size=16))
    fields = {
        "vllm_xargs": st.one_of(values, st.dictionaries(xargs_keys, values, max_size=3)),
        "audio": st.one_of(values, st.fixed_dictionaries(
            {}, optional={"voice": st.one_of(st.sampled_from(["ethan", "Ethan", "", "nobody"]),
                                             values),
                          "format": st.one_of(st.sampled_from(["wav", "mp3"]), values)})),
        "modalities": st.one_of(values, st.lists(st.sampled_from(["text", "audio", "video"]),
                                                 max_size=3)),
        "n": st.one_of(st.none(), st.integers(-1, 3), values),
        "max_tokens": st.one_of(st.none(), st.integers(-2, 6), values),
    }
    bodies = st.fixed_dictionaries({}, optional=fields)
    answers: dict[int, int] = {}

    @settings(max_examples=250, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def check(extra):
        body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}],
                "temperature": 0, "max_tokens": 4}
        body.update(extra)
        r = requests.post(f"{server.url}/v1/chat/completions", data=json.dumps(body),
                          headers={"Content-Type": "application/json", **server.headers},
                          timeout=120)
        answers[r.status_code] = answers.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.status_code, r.text[:500])
        assert server.proc.poll() is None

    check()
    print(f"fuzz answers by status: {dict(sorted(answers.items()))}")
    assert answers.get(200) and answers.get(400)
    _assert_alive(server)
    assert _payload_keys_left(server) == []


# -- supervised stage engines (kill -9) --------------------------------------------
def test_killed_idle_talker_is_restarted_and_serves_again(server):
    pid = server.engine_pid(1)
    os.kill(pid, signal.SIGKILL)
    server.wait_for_log(r"stage 1 replica 0 \(local [^)]*\): engine core exited "
                        r"\(exit code -9\)", timeout_s=30)
    # sent while the talker restarts: waits for it instead of failing
    r = server.chat(server.audio_body())
    assert r.status_code == 200, r.text
    server.wait_for_log(r"stage 1 replica 0 .*restarted in [0-9.]+ s", timeout_s=120)
    labels = {"stage": 1, "replica": 0, "location": "local"}
    assert server.metric("vllm_omni:replica_status", **labels, status="up") == 1
    assert server.metric("vllm_omni:replica_restarts_total", **labels) == 1
    assert server.engine_pid(1) != pid


def test_talker_killed_mid_request_is_resubmitted_then_recovers(server):
    """The talker's EngineCore is stopped (SIGSTOP) before the request, so the request
    surely waits there with no codec frame produced when it is killed (SIGKILL): it is
    resubmitted to the restarted talker and answered."""
    pid = server.engine_pid(1)
    os.kill(pid, signal.SIGSTOP)
    result: dict[str, requests.Response] = {}
    sender = threading.Thread(target=lambda: result.update(r=server.chat(server.audio_body())))
    sender.start()
    try:
        deadline = time.monotonic() + 60
        while server.metric("vllm_omni:replica_requests_running", stage=1, replica=0,
                            location="local") != 1:
            assert time.monotonic() < deadline and sender.is_alive(), "never reached the talker"
    finally:
        os.kill(pid, signal.SIGKILL)
    sender.join()
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["audio"]["data"]
    assert server.metric("vllm_omni:stage_resubmissions_total", stage=1) >= 1
    server.wait_for_log(r"restarted in [0-9.]+ s; up again(?s:.*)restarted in [0-9.]+ s",
                        timeout_s=120)
    _assert_alive(server)
    assert _payload_keys_left(server) == []


def test_dead_stage_without_restarts_fails_audio_at_once_text_keeps_serving(server):
    os.kill(server.engine_pid(2), signal.SIGKILL)
    server.wait_for_log(r"stage 2 replica 0 .*given up after 0 restart attempt", timeout_s=30)
    r = server.chat(server.audio_body())
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "stage 2 (code2wav): no replica available for stage 2" in message
    assert int(r.headers["Retry-After"]) >= 1
    labels = {"stage": 2, "replica": 0, "location": "local"}
    assert server.metric("vllm_omni:replica_status", **labels, status="down") == 1
    ok = server.chat(server.chat_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    assert _payload_keys_left(server) == []
