"""The payload store's chunks of several keys in one file, and a payload growing chunk by
chunk (``GrowingPayload``); the rest of the store is exercised through ``StageIO`` and the
orchestrator (``test_stage_io.py``, ``test_orchestrator.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_omni_plugin.payload_store import GrowingPayload, PayloadStore


def test_chunks_of_several_keys_in_one_file_keep_each_keys_order(tmp_path):
    store = PayloadStore(str(tmp_path))
    for key in ("a", "b", "c"):
        store.create(key)
    store.append("a", {"x": torch.tensor([0])})
    assert store.append_many({"a": {"x": torch.tensor([1])}, "b": {"x": torch.tensor([10])},
                              "gone": {"x": torch.tensor([99])}}) == {"a", "b"}
    store.append("b", {"x": torch.tensor([11])})
    assert store.get("a")["x"].tolist() == [0, 1] and store.get("b")["x"].tolist() == [10, 11]
    assert [c["x"].tolist() for c in store.chunks("a", 1)] == [[1]]
    assert store.keys() == ["a", "b", "c"]  # neither "gone" nor the staging file
    # a key deleted by its consumer is skipped, the others written
    store.delete("a")
    assert store.append_many({"a": {"x": torch.tensor([2])},
                              "b": {"x": torch.tensor([12])}}) == {"b"}
    assert store.get("b")["x"].tolist() == [10, 11, 12] and store.keys() == ["b", "c"]
    # tensors of one name that do not join (images of two sizes) are kept apart
    assert store.append_many({"b": {"x": torch.tensor([13])},
                              "c": {"x": torch.zeros(2, 3, dtype=torch.uint8)}}) == {"b", "c"}
    assert store.get("b")["x"].tolist() == [10, 11, 12, 13]
    assert store.get("c")["x"].equal(torch.zeros(2, 3, dtype=torch.uint8))
    store.delete("b")
    store.delete("c")
    assert os.listdir(tmp_path) == []


def test_a_growing_payload_gives_the_rows_so_far_and_refuses_other_shapes():
    payload = GrowingPayload()
    payload.extend([{"x": torch.zeros(2, 3), "once": torch.ones(1)}])
    first = payload.tensors()
    payload.extend([{"x": torch.ones(40, 3)}])
    assert first["x"].shape == (2, 3) and not first["x"].any()  # earlier views unchanged
    rows = payload.tensors()
    assert rows["x"].shape == (42, 3) and rows["x"][2:].all() and rows["once"].tolist() == [1]
    with pytest.raises(ValueError, match="'x': a chunk of torch.float32 \\(1, 4\\)"):
        payload.extend([{"x": torch.zeros(1, 4)}])


def test_reading_chunks_keeps_no_memory(tmp_path):
    """A server reads some 30 chunks a request for as long as it runs: reading keeps
    nothing. Reading a file with metadata (a step's chunks of several keys) through
    safetensors' ``safe_open`` kept about 170 bytes a read for good (safetensors 0.8):
    the API server's memory grew by 2.3 MB a minute under load."""
    import gc
    import tracemalloc

    store = PayloadStore(str(tmp_path))
    keys = [f"k{i}" for i in range(16)]
    for key in keys:
        store.create(key)
    for _ in range(10):
        store.append_many({key: {"x": torch.ones(1, 8), "pos": torch.zeros(1, 3)}
                           for key in keys})
    for key in keys:
        store.get(key)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(20):
            for key in keys:
                store.get(key)
        gc.collect()
        growth = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(
            before, "filename"))
    finally:
        tracemalloc.stop()
    reads = 20 * len(keys) * 10
    assert growth / reads < 10, f"{growth / reads:.1f} bytes kept per chunk read"
