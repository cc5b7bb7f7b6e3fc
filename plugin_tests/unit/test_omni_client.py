"""``OmniEngineClient.generate``: a request the orchestrator passes through is vLLM's own
``AsyncLLM.generate``; any other goes through the orchestrator.

The client is built without its ``__init__`` (which starts engines): its head is a
scripted fake whose orchestrator answers ``passes_through`` as told and records what it
was asked to run; nothing is iterated, so no engine is needed.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.engine.async_llm import AsyncLLM

from vllm_omni_plugin.engine.omni_client import OmniEngineClient


class _Orchestrator:
    def __init__(self, passes: bool) -> None:
        self.passes = passes
        self.generated: list = []

    def passes_through(self, params) -> bool:
        return self.passes

    def generate(self, *args, **kwargs):
        self.generated.append((args, kwargs))
        return "orchestrated"


class _Head:
    def __init__(self, orchestrator) -> None:
        self.orchestrator = orchestrator
        self.starts = 0

    def start(self) -> None:
        self.starts += 1


def _client(passes: bool) -> OmniEngineClient:
    client = object.__new__(OmniEngineClient)
    client.head = _Head(_Orchestrator(passes))
    client.shutdown = lambda: None  # AsyncLLM.__del__ calls it: there is no engine to stop
    return client


def test_a_request_passed_through_is_asyncllm_generate_itself():
    client = _client(passes=True)
    stream = client.generate({"prompt_token_ids": [1]}, SimpleNamespace(), "req-1")
    # an AsyncLLM.generate generator (never started), not a wrapper around one
    assert stream.ag_code is AsyncLLM.generate.__code__
    assert client.head.orchestrator.generated == [] and client.head.starts == 1


def test_any_other_request_goes_through_the_orchestrator():
    client = _client(passes=False)
    params = SimpleNamespace()
    assert client.generate("prompt", params, "req-2", priority=3) == "orchestrated"
    assert client.head.orchestrator.generated == [(("prompt", params, "req-2"),
                                                   {"priority": 3})]
    assert client.head.starts == 1
