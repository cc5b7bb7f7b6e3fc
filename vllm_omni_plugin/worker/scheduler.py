"""``OmniScheduler``: vLLM's scheduler, letting requests that publish rows read the
prefix cache where their rows are held.

Selected per stage through vLLM's ``scheduler_cls`` engine argument (the Qwen3-Omni
thinker's ``engine_args.scheduler_cls`` in the shipped pipelines). The name resolves to
a subclass of the scheduler vLLM would use, ``AsyncScheduler`` under async scheduling,
``Scheduler`` otherwise, so scheduling itself is vLLM's. The subclass

* lets a request that publishes its rows for the next stage
  (:func:`~vllm_omni_plugin.worker.row_cache.publishes_rows`) read the prefix cache: the
  plugin's orchestrator marks such requests ``skip_reading_prefix_cache`` (their rows
  map one to one to the positions they compute); here the mark goes back to vLLM's own
  rule (only prompt logprobs skip the cache);
* keeps such a request's hit (vLLM's ``KVCacheManager.get_computed_blocks``) on blocks
  whose rows the publishing worker holds (:mod:`~vllm_omni_plugin.worker.row_cache`),
  taking a cached twin of a block vLLM found without rows (the same tokens, computed
  again by a request that published them: vLLM keeps both) and ending the hit where
  there is none; the worker publishes the rows for the positions the hit skips;
* keeps the index of those blocks from every ``SchedulerOutput`` it hands the workers.

Where it cannot (prefix caching off, a KV consumer: a PD decode engine, more than one KV
cache group, a row cache of size 0) it is vLLM's scheduler unchanged, and the requests
that publish rows keep skipping the cache.
"""

from __future__ import annotations

import functools
import time

from vllm_omni_plugin.compat.internals import cached_twins
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.worker.row_cache import RowBlockIndex, publishes_rows, row_cache_blocks

logger = init_logger(__name__)

#: Seconds between the row cache's log lines (at most; only while it changes)
REPORT_INTERVAL_S = 60.0


class OmniSchedulerMixin:
    """Methods layered over vLLM's scheduler (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.omni_rows: RowBlockIndex | None = None
        self._omni_hit_blocks = 0  # blocks hit since the last log line
        self._omni_reported = 0.0  # time.monotonic() of the last log line
        config = self.vllm_config
        blocks = row_cache_blocks(config)
        if not blocks or len(self.kv_cache_config.kv_cache_groups) != 1:
            return
        block_size = config.cache_config.block_size
        self.omni_rows = RowBlockIndex(block_size, blocks)
        manager = self.kv_cache_manager
        manager.get_computed_blocks = self._rows_held(manager.get_computed_blocks)
        logger.info("requests that publish rows read the prefix cache: the rows of up to "
                    "%d KV blocks of %d positions are kept", blocks, block_size)

    def add_request(self, request) -> None:
        """vLLM's, after which a request publishing rows reads the prefix cache by vLLM's
        own rule (see the module docstring)."""
        super().add_request(request)
        params = request.sampling_params
        if self.omni_rows is not None and publishes_rows(params):
            request.skip_reading_prefix_cache = (
                params.prompt_logprobs is not None
                or getattr(params, "prompt_logprob_token_ids", None) is not None)

    def schedule(self, *args, **kwargs):
        """vLLM's step, then the row index updated from it; every
        :data:`REPORT_INTERVAL_S` at most, a log line of what the row cache holds and the
        blocks requests publishing rows read from it since the last one."""
        out = super().schedule(*args, **kwargs)
        rows = self.omni_rows
        if rows is not None:
            step = rows.update(out)
            self._omni_hit_blocks += sum(len(blocks) for blocks in step.hits.values())
            now = time.monotonic()
            if now - self._omni_reported >= REPORT_INTERVAL_S and (
                    self._omni_hit_blocks or step.filled):
                logger.info("row cache: %d of %d KV blocks' rows held; %d blocks read by "
                            "requests publishing rows since the last report", len(rows.held),
                            rows.max_blocks, self._omni_hit_blocks)
                self._omni_reported, self._omni_hit_blocks = now, 0
        return out

    def _rows_held(self, lookup):
        """``get_computed_blocks`` whose hit, for a request that publishes rows, runs over
        blocks whose rows are held: where vLLM found a block without rows, a cached twin
        of it (the same tokens, filled by a request that published rows) takes its place
        (:func:`~vllm_omni_plugin.compat.internals.cached_twins`); the hit ends at the
        first block with neither."""
        rows, manager = self.omni_rows, self.kv_cache_manager

        def get_computed_blocks(request, *args, **kwargs):
            blocks, hit_tokens, *rest = lookup(request, *args, **kwargs)
            if not hit_tokens or not publishes_rows(request.sampling_params):
                return (blocks, hit_tokens, *rest)
            found = list(blocks.blocks[0])
            chosen = []
            for block in found:
                if block.block_id not in rows.held:
                    block = next((twin for twin in cached_twins(manager, block)
                                  if twin.block_id in rows.held), None)
                    if block is None:
                        break
                chosen.append(block)
            if chosen == found:
                return (blocks, hit_tokens, *rest)
            cut = manager.create_kv_cache_blocks((chosen,)) if chosen \
                else manager.empty_kv_cache_blocks
            tokens = len(chosen) * rows.block_size
            return (cut, tokens, *(r if tokens == hit_tokens else 0 for r in rest))

        return get_computed_blocks


@functools.cache
def _scheduler_cls(base: type) -> type:
    return type(f"Omni{base.__name__}", (OmniSchedulerMixin, base),
                {"__module__": __name__, "__qualname__": f"Omni{base.__name__}"})


class OmniScheduler:
    """The name ``engine_args.scheduler_cls`` gives: built with the engine's
    ``vllm_config``, it is an instance of :class:`OmniSchedulerMixin` over
    ``AsyncScheduler`` (async scheduling) or ``Scheduler``."""

    def __new__(cls, *args, vllm_config, **kwargs):
        """vLLM's scheduler for ``vllm_config``, with the mixin (arguments as vLLM's)."""
        if vllm_config.scheduler_config.async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
        else:
            from vllm.v1.core.sched.scheduler import Scheduler as base
        return _scheduler_cls(base)(*args, vllm_config=vllm_config, **kwargs)
