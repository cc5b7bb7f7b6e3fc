"""The omni middleware's routes sit behind vLLM's own API-key check.

The app is vLLM's: a FastAPI app whose middleware vLLM's own
``init_entrypoints_middleware`` installs from ``vllm serve``'s arguments (``--api-key``,
``--middleware`` naming the omni middleware, as omni mode appends it), called at the ASGI
level so that what the middleware reads from the client can be counted. Runs on every
release row: the canary of :mod:`vllm_omni_plugin.compat.api_auth`.
"""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace

import pytest

from vllm_omni_plugin.compat.api_auth import vllm_auth_middleware
from vllm_omni_plugin.config.cli import MIDDLEWARE_QUALNAME
from vllm_omni_plugin.entrypoints.chat_audio import CHAT_PATH
from vllm_omni_plugin.entrypoints.middleware import VOICES_PATH
from vllm_omni_plugin.entrypoints.realtime import REALTIME_PATH
from vllm_omni_plugin.entrypoints.speech import SPEECH_PATH

KEY = "sk-omni-test"
#: a body larger than any the middleware reads (its limit is 64 MiB), sent in 1 MiB parts
BODY_BYTES = 60 * 1024 * 1024
PART = 1024 * 1024


def _app(api_key: list[str] | None):
    """vLLM's API app with the middleware ``vllm serve --api-key KEY`` gives it in omni
    mode, and a stand-in route for what vLLM would answer."""
    from fastapi import FastAPI
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    app = FastAPI()

    @app.post(CHAT_PATH)
    async def chat():
        return {"object": "chat.completion"}

    args = Namespace(allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"],
                     allowed_headers=["*"], api_key=api_key, enable_request_id_headers=False,
                     middleware=[MIDDLEWARE_QUALNAME])
    init_entrypoints_middleware(args, app, ("generate",))
    return app


def _headers(key: str | None, *extra) -> list[tuple[bytes, bytes]]:
    auth = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return [*auth, *extra]


def _run(app, scope: dict, messages: list[dict]) -> tuple[list[dict], int]:
    """Call ``app`` with ``scope``; the client sends ``messages`` then waits. Returns what
    the app sent and how many messages it read."""
    sent: list[dict] = []
    read = 0

    async def receive():
        nonlocal read
        if read < len(messages):
            read += 1
            return messages[read - 1]
        await asyncio.Event().wait()  # the client sends nothing more

    async def send(message):
        sent.append(message)

    async def call():
        await asyncio.wait_for(app(scope, receive, send), timeout=30)

    asyncio.run(call())
    return sent, read


def _http(app, method: str, path: str, key: str | None, body: bytes = b"",
          parts: int = 1) -> tuple[int, bytes, int]:
    """``(status, body, messages read)`` of one HTTP request, its body in ``parts``."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "query_string": b"", "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1),
             "headers": _headers(key, (b"content-type", b"application/json"))}
    size = -(-len(body) // parts) if body else 0
    messages = [{"type": "http.request", "body": body[i * size:(i + 1) * size],
                 "more_body": i < parts - 1} for i in range(parts)]
    sent, read = _run(app, scope, messages)
    start = next(m for m in sent if m["type"] == "http.response.start")
    answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], answer, read


def test_vllm_adds_its_key_check_inside_the_omni_middleware():
    """The canary: vLLM adds its ``AuthenticationMiddleware`` (found by the compat module)
    with ``--api-key``, none without, and the ``--middleware`` entries after it, i.e.
    outside it (Starlette runs the last added first): why the omni middleware needs the
    check itself."""
    guarded, open_app = _app([KEY]), _app(None)
    entry = vllm_auth_middleware(guarded)
    assert entry is not None and vllm_auth_middleware(open_app) is None
    names = [f"{m.cls.__module__}.{m.cls.__name__}" for m in guarded.user_middleware]
    assert names.index(MIDDLEWARE_QUALNAME) < names.index(
        f"{entry.cls.__module__}.{entry.cls.__name__}")


@pytest.mark.parametrize("method,path", [("GET", VOICES_PATH), ("POST", SPEECH_PATH),
                                         ("POST", CHAT_PATH)])
def test_without_the_key_every_omni_route_gets_vllms_401_unread(method, path):
    body = json.dumps({"model": "m", "input": "hi", "messages": []}).encode()
    status, answer, read = _http(_app([KEY]), method, path, None,
                                 body if method == "POST" else b"")
    assert (status, json.loads(answer)) == (401, {"error": "Unauthorized"})
    assert read == 0


def test_a_60_mb_body_without_the_key_is_refused_without_being_read():
    body = b"{" + b" " * (BODY_BYTES - 2) + b"}"
    status, answer, read = _http(_app([KEY]), "POST", CHAT_PATH, "wrong-key", body,
                                 parts=BODY_BYTES // PART)
    assert (status, json.loads(answer), read) == (401, {"error": "Unauthorized"}, 0)


def test_with_the_key_the_omni_middleware_answers():
    status, answer, _ = _http(_app([KEY]), "GET", VOICES_PATH, KEY)
    assert status == 200 and json.loads(answer)["object"] == "list"
    # a body the middleware reads and checks, then vLLM's route answers
    status, answer, read = _http(_app([KEY]), "POST", CHAT_PATH, KEY, json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert (status, json.loads(answer), read) == (200, {"object": "chat.completion"}, 1)


def test_without_a_configured_key_nothing_is_checked():
    status, _, _ = _http(_app(None), "GET", VOICES_PATH, None)
    assert status == 200


def _websocket(app, key: str | None) -> list[dict]:
    scope = {"type": "websocket", "path": REALTIME_PATH, "root_path": "",
             "query_string": b"", "headers": _headers(key), "scheme": "ws",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1), "subprotocols": [],
             "extensions": {"websocket.http.response": {}}}
    sent, _ = _run(app, scope, [{"type": "websocket.connect"},
                                {"type": "websocket.disconnect", "code": 1000}])
    return sent


def test_a_realtime_socket_without_the_key_is_refused_before_it_is_accepted():
    sent = _websocket(_app([KEY]), "wrong-key")
    assert [m["type"] for m in sent][:1] == ["websocket.http.response.start"]
    assert sent[0]["status"] == 401
    assert not [m for m in sent if m["type"] in ("websocket.accept", "websocket.send")]


def test_a_realtime_socket_with_the_key_gets_its_session():
    sent = _websocket(_app([KEY]), KEY)
    assert sent[0]["type"] == "websocket.accept"
    first = json.loads(next(m["text"] for m in sent if m["type"] == "websocket.send"))
    assert first["type"] == "session.created"
