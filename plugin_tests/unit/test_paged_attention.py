"""Unit tests for ``vllm_omni_plugin.reference.paged_attention`` (CPU, < 5 s).

The paged path (K/V written to random, non-contiguous blocks, read back through the
block table) must reproduce plain causal attention over contiguous K/V, whether the
sequence arrives in one pass, in prefill chunks or one decode token at a time.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from vllm_omni_plugin.reference import paged_attention as pa  # noqa: E402
from vllm_omni_plugin.reference.paged_attention import (  # noqa: E402
    PagedKVView,
    paged_attention_forward,
    use_paged_kv,
)

NUM_BLOCKS = 24
BLOCK_SIZE = 4
NUM_LAYERS = 2


def _qkv(gen, heads, kv_heads, seq, head_size, dtype=torch.float32):
    q = torch.randn(1, heads, seq, head_size, generator=gen, dtype=dtype)
    k = torch.randn(1, kv_heads, seq, head_size, generator=gen, dtype=dtype)
    v = torch.randn(1, kv_heads, seq, head_size, generator=gen, dtype=dtype)
    return q, k, v


def _reference(q, k, v, scale):
    """Causal SDPA over contiguous K/V, GQA by repeating KV heads; ``[1, n, H, D]``."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2)


def _caches(kv_heads, head_size, dtype=torch.float32):
    # NaN everywhere: reading a slot that was never written poisons the output.
    return [
        torch.full((2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_size), float("nan"), dtype=dtype)
        for _ in range(NUM_LAYERS)
    ]


def _block_table(gen, seq):
    n = math.ceil(seq / BLOCK_SIZE)
    return torch.randperm(NUM_BLOCKS, generator=gen)[:n]


def _run_chunks(caches, table, layer, q, k, v, chunks, scale):
    """Feed positions chunk by chunk through fresh views; concatenated outputs."""
    outs, start = [], 0
    for n in chunks:
        view = PagedKVView(caches, table, start)
        sl = slice(start, start + n)
        outs.append(view.attend(layer, q[:, :, sl], k[:, :, sl], v[:, :, sl], scale))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize(
    "heads,kv_heads,head_size",
    [(4, 4, 8), (6, 2, 8), (8, 1, 16)],  # MHA, GQA 3:1, MQA
)
@pytest.mark.parametrize(
    "chunks",
    [
        [23],                       # one prefill
        [7, 5, 6, 1, 1, 1, 1, 1],   # chunked prefill (not block aligned), then decode
        [4, 4, 8, 1, 1, 1, 1, 1, 1, 1],  # block-aligned chunks, then decode
        [1] * 23,                   # token by token
    ],
)
def test_attend_matches_causal_sdpa(heads, kv_heads, head_size, chunks):
    gen = torch.Generator().manual_seed(hash((heads, kv_heads, head_size, len(chunks))) % 2**31)
    seq = sum(chunks)
    q, k, v = _qkv(gen, heads, kv_heads, seq, head_size)
    scale = head_size ** -0.5
    caches = _caches(kv_heads, head_size)
    table = _block_table(gen, seq)
    assert not torch.equal(table, table.sort().values) or len(table) == 1

    got = _run_chunks(caches, table, 1, q, k, v, chunks, scale)

    assert got.shape == (1, seq, heads, head_size)
    assert got.is_contiguous()
    torch.testing.assert_close(got, _reference(q, k, v, scale), atol=1e-5, rtol=1e-5)
    # K/V landed in the request's blocks, in order, and nowhere else in that layer.
    cache = caches[1]
    pos = torch.arange(seq)
    blocks, offsets = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
    torch.testing.assert_close(cache[0, blocks, offsets], k[0].transpose(0, 1))
    torch.testing.assert_close(cache[1, blocks, offsets], v[0].transpose(0, 1))
    written = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    written[blocks, offsets] = True
    assert torch.isnan(cache[:, ~written]).all()
    assert torch.isnan(caches[0]).all()  # the other layer untouched


def test_requests_sharing_the_cache_stay_isolated():
    """Two requests interleaving chunks on disjoint block tables of the same cache."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_size = 4, 2, 8
    scale = 0.3
    caches = _caches(kv_heads, head_size)
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    seqs = {"a": [5, 9, 1, 1, 1], "b": [3, 1, 12, 1, 1]}
    tables = {"a": perm[:5], "b": perm[5:10]}
    data = {r: _qkv(gen, heads, kv_heads, sum(c), head_size) for r, c in seqs.items()}
    outs = {r: [] for r in seqs}
    done = {r: 0 for r in seqs}
    for step in range(5):
        for r in ("b", "a") if step % 2 else ("a", "b"):
            n, start = seqs[r][step], done[r]
            q, k, v = data[r]
            sl = slice(start, start + n)
            view = PagedKVView(caches, tables[r], start)
            for layer in range(NUM_LAYERS):
                out = view.attend(layer, q[:, :, sl], k[:, :, sl], v[:, :, sl], scale)
            outs[r].append(out)
            done[r] += n
    for r in seqs:
        q, k, v = data[r]
        torch.testing.assert_close(torch.cat(outs[r], 1), _reference(q, k, v, scale),
                                   atol=1e-5, rtol=1e-5)


def test_prefix_written_by_another_view_is_reused():
    """A request starting at num_computed > 0 (prefix-cache hit) attends over blocks
    written earlier by another request, without rewriting them."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_size, seq, hit = 4, 2, 8, 19, 12
    q, k, v = _qkv(gen, heads, kv_heads, seq, head_size)
    caches = _caches(kv_heads, head_size)
    table = _block_table(gen, seq)
    first = PagedKVView(caches, table[: hit // BLOCK_SIZE], 0)
    first.attend(0, q[:, :, :hit], k[:, :, :hit], v[:, :, :hit], 0.25)
    snapshot = caches[0][:, table[: hit // BLOCK_SIZE]].clone()

    view = PagedKVView(caches, table, hit)
    out = view.attend(0, q[:, :, hit:], k[:, :, hit:], v[:, :, hit:], 0.25)
    torch.testing.assert_close(out, _reference(q, k, v, 0.25)[:, hit:], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0][:, table[: hit // BLOCK_SIZE]], snapshot)


def test_low_precision_cache_casts_both_ways():
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_size, seq = 4, 2, 8, 10
    q, k, v = _qkv(gen, heads, kv_heads, seq, head_size)
    caches = _caches(kv_heads, head_size, dtype=torch.bfloat16)
    table = _block_table(gen, seq)
    got = _run_chunks(caches, table, 0, q, k, v, [6, 1, 1, 1, 1], 0.35)
    assert got.dtype == torch.float32
    want = _reference(q, k.bfloat16().float(), v.bfloat16().float(), 0.35)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_block_table_too_short_raises():
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen, 2, 2, 9, 8)
    view = PagedKVView(_caches(2, 8), torch.tensor([3, 5]), 0)  # room for 8 tokens
    with pytest.raises(IndexError):
        view.attend(0, q, k, v, 0.5)


class _Attn(torch.nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx


def test_attention_interface_entry_uses_installed_view():
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_size, seq = 6, 3, 16, 9
    q, k, v = _qkv(gen, heads, kv_heads, seq, head_size)
    caches = _caches(kv_heads, head_size)
    table = _block_table(gen, seq)
    with use_paged_kv(PagedKVView(caches, table, 0)):
        out, weights = paged_attention_forward(_Attn(1), q, k, v, attention_mask=None)
    assert weights is None
    # scaling defaults to head_size ** -0.5, like HF's modules
    torch.testing.assert_close(out, _reference(q, k, v, head_size ** -0.5), atol=1e-5, rtol=1e-5)
    assert torch.isnan(caches[0]).all() and not torch.isnan(caches[1]).all()
    # explicit scaling is honoured
    with use_paged_kv(PagedKVView(_caches(kv_heads, head_size), table, 0)):
        out, _ = paged_attention_forward(_Attn(0), q, k, v, None, scaling=0.1)
    torch.testing.assert_close(out, _reference(q, k, v, 0.1), atol=1e-5, rtol=1e-5)


def test_attention_outside_use_paged_kv_raises():
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(gen, 2, 2, 3, 8)
    with pytest.raises(RuntimeError, match="use_paged_kv"):
        paged_attention_forward(_Attn(0), q, k, v, None)
    # the view is uninstalled on exit, also when the block raises
    with pytest.raises(ValueError):
        with use_paged_kv(PagedKVView(_caches(2, 8), torch.tensor([0]), 0)):
            raise ValueError("boom")
    with pytest.raises(RuntimeError, match="use_paged_kv"):
        paged_attention_forward(_Attn(0), q, k, v, None)


def test_nested_views_restore_outer():
    outer = PagedKVView(_caches(2, 8), torch.tensor([0]), 0)
    inner = PagedKVView(_caches(2, 8), torch.tensor([1]), 0)
    with use_paged_kv(outer):
        with use_paged_kv(inner):
            assert pa._CURRENT_VIEW.get() is inner
        assert pa._CURRENT_VIEW.get() is outer
    assert pa._CURRENT_VIEW.get() is None


def test_register_attention_with_transformers():
    transformers = pytest.importorskip("transformers")
    pa.register_attention()
    pa.register_attention()  # idempotent
    registry = transformers.AttentionInterface()
    assert registry[pa.ATTN_IMPLEMENTATION] is paged_attention_forward
