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


def test_too_little_room_is_refused_naming_the_directory_and_the_fixes(tmp_path):
    """A real filesystem asked for more than it has free."""
    import errno
    import shutil

    from vllm_omni_plugin.payload_store import check_room

    free = shutil.disk_usage(tmp_path).free
    assert check_room(str(tmp_path), 1, "a test") >= 1
    with pytest.raises(OSError) as err:
        check_room(str(tmp_path), free + (1 << 40), "one request")
    assert err.value.errno == errno.ENOSPC
    for part in (f"payload store {tmp_path}:", "one request takes about", "--shm-size",
                 "VLLM_OMNI_PLUGIN_PAYLOAD_DIR", "--max-model-len"):
        assert part in str(err.value)


def test_the_head_checks_room_for_one_request_of_the_entry_stages_length(tiny_qwen3_omni,
                                                                         tmp_path):
    """The thinker's payload per position (embed and hidden rows, M-RoPE positions) times
    the entry engine's max_model_len, against the store's real free space."""
    import shutil
    import types

    from transformers import AutoConfig

    from vllm_omni_plugin.config.schema import StageConfig
    from vllm_omni_plugin.engine.bootstrap import check_payload_room
    from vllm_omni_plugin.models.qwen3_omni.thinker import Qwen3OmniThinkerStage

    hf_config = AutoConfig.from_pretrained(tiny_qwen3_omni)
    model_config = types.SimpleNamespace(  # the three fields a ModelConfig gives it
        architectures=["OmniPluginQwen3OmniThinker"], hf_config=hf_config,
        dtype=torch.bfloat16, max_model_len=2048)
    width = hf_config.thinker_config.text_config.hidden_size
    per_position = Qwen3OmniThinkerStage.payload_bytes_per_position(model_config)
    assert per_position == 2 * width * 2 + 24
    entry = StageConfig.model_validate({"stage_id": 0, "name": "thinker", "kind": "ar"})
    check_payload_room(str(tmp_path), model_config, entry)
    model_config.max_model_len = shutil.disk_usage(tmp_path).free // per_position + 1
    with pytest.raises(OSError, match=rf"one request of --max-model-len "
                       rf"{model_config.max_model_len} at stage 0 \(thinker\), "
                       rf"{per_position} bytes per position, takes about"):
        check_payload_room(str(tmp_path), model_config, entry)
    model_config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]  # not a stage's
    check_payload_room(str(tmp_path), model_config, entry)
