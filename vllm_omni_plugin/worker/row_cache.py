"""The rows of prefix-cached KV blocks, for requests whose rows feed the next stage.

A stage whose requests publish one row per fed position (the Qwen3-Omni thinker: the
talker's ``embed``, ``hidden`` and ``positions``) cannot let a request skip positions on
a prefix-cache hit unless the rows of the skipped positions can be had without computing
them. This module keeps them: the rows of every full KV block a publishing request
computed, keyed by the block's id, for as long as the block keeps that content.

Two copies of one bookkeeping (:class:`RowBlockIndex`) run side by side, both fed the
same ``SchedulerOutput`` of every step, so they agree without talking:

* in the EngineCore, :class:`~vllm_omni_plugin.worker.scheduler.OmniScheduler` lets a
  publishing request's prefix-cache hit cover only blocks whose rows are held (vLLM's
  own lookup, ``KVCacheManager.get_computed_blocks``, kept on such blocks or cut);
* in the publishing worker, :class:`RowCache` holds the rows themselves and hands a
  request that hit the cache the rows of its hit blocks (:mod:`.stage_io` publishes them
  before the rows it computes).

The rules, applied in step order: a block allocated anew (a new request's blocks past its
hit, a running request's added blocks, a resumed request's blocks past its hit) loses its
rows, as its KV is about to be rewritten; a block whose last position a publishing
request computes in a step gains them; a hit refreshes its blocks' recency; past
``max_blocks`` the least recently used block loses its rows. A request whose KV comes
from elsewhere is never scheduled on an engine that uses this: the row cache is off on a
KV consumer (a PD decode engine; :func:`row_cache_blocks`), and on a KV producer (a PD
prefill engine) every block is computed or hit here.

Why blocks and not vLLM's block hashes: a hit names the physical blocks whose KV it
reuses, and a block's rows are valid exactly as long as its KV is, so the block id is
the key and vLLM's hashing is not repeated here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from vllm_omni_plugin import extra_args as xargs
from vllm_omni_plugin.config.settings import OmniSettings


def publishes_rows(params) -> bool:
    """Whether a request with these ``SamplingParams`` publishes its rows for the next
    stage from positions it computes (an ``out`` payload key; not a request whose prompt
    a prefill stage computed)."""
    try:
        keys = xargs.payload_keys(params.extra_args if params is not None else None)
    except ValueError:
        return False
    return keys.output is not None and not keys.prefilled


def row_cache_blocks(vllm_config, model_cls: type | None = None) -> int:
    """How many KV blocks' rows the row cache of an engine holds: the omni settings'
    ``row_cache_bytes`` over the rows of one block (the stage model's
    ``payload_bytes_per_position`` times ``cache_config.block_size``); 0 outside omni
    mode, with prefix caching off, on a KV consumer (a PD decode engine: its prompts' KV
    and rows come from the prefill stage), or for a model that publishes no rows.
    ``model_cls``: the stage model's class (default: the one vLLM resolves for the
    engine's model)."""
    settings = OmniSettings.from_vllm_config(vllm_config)
    transfer = vllm_config.kv_transfer_config
    if (settings is None or not settings.row_cache_bytes
            or not vllm_config.cache_config.enable_prefix_caching
            or (transfer is not None and transfer.is_kv_consumer)):
        return 0
    model_config = vllm_config.model_config
    if model_cls is None:
        from vllm.model_executor.model_loader import get_model_cls

        model_cls = get_model_cls(model_config)
    per_position = getattr(model_cls, "payload_bytes_per_position", None)
    if per_position is None:
        return 0
    block_size = vllm_config.cache_config.block_size
    return settings.row_cache_bytes // (block_size * per_position(model_config))


@dataclass
class _Filling:
    """A publishing request: its blocks (KV cache group 0) and how many of its positions
    are computed once the steps seen so far run (None while it is preempted)."""

    block_ids: list[int]
    computed: int | None


@dataclass
class StepBlocks:
    """What one step changes (:meth:`RowBlockIndex.update`).

    Attributes:
        hits: request id -> the blocks of its prefix-cache hit, for a publishing request
            scheduled for the first time (or resumed) with one.
        filled: ``(request id, block index in the request, block id)`` of each block whose
            last position a publishing request computes in the step.
        dropped: blocks whose rows are no longer valid (allocated anew, or evicted).
    """

    hits: dict[str, list[int]] = field(default_factory=dict)
    filled: list[tuple[str, int, int]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)


class RowBlockIndex:
    """Which blocks' rows are held (see the module docstring).

    Args:
        block_size: tokens per KV block (``cache_config.block_size``).
        max_blocks: the most blocks whose rows are held (least recently used first out).
    """

    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        #: block id -> None, least recently used first
        self.held: OrderedDict[int, None] = OrderedDict()
        self._filling: dict[str, _Filling] = {}

    def held_prefix(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` (a hit's blocks, in order) have their rows held, from
        the first on."""
        for k, block_id in enumerate(block_ids):
            if block_id not in self.held:
                return k
        return len(block_ids)

    def update(self, out) -> StepBlocks:
        """Apply one step's ``SchedulerOutput``; what it changes."""
        step = StepBlocks()
        new_publishing = {new.req_id for new in out.scheduled_new_reqs
                          if publishes_rows(new.sampling_params)}
        if not (self.held or self._filling or new_publishing):
            return step  # nothing held or filled: nothing to drop or fill
        for req_id in out.finished_req_ids:
            self._filling.pop(req_id, None)
        for req_id in out.preempted_req_ids or ():
            if (filling := self._filling.get(req_id)) is not None:
                filling.block_ids, filling.computed = [], None  # its blocks are freed
        size = self.block_size
        for new in out.scheduled_new_reqs:
            ids, hit = new.block_ids[0], new.num_computed_tokens // size
            self._drop(ids[hit:], step)
            if new.req_id in new_publishing:
                self._filling[new.req_id] = _Filling(list(ids), new.num_computed_tokens)
                if hit:
                    step.hits[new.req_id] = self._touch(ids[:hit])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            added = cached.new_block_ids[i]
            if added is None:
                continue
            ids, filling = added[0], self._filling.get(req_id)
            if req_id not in cached.resumed_req_ids:
                self._drop(ids, step)
                if filling is not None:
                    filling.block_ids.extend(ids)
                continue
            hit = cached.num_computed_tokens[i] // size
            self._drop(ids[hit:], step)
            if filling is not None:  # resumed after preemption: its blocks anew
                filling.block_ids, filling.computed = list(ids), cached.num_computed_tokens[i]
                if hit:
                    step.hits[req_id] = self._touch(ids[:hit])
        for req_id, filling in self._filling.items():
            n = out.num_scheduled_tokens.get(req_id, 0)
            if not n or filling.computed is None:
                continue
            before = filling.computed // size
            filling.computed += n
            for k in range(before, filling.computed // size):
                step.filled.append((req_id, k, filling.block_ids[k]))
                self.held[filling.block_ids[k]] = None
                self.held.move_to_end(filling.block_ids[k])
        while len(self.held) > self.max_blocks:
            step.dropped.append(self.held.popitem(last=False)[0])
        return step

    def _touch(self, block_ids: list[int]) -> list[int]:
        for block_id in block_ids:
            self.held.move_to_end(block_id)
        return list(block_ids)

    def _drop(self, block_ids, step: StepBlocks) -> None:
        for block_id in block_ids:
            if block_id in self.held:
                del self.held[block_id]
                step.dropped.append(block_id)


def _length(rows: dict[str, torch.Tensor]) -> int:
    return len(next(iter(rows.values()))) if rows else 0


class RowCache:
    """The rows themselves, in the publishing worker: ``{name: [block_size, ...]}`` host
    tensors per held block, and each publishing request's rows since its last full block.

    Args:
        index: this worker's :class:`RowBlockIndex`.
    """

    def __init__(self, index: RowBlockIndex) -> None:
        self.index = index
        self.step = StepBlocks()
        self._blocks: dict[int, dict[str, torch.Tensor]] = {}
        #: request id -> (position of its first pending row, its pending rows as they came)
        self._pending: dict[str, tuple[int, list[dict[str, torch.Tensor]]]] = {}
        #: bytes of the rows held
        self.bytes = 0
        #: blocks whose rows requests that hit the prefix cache were given, in all
        self.hit_blocks = 0

    def begin_step(self, out) -> dict[str, dict[str, torch.Tensor] | Exception]:
        """Apply the step's ``SchedulerOutput`` to the index; the rows of each new hit by
        request id (``{name: [hit positions, ...]}`` host tensors in the dtypes the model
        published, e.g. ``embed`` ``[n, hidden]``, ``positions`` ``[n, 3]`` int64), or the
        error that fails the request: a hit block without rows here (the scheduler's
        index and this one disagree, a bug)."""
        self.step = self.index.update(out)
        for block_id in self.step.dropped:
            self._free(block_id)
        for req_id in out.finished_req_ids:
            self._pending.pop(req_id, None)
        hits: dict = {}
        for req_id, block_ids in self.step.hits.items():
            self._pending.pop(req_id, None)
            missing = [b for b in block_ids if b not in self._blocks]
            if missing:
                hits[req_id] = RuntimeError(
                    f"request {req_id} hit KV blocks {missing[:4]} whose rows this worker "
                    "does not hold")
                continue
            blocks = [self._blocks[b] for b in block_ids]
            hits[req_id] = {name: torch.cat([b[name] for b in blocks]) for name in blocks[0]}
            self.hit_blocks += len(blocks)
        return hits

    def stats(self) -> dict[str, int]:
        """What the cache holds: ``blocks`` (and ``max_blocks``), ``bytes`` of rows, and
        ``hit_blocks``, the blocks handed to requests that hit the cache so far."""
        return {"blocks": len(self._blocks), "max_blocks": self.index.max_blocks,
                "bytes": self.bytes, "hit_blocks": self.hit_blocks}

    def keep(self, req_id: str, start: int, rows: dict[str, torch.Tensor]) -> None:
        """The rows a publishing request computed this step: ``{name: [n, ...]}`` host
        tensors of any dtype, the rows of positions ``start`` to ``start + n - 1``; the
        blocks the step fills get theirs (``[block_size, ...]`` copies). Rows short of a
        block wait as they came (joined once their block fills, not at every step)."""
        first, pieces = self._pending.get(req_id, (start, []))
        if first + sum(_length(p) for p in pieces) != start:  # recomputed (a resume)
            first, pieces = start, []
        pieces.append(rows)
        size = self.index.block_size
        filled = [(k, block_id) for owner, k, block_id in self.step.filled
                  if owner == req_id and k * size >= first]
        if filled:
            joined = {name: torch.cat([p[name] for p in pieces]) for name in rows}
            for k, block_id in filled:
                if block_id not in self.index.held:
                    continue  # evicted in the step that filled it
                at = k * size - first
                self._free(block_id)
                block = {name: t[at:at + size].clone() for name, t in joined.items()}
                self._blocks[block_id] = block
                self.bytes += sum(t.nbytes for t in block.values())
            end = first + _length(joined)
            keep_from = max(first, end // size * size)
            first, pieces = keep_from, [{name: t[keep_from - first:]
                                         for name, t in joined.items()}]
        self._pending[req_id] = (first, pieces)

    def _free(self, block_id: int) -> None:
        block = self._blocks.pop(block_id, None)
        if block is not None:
            self.bytes -= sum(t.nbytes for t in block.values())
