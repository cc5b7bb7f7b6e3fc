"""The reference worker: runs the talker and code2wav stage models eagerly on CPU.

Selected per stage through vLLM's ``worker_cls`` extension point (the stage YAML's
``engine_args``), until those stages move onto vLLM's own model runner as the
thinker has (``worker/omni_worker.py``). It honours vLLM's scheduler: chunked
prefills, block tables from ``KVCacheConfig`` (a real paged KV cache held in
torch tensors), preemption/resumption and finished requests. Each scheduled
request slice runs through :meth:`OmniStageModel.forward_step`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_omni_plugin.config.settings import OmniSettings
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.models.stage_model import OmniStageModel, StepInput, StepOutput
from vllm_omni_plugin.payload_store import PayloadStore
from vllm_omni_plugin.reference.paged_attention import PagedKVView, use_paged_kv
from vllm_omni_plugin.reference.sampler import sample
from vllm_omni_plugin.worker.stage_io import request_payload_keys, stop_token_of

logger = init_logger(__name__)

_LAYER_NAME = "omni_ref.layers.{}"
#: KV cache bytes when neither ``--kv-cache-memory-bytes`` nor
#: ``VLLM_CPU_KVCACHE_SPACE`` is given.
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024


@dataclass
class _Request:
    req_id: str
    token_ids: list[int]
    num_prompt: int
    block_ids: list[int]
    params: Any
    payload: dict[str, torch.Tensor]
    out_key: str | None
    #: where a failure is recorded (the output key, else the error slot)
    failure_key: str | None
    generator: torch.Generator | None
    state: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    #: positions whose payload rows were published (recompute after preemption
    #: must not publish them again)
    published: int = 0


class ReferenceWorker(WorkerBase):
    """vLLM ``WorkerBase`` running :class:`OmniStageModel` stages in PyTorch on CPU."""

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        torch.manual_seed(self.model_config.seed or 0)
        self.requests: dict[str, _Request] = {}
        self.kv_caches: list[torch.Tensor] = []
        self._pending: list[tuple[_Request, StepInput, StepOutput]] = []
        self._pending_ids: list[str] = []
        settings = OmniSettings.from_vllm_config(self.vllm_config)
        self.stage_id = settings.stage_id if settings else 0
        self.store = PayloadStore(settings.payload_dir) if settings and settings.payload_dir \
            else None

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        from vllm.model_executor.models.registry import ModelRegistry

        start = time.perf_counter()
        model_cls, arch = ModelRegistry.resolve_model_cls(
            self.model_config.architectures, self.model_config
        )
        if not (isinstance(model_cls, type) and issubclass(model_cls, OmniStageModel)):
            raise TypeError(
                f"the reference worker runs only vllm-omni-plugin stage models; "
                f"architecture {arch!r} resolves to {model_cls.__module__}.{model_cls.__name__}. "
                "Use vllm_omni_plugin.worker.omni_worker.OmniWorker (or vLLM's own worker) "
                "for it, or point the stage's hf_overrides.architectures at a stage model"
            )
        with torch.device("cpu"):
            self.model: OmniStageModel = model_cls(vllm_config=self.vllm_config)
        if not load_dummy_weights:
            self.model.load_checkpoint(self.model_config.model)
        self.model.eval()
        logger.info(
            "stage %s: loaded %s in %.2f s (reference backend, CPU)",
            self.stage_id, arch, time.perf_counter() - start,
        )

    def get_model(self):
        return self.model

    def get_supported_tasks(self):
        return ("generate",)

    def determine_available_memory(self) -> int:
        return int(self.cache_config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES)

    def _shapes(self) -> list[tuple[int, int]]:
        # A stage without attention (e.g. code2wav) still gets one tiny layer so
        # vLLM's KV cache manager and scheduler work unchanged.
        return self.model.kv_cache_shapes() or [(1, 8)]

    def get_kv_cache_spec(self):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        return {
            _LAYER_NAME.format(i): FullAttentionSpec(
                block_size=self.cache_config.block_size,
                num_kv_heads=heads,
                head_size=size,
                dtype=self.model_config.dtype,
            )
            for i, (heads, size) in enumerate(self._shapes())
        }

    def initialize_from_config(self, kv_cache_config) -> None:
        num_blocks = kv_cache_config.num_blocks
        block_size = self.cache_config.block_size
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, heads, size, dtype=self.model_config.dtype)
            for heads, size in self._shapes()
        ]
        logger.info("stage %s: paged KV cache of %d blocks x %d tokens, %d layers",
                    self.stage_id, num_blocks, block_size, len(self.kv_caches))

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def check_health(self) -> None:
        return None

    def get_cache_block_size_bytes(self) -> int:
        return sum(c[:, 0].numel() * c.element_size() for c in self.kv_caches)

    def reset_mm_cache(self) -> None:
        return None

    # -- request bookkeeping ------------------------------------------------
    def _add_request(self, new) -> None:
        old = self.requests.get(new.req_id)
        if old is not None:
            # Resumed after preemption under the V2-model-runner scheduler
            # protocol (VllmConfig.use_v2_model_runner): it comes back as a new
            # request whose prefill_token_ids are prompt + tokens generated so
            # far. Keep its generator, model state and payloads.
            old.token_ids = list(new.prefill_token_ids or new.prompt_token_ids or [])
            old.block_ids = list(new.block_ids[0])
            return
        params = new.sampling_params
        keys, problem = request_payload_keys(new.req_id, params, self.store)
        generator = None
        if params is not None and params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        self.requests[new.req_id] = _Request(
            req_id=new.req_id,
            token_ids=list(new.prefill_token_ids or new.prompt_token_ids or []),
            num_prompt=len(new.prompt_token_ids or []),
            block_ids=list(new.block_ids[0]),
            params=params,
            payload={},
            out_key=keys.output,
            failure_key=keys.failure_key,
            generator=generator,
        )
        req = self.requests[new.req_id]
        if problem is not None:
            self._fail(req, problem)
        elif (keys.input or keys.output) and new.num_computed_tokens:
            # Payload positions map one-to-one to fed positions; a prefix-cache
            # hit would skip some (and placeholder prompts would match wrongly).
            self._fail(req, RuntimeError(
                f"stage {self.stage_id}: a request carrying payloads hit the prefix cache "
                f"({new.num_computed_tokens} tokens); set enable_prefix_caching: false in "
                "this stage's engine_args"))
        elif keys.input:
            try:
                req.payload = self.store.get(keys.input)
            except Exception as exc:
                self._fail(req, exc)

    def _update_cached(self, cached) -> None:
        for i, req_id in enumerate(cached.req_ids):
            req = self.requests[req_id]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                req.token_ids = list(cached.all_token_ids[req_id])
                req.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks is not None:
                req.block_ids.extend(new_blocks[0])

    # -- execution ------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._add_request(new)
        self._update_cached(scheduler_output.scheduled_cached_reqs)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT

        cached = scheduler_output.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens

        self._pending = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self.requests[req_id]
            start = computed[req_id]
            step = StepInput(
                req_id=req_id,
                token_ids=torch.tensor(req.token_ids[start:start + n], dtype=torch.long),
                positions=torch.arange(start, start + n, dtype=torch.long),
                num_computed=start,
                payload=req.payload,
                state=req.state,
                needs_logits=start + n >= len(req.token_ids),
                publish=req.out_key is not None,
                publish_from=req.published,
                sampling_params=req.params,
                generator=req.generator,
            )
            view = PagedKVView(self.kv_caches, torch.tensor(req.block_ids, dtype=torch.long), start)
            out = StepOutput(logits=None)
            if not req.failed:
                try:
                    with use_paged_kv(view):
                        out = self.model.forward_step(step)
                    if out.payload and req.out_key:
                        self.store.append(req.out_key, out.payload)
                    req.published = max(req.published, start + n)
                except Exception as exc:
                    self._fail(req, exc)
            self._pending.append((req, step, out))
        return None

    def _fail(self, req: _Request, exc: Exception) -> None:
        """Fail one request so the stage keeps serving: it emits its stop token
        from now on (the scheduler finishes it) and the failure is recorded
        under its failure key for the orchestrator, which fails the request
        with an error naming the stage. A request without one (not sent by the
        orchestrator) just finishes; the log has the error."""
        logger.error("stage %s: request %s failed: %s: %s", self.stage_id, req.req_id,
                     type(exc).__name__, exc, exc_info=exc)
        req.failed = True
        if req.failure_key is not None and self.store is not None:
            self.store.put_error(req.failure_key, f"{type(exc).__name__}: {exc}")


    @torch.inference_mode()
    def sample_tokens(self, grammar_output):
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids, sampled = [], []
        for req, step, out in self._pending:
            req_ids.append(req.req_id)
            if req.failed:
                sampled.append([stop_token_of(req.params)])
                continue
            if not step.needs_logits or out.logits is None:
                sampled.append([])
                continue
            token = sample(out.logits, req.params, len(req.token_ids) - req.num_prompt,
                           req.generator)
            try:
                extra = self.model.after_sample(step, token)
                if extra and req.out_key:
                    self.store.append(req.out_key, extra)
            except Exception as exc:
                self._fail(req, exc)
                token = stop_token_of(req.params)
            req.token_ids.append(token)
            sampled.append([token])
        self._pending = []
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def shutdown(self) -> None:
        self.requests.clear()
        self.kv_caches = []
