"""The vendored listing of the released Qwen3-Omni-30B-A3B-Instruct agrees with the
published facts it was checked against (plugin_tests/fixtures/checkpoints/README.md):
key count, parameter count, the index's total size, keys per prefix, and the shard
holding code2wav. The plugin's talker and code2wav loaders take that checkpoint whole."""

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


def test_the_talker_and_code2wav_loaders_take_the_released_checkpoint(tmp_path):
    """The talker's and code2wav's engines, configured from the shipped pipeline over the
    released config (derived from the listing: ``qwen3_omni_config``), built on the meta
    device in a child process (``plugin_tests/meta_load.py``); each loader is fed all
    28,010 listed tensors at their shapes. Every parameter is loaded and no error is
    raised: each loader takes every key of its prefix (an unknown one raises) and skips
    the others. The same load with one of its tensors a row too long fails naming it."""
    import json
    import subprocess

    from plugin_tests.conftest import PYTHON, REPO
    from plugin_tests.released_checkpoints import qwen3_omni_config

    (tmp_path / "config.json").write_text(json.dumps(qwen3_omni_config()))
    done = subprocess.run([PYTHON, "-m", "plugin_tests.meta_load", str(tmp_path), "talker",
                           "code2wav"], cwd=REPO, capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in done.stdout.splitlines()
               if line.startswith('{"stage"')]
    assert done.returncode == 0 and len(results) == 2, done.stderr[-3000:]
    def named(names: list[str]) -> list[str]:
        # vLLM 0.30 and 0.31 report a fused expert weight it loaded without the
        # ``routed_experts`` module its parameter sits in
        return sorted(n.replace(".routed_experts.", ".") for n in names)

    for result in results:
        assert result["error"] is None, result["error"]
        assert named(result["loaded"]) == named(result["params"]), result["stage"]
        assert result["bad_shape_error"] and result["bad_shape_error"].startswith(
            f"{result['stage']}."), result
