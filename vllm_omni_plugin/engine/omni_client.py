"""``OmniEngineClient``: the engine client vLLM's API server uses in omni mode.

It *is* the entry stage's ``AsyncLLM`` (so every ``EngineClient`` method vLLM
adds keeps working) and owns the :class:`~vllm_omni_plugin.engine.bootstrap.Head`
(built by :func:`~vllm_omni_plugin.engine.bootstrap.build_head`), whose
orchestrator carries a request through the downstream stages when the client
asked for more than text.
"""

from __future__ import annotations

from vllm.v1.engine.async_llm import AsyncLLM

from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.engine.bootstrap import bind_control_plane, build_head
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


class OmniEngineClient(AsyncLLM):
    """``AsyncLLM`` of the entry stage plus the pipeline's other stages."""

    def __init__(self, vllm_config, *args, **kwargs):
        settings = OmniSettings.from_vllm_config(vllm_config)
        cluster = bind_control_plane(settings)  # replicas register while the engine loads
        try:
            super().__init__(vllm_config, *args, **kwargs)
            try:
                self.head = build_head(self, vllm_config, settings, cluster)
            except BaseException:
                super().shutdown()
                raise
        except BaseException:
            cluster.close()
            raise

    @property
    def orchestrator(self):
        """The head's :class:`~vllm_omni_plugin.engine.orchestrator.Orchestrator`."""
        return self.head.orchestrator

    def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        """The request's outputs (an async iterator of ``RequestOutput``, as
        ``AsyncLLM.generate`` gives them); starts the head on the first call. A request the
        orchestrator passes through (:meth:`~vllm_omni_plugin.engine.orchestrator.
        Orchestrator.passes_through`: text alone, no prefill stage, no request timeout) is
        ``AsyncLLM.generate`` itself, as in plain vLLM; any other goes through the head's
        orchestrator, which also runs its downstream stages."""
        self.head.start()
        orchestrator = self.head.orchestrator
        if orchestrator.passes_through(sampling_params):
            return super().generate(prompt, sampling_params, request_id, *args, **kwargs)
        return orchestrator.generate(prompt, sampling_params, request_id, *args, **kwargs)

    def entry_generate(self, *args, **kwargs):
        """The entry stage's own ``AsyncLLM.generate``."""
        return super().generate(*args, **kwargs)

    async def entry_abort(self, request_id) -> None:
        """The entry stage's own ``AsyncLLM.abort``."""
        await super().abort(request_id)

    async def abort(self, request_id, *args, **kwargs) -> None:
        """Abort on the head's engine (vLLM's ``AsyncLLM.abort``), then the request's tasks
        on stage replicas (:meth:`~vllm_omni_plugin.engine.orchestrator.Orchestrator.abort`)."""
        await super().abort(request_id, *args, **kwargs)
        await self.head.orchestrator.abort(request_id)

    def shutdown(self, *args, **kwargs) -> None:
        """Shut the head down (when it was built), then the entry engine."""
        head = getattr(self, "head", None)
        if head is not None:
            head.shutdown()
        super().shutdown(*args, **kwargs)
