"""``OmniEngineClient``: the engine client vLLM's API server uses in omni mode.

It *is* the entry stage's ``AsyncLLM`` (so every ``EngineClient`` method vLLM
adds keeps working) and owns the :class:`Orchestrator` that carries a request
through the downstream stages when the client asked for more than text.
"""

from __future__ import annotations

from vllm.v1.engine.async_llm import AsyncLLM

from vllm_omni_plugin.config.settings import stage_settings
from vllm_omni_plugin.engine.orchestrator import Orchestrator
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


class OmniEngineClient(AsyncLLM):
    """``AsyncLLM`` of the entry stage plus the pipeline's other stages."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        try:
            self.orchestrator = Orchestrator.start(self, vllm_config, stage_settings(vllm_config))
        except BaseException:
            super().shutdown()
            raise

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        async for output in self.orchestrator.generate(
            prompt, sampling_params, request_id, *args, **kwargs
        ):
            yield output

    def entry_generate(self, *args, **kwargs):
        """The entry stage's own ``AsyncLLM.generate``."""
        return super().generate(*args, **kwargs)

    async def abort(self, request_id, *args, **kwargs) -> None:
        await super().abort(request_id, *args, **kwargs)
        await self.orchestrator.abort(request_id)

    def shutdown(self, *args, **kwargs) -> None:
        orchestrator = getattr(self, "orchestrator", None)
        if orchestrator is not None:
            orchestrator.shutdown()
        super().shutdown(*args, **kwargs)
