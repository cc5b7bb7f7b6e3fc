"""Prefill/decode disaggregation of the entry stage: a request's prefill on its prefill stage.

When the entry stage is a decode stage (``pd.role: decode``), every request first runs
on a replica of its prefill stage: the prompt's token ids, one output token,
``ignore_eos``, vLLM's ``kv_transfer_params`` asking the prefill engine to keep the KV
cache under a fresh ``transfer_id``. The entry engine then gets the client's prompt and
sampling parameters plus the parameters that make it pull that KV cache (the prefill
replica says where from: :attr:`Prefilled.decode_params`). The prefill stage publishes
the prompt's rows, the entry stage the generated ones; the downstream stages see them
joined, as without PD. Client ``kv_transfer_params`` never reach an engine.
"""

from __future__ import annotations

import uuid

from vllm_omni_plugin.engine.errors import StageError
from vllm_omni_plugin.engine.pipeline_run import PipelineRun
from vllm_omni_plugin.kv_transfer import (
    KV_TRANSFER_PARAMS,
    decode_request_params,
    prefill_request_params,
)
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.replicas.task import StageTask

logger = init_logger(__name__)

#: :meth:`RemotePrefill.run`'s result for a request aborted meanwhile.
ABORTED = object()


class Prefilled:
    """A prompt prefilled on the prefill stage: the decode engine's ``kv_transfer_params``
    and the prompt's published rows (``{}`` when not published)."""

    def __init__(self, decode_params: dict, payload: dict) -> None:
        self.decode_params = decode_params
        self.payload = payload


def decode_extra(prefilled: Prefilled | None) -> dict:
    """The ``extra_args`` that make the decode engine pull a prefilled prompt's KV cache
    (``{}`` when the decode engine prefills the prompt itself)."""
    return {KV_TRANSFER_PARAMS: prefilled.decode_params} if prefilled else {}


class RemotePrefill:
    """Runs requests' prompts on the entry (decode) stage's prefill stage.

    Args:
        prefill: the prefill stage's ``StageConfig``.
        decode: the entry stage's ``StageConfig``.
        run_task: ``(PipelineRun, stage, StageTask)`` -> its ``StageRun``, None when
            aborted (raises ``StageError``).
    """

    def __init__(self, prefill, decode, run_task) -> None:
        self.prefill = prefill
        self._decode = decode
        self._run_task = run_task

    async def run(self, run: PipelineRun, token_ids: list[int] | None, params, publish: bool,
                  cache_salt: str | None = None):
        """Run the request's prompt (``token_ids``) on the prefill stage; ``publish``: the
        prefill stage publishes the prompt's rows (a pipeline request); ``cache_salt``: the
        client's, under which the prefill engine's prefix cache serves the prompt.

        Returns the :class:`Prefilled` result; None when the decode stage prefills this
        request itself (a prompt given other than as token ids, such as one with
        multimodal data: ``token_ids`` None; or ``n > 1``); :data:`ABORTED` when the
        request was aborted meanwhile.

        Raises:
            StageError: the prefill stage failed, or did not keep the KV cache.
        """
        if token_ids is None or getattr(params, "n", 1) != 1:
            logger.info("request %s: prefilled by stage %d itself (%s)", run.request_id,
                        self._decode.stage_id, "n > 1" if token_ids else
                        "the prompt is not plain token ids")
            return None
        stage = self.prefill
        transfer_id = uuid.uuid4().hex
        task = StageTask(
            request_id=f"{run.request_id}-s{stage.stage_id}", prompt_token_ids=token_ids,
            sampling={"max_tokens": 1, "min_tokens": 0, "ignore_eos": True,
                      "temperature": 0.0, "extra_args": {
                          KV_TRANSFER_PARAMS: prefill_request_params(transfer_id)}},
            publish=publish, cache_salt=cache_salt)
        stage_run = await self._run_task(run, stage, task)
        if stage_run is None or run.aborted:
            return ABORTED
        if stage_run.finish_reason != "length" or not stage_run.prefill_engine:
            raise StageError(stage.stage_id, stage.name, "the prefill engine did not keep "
                             f"the KV cache (finish reason {stage_run.finish_reason!r}, "
                             f"engine {stage_run.prefill_engine})")
        return Prefilled(decode_request_params(transfer_id, stage_run.prefill_engine),
                         stage_run.payload)

    def check_kv_loaded(self, prefilled: Prefilled | None, final) -> None:
        """Raise when the decode engine ended a prefilled request with finish reason
        ``error``: it could not load the prompt's KV cache (the prefill replica died or
        is unreachable, or the transfer outlasted the connector's timeout).

        Raises:
            StageError: names the prefill stage and engine.
        """
        if not prefilled or not final.outputs or final.outputs[0].finish_reason != "error":
            return
        engine = prefilled.decode_params
        raise StageError(
            self.prefill.stage_id, self.prefill.name,
            f"stage {self._decode.stage_id} ({self._decode.name}) could not load the "
            f"prompt's KV cache from prefill engine {engine.get('remote_engine_id')} "
            f"({engine.get('remote_bootstrap_addr')}); the decode engine's log says why",
            status=503)
