"""Request flow between stages.

For a request that asks only for text the entry stage's output is streamed
unchanged (plain vLLM behaviour). When the request asks for more (e.g. audio,
``SamplingParams.extra_args[extra_args.MODALITIES]``), the orchestrator holds
back the entry stage's final output, runs each downstream stage in topological
order — stage input processor, input payload, one request on the stage's
engine — stores the final stage's result for the API layer and then releases
the final output. Abort propagates to every stage; a failure fails the request
with an error naming the stage, and nothing else.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.kv_transfer.payload import PayloadError, PayloadStore, safe_key
from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)


class StageError(RuntimeError):
    """A stage failed for one request. ``stage_id``/``stage_name`` name it;
    ``status`` is the HTTP status the API layer answers with (400 when the
    request itself was at fault, e.g. an unknown voice, else 500)."""

    def __init__(self, stage_id: int, stage_name: str, message: str, status: int = 500):
        super().__init__(f"stage {stage_id} ({stage_name}): {message}")
        self.stage_id = stage_id
        self.stage_name = stage_name
        self.status = status


@dataclass
class StageResult:
    """What the final non-entry stage produced for one request."""

    output_type: str
    payload: dict[str, Any] = field(default_factory=dict)
    sample_rate: int | None = None  # Hz, for audio
    status: int = 200  # HTTP status for the API layer when ``error`` is set
    #: the final stage's input payload (e.g. code2wav's codec codes), small by design
    final_input: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    created: float = field(default_factory=time.monotonic)


class ResultBox:
    """Bounded, time-limited hand-over of stage results to the API layer."""

    def __init__(self, max_items: int = 1024, ttl_s: float = 600.0):
        self._items: dict[str, StageResult] = {}
        self.max_items, self.ttl_s = max_items, ttl_s

    def put(self, key: str, result: StageResult) -> None:
        now = time.monotonic()
        for k in [k for k, r in self._items.items() if now - r.created > self.ttl_s]:
            del self._items[k]
        while len(self._items) >= self.max_items:
            del self._items[next(iter(self._items))]
        self._items[key] = result

    def pop(self, key: str) -> StageResult | None:
        return self._items.pop(key, None)


#: Process-wide: the API server middleware and the engine client share a process.
RESULTS = ResultBox()


class Orchestrator:
    def __init__(self, client, pipeline, store: PayloadStore, engines: dict):
        self.client = client
        self.pipeline = pipeline
        self.store = store
        self.engines = engines  # stage_id -> StageEngine (downstream stages)
        self.entry = pipeline.entry_stage
        self._inflight: dict[str, set[tuple[int, str]]] = {}
        self._aborted: set[str] = set()

    @classmethod
    def start(cls, client, vllm_config, settings: dict) -> Orchestrator:
        from vllm_omni_plugin.config.loader import load_pipeline_config
        from vllm_omni_plugin.engine.stages import start_stage_engine

        pipeline = load_pipeline_config(settings["stage_configs_path"])
        store = PayloadStore(settings["payload_dir"])
        downstream = [s for s in pipeline.topological_order()
                      if s.stage_id != pipeline.entry_stage.stage_id]
        # Stage engines start concurrently: each start is mostly an EngineCore
        # process spawning, importing and handshaking.
        engines, errors = {}, []
        with ThreadPoolExecutor(max_workers=max(1, len(downstream)),
                                thread_name_prefix="omni-stage-start") as pool:
            futures = {s.stage_id: pool.submit(start_stage_engine, s, vllm_config, settings)
                       for s in downstream}
            for stage_id, future in futures.items():
                try:
                    engines[stage_id] = future.result()
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            for e in engines.values():
                e.engine.shutdown()
            store.close()
            raise errors[0]
        return cls(client, pipeline, store, engines)

    # -- request flow ---------------------------------------------------------
    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        extra = dict(sampling_params.extra_args or {})
        modalities = extra.get(xargs.MODALITIES) or ["text"]
        if list(modalities) == ["text"]:
            async for out in self.client.entry_generate(
                prompt, sampling_params, request_id, *args, **kwargs
            ):
                yield out
            return

        result_key = str(extra.get(xargs.RESULT) or uuid.uuid4().hex)
        base = safe_key(f"{request_id}.{uuid.uuid4().hex[:6]}")
        entry_out_key = f"{base}.s{self.entry.stage_id}.out"
        params = sampling_params.clone()
        params.extra_args = {**extra, xargs.PAYLOAD: {"out": entry_out_key}}
        keys = [entry_out_key]
        self.store.create(entry_out_key)
        self._inflight[request_id] = set()
        final = None
        try:
            async for out in self.client.entry_generate(prompt, params, request_id, *args,
                                                        **kwargs):
                if out.finished:
                    final = out
                else:
                    yield out
            if final is None:
                return
            outputs = {self.entry.stage_id: _stage_output(
                self.entry.stage_id, final, await self._payload(self.entry, entry_out_key))}
            result = await self._run_downstream(request_id, base, outputs, extra, keys)
            if result is None:  # aborted between stages
                return
            RESULTS.put(result_key, result)
        except StageError as exc:
            logger.error("request %s failed: %s", request_id, exc)
            RESULTS.put(result_key, StageResult(output_type="error", error=str(exc),
                                                status=exc.status))
        finally:
            await asyncio.to_thread(self._delete, keys)
            self._inflight.pop(request_id, None)
            self._aborted.discard(request_id)
        if final is not None:
            yield final

    async def _run_downstream(self, request_id, base, outputs, extra, keys) -> StageResult | None:
        """Run every downstream stage; None when the request was aborted meanwhile."""
        from vllm_omni_plugin.processors.registry import get_processor

        last, last_input = None, {}
        for stage in self.pipeline.topological_order():
            if stage.stage_id == self.entry.stage_id:
                continue
            in_key, out_key = f"{base}.s{stage.stage_id}.in", f"{base}.s{stage.stage_id}.out"
            keys += [in_key, out_key]
            try:
                processor = get_processor(stage.input_processor)
                extras = {**extra, "hf_config": self.client.model_config.hf_config}
                stage_input = processor([outputs[s] for s in stage.inputs], stage, extras)
            except ValueError as exc:  # processors raise ValueError for bad requests
                raise StageError(stage.stage_id, stage.name,
                                 f"input processor {stage.input_processor!r}: {exc}",
                                 status=400) from exc
            except Exception as exc:
                raise StageError(stage.stage_id, stage.name,
                                 f"input processor {stage.input_processor!r}: {exc}") from exc
            await asyncio.to_thread(self.store.put, in_key, stage_input.payload)
            self.store.create(out_key)
            last_input = stage_input.payload
            if request_id in self._aborted:
                return None
            final = await self._run_stage(request_id, stage, stage_input, in_key, out_key)
            if request_id in self._aborted:
                return None
            outputs[stage.stage_id] = _stage_output(stage.stage_id, final,
                                                    await self._payload(stage, out_key))
            last = stage
        if last is None or not last.final_output:
            raise StageError(self.entry.stage_id, self.entry.name,
                             "the pipeline has no final downstream stage")
        payload = dict(outputs[last.stage_id].payload)
        rate = payload.pop("sample_rate", None)
        return StageResult(output_type=last.final_output_type or "latent", payload=payload,
                           sample_rate=int(rate[0]) if rate is not None else None,
                           final_input=last_input)

    async def _run_stage(self, request_id, stage, stage_input, in_key, out_key):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params_dict = {**stage.default_sampling_params, **stage_input.sampling_overrides}
        try:
            params = SamplingParams(**params_dict)
        except Exception as exc:
            raise StageError(stage.stage_id, stage.name,
                             f"sampling params {params_dict}: {exc}") from exc
        params.extra_args = {xargs.PAYLOAD: {"in": in_key, "out": out_key}}
        engine = self.engines[stage.stage_id].engine
        sub_id = f"{request_id}-s{stage.stage_id}"
        self._inflight.setdefault(request_id, set()).add((stage.stage_id, sub_id))
        final = None
        prompt = TokensPrompt(prompt_token_ids=list(stage_input.prompt_token_ids))
        try:
            async with aclosing(engine.generate(prompt, params, sub_id)) as stream:
                async for out in stream:
                    final = out
                    # abort() may have run before this engine knew sub_id
                    if request_id in self._aborted:
                        await engine.abort(sub_id)
                        break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise StageError(stage.stage_id, stage.name, f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._inflight.get(request_id, set()).discard((stage.stage_id, sub_id))
        if request_id in self._aborted:
            return None  # the caller stops the pipeline
        if final is None or not final.finished:
            raise StageError(stage.stage_id, stage.name, "produced no final output")
        return final

    # Payload I/O runs in a thread: tensors can be large and the API server's
    # event loop must keep serving.
    async def _payload(self, stage, key: str) -> dict:
        try:
            return await asyncio.to_thread(self.store.get, key)
        except PayloadError as exc:
            raise StageError(stage.stage_id, stage.name, str(exc)) from exc

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self.store.delete(key)

    async def abort(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if rid not in self._inflight:
                continue
            self._aborted.add(rid)
            for stage_id, sub_id in list(self._inflight.get(rid, ())):
                await self.engines[stage_id].engine.abort(sub_id)

    def shutdown(self) -> None:
        for stage_engine in self.engines.values():
            try:
                stage_engine.engine.shutdown()
            except Exception:
                logger.exception("stage %d shutdown failed", stage_engine.stage_id)
        self.engines = {}
        if os.path.isdir(self.store.root):
            self.store.close()


def _stage_output(stage_id: int, request_output, payload):
    from vllm_omni_plugin.processors.hookspecs import UpstreamOutput

    completion = request_output.outputs[0]
    return UpstreamOutput(
        stage_id=stage_id,
        prompt_token_ids=list(request_output.prompt_token_ids or []),
        output_token_ids=list(completion.token_ids),
        payload=payload,
    )
