"""The API middleware's answer when vLLM's handler raises for a request the orchestrator
already failed: the recorded status and message (vLLM would answer every exception with
500). The app is a scripted ASGI callable standing in for vLLM's FastAPI app."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm_omni_plugin.engine.omni_request import StageResult, current_omni_request
from vllm_omni_plugin.entrypoints.audio_output import COMPLETIONS_PATH, OmniAudioMiddleware


def _call(app) -> list[dict]:
    sent: list[dict] = []
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": COMPLETIONS_PATH,
             "headers": [(b"content-type", b"application/json")]}
    asyncio.run(OmniAudioMiddleware(app)(scope, receive, send))
    return sent


def test_recorded_failure_answers_with_its_status_when_vllm_raises():
    async def app(scope, receive, send):
        await receive()
        current_omni_request().result = StageResult.failure("stage 3 (p): no KV cache", 503)
        raise RuntimeError("stage 3 (p): no KV cache")

    start, body = _call(app)
    assert start["status"] == 503
    error = json.loads(body["body"])["error"]
    assert error["message"] == "stage 3 (p): no KV cache" and error["code"] == 503


def test_other_exceptions_reach_vllm_unchanged():
    async def app(scope, receive, send):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _call(app)
