"""The vendored listing of the released Qwen3-Omni-30B-A3B-Instruct agrees with the
published facts it was checked against (plugin_tests/fixtures/checkpoints/README.md):
key count, parameter count, the index's total size, keys per prefix, and the shard
holding code2wav."""

from __future__ import annotations

import math
from collections import Counter

from plugin_tests.released_checkpoints import expand, qwen3_omni_facts, qwen3_omni_tensors


def test_a_pattern_expands_to_every_index():
    assert expand("a.{0-1}.b.{2-3}") == ["a.0.b.2", "a.0.b.3", "a.1.b.2", "a.1.b.3"]
    assert expand("plain.weight") == ["plain.weight"]


def test_the_listing_is_the_published_checkpoint():
    tensors, facts = qwen3_omni_tensors(), qwen3_omni_facts()
    assert len(tensors) == facts["index_weight_map_key_count"]["value"] == 28010
    elements = sum(math.prod(t.shape) for t in tensors.values())
    assert elements == facts["parameter_count"]["value"]
    assert {t.dtype for t in tensors.values()} == {"BF16"}
    assert 2 * elements == facts["index_metadata_total_size"]["value"]
    by_prefix = Counter(".".join(key.split(".")[:2]) for key in tensors)
    assert by_prefix == facts["tensor_count_by_prefix"]["value"]
    by_component = Counter(key.split(".")[0] for key in tensors)
    assert by_component == facts["tensor_count_by_component"]["value"]
    shards = {s["file"]: s["size_bytes"] for s in facts["shards"]["value"]}
    assert {t.file for t in tensors.values()} - {None} <= set(shards)
    code2wav = {t.file for key, t in tensors.items() if key.startswith("code2wav.")}
    assert code2wav == {"model-00015-of-00015.safetensors"}
    in_last = sum(2 * math.prod(t.shape) for t in tensors.values()
                  if t.file == "model-00015-of-00015.safetensors")
    assert in_last <= shards["model-00015-of-00015.safetensors"] < in_last + (1 << 16)
