"""The vendored listing of the released Qwen3-Omni-30B-A3B-Instruct agrees with the
published facts it was checked against (plugin_tests/fixtures/checkpoints/README.md):
key count, parameter count, the index's total size, keys per prefix, and the shard
holding code2wav. Every stage's loader takes its part of the released Qwen3-Omni and
BAGEL checkpoints."""

from __future__ import annotations

import math
from collections import Counter

import pytest

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


#: Per released checkpoint: (its builtin pipeline, {stage: the tensor a wrong-shape load
#: gets a row too long}). vLLM's column-parallel loaders cut a tensor to the parameter's
#: rows: BAGEL's keys are norms, whose loader checks the whole shape.
META_LOADS = {
    "qwen3_omni": ("qwen3_omni_moe", {
        "thinker": "thinker.model.layers.1.mlp.experts.3.down_proj.weight",
        "talker": "talker.model.layers.1.mlp.experts.3.down_proj.weight",
        "code2wav": "code2wav.decoder.1.block.2.conv1.conv.weight"}),
    "bagel": ("bagel", {
        "ar": "language_model.model.layers.1.input_layernorm.weight",
        "dit": "language_model.model.layers.1.input_layernorm_moe_gen.weight"}),
}


@pytest.fixture(scope="module")
def meta_loads(tmp_path_factory) -> dict[str, list]:
    """``plugin_tests.meta_load`` over each released checkpoint's derived config
    (``write_released_config``), both in one child process: one result per stage, by
    checkpoint."""
    import json
    import subprocess

    from plugin_tests.conftest import PYTHON, REPO
    from plugin_tests.released_checkpoints import write_released_config

    args = []
    for checkpoint, (pipeline, bad_keys) in META_LOADS.items():
        config_dir = tmp_path_factory.mktemp(checkpoint)
        write_released_config(checkpoint, str(config_dir))
        args += ["--", pipeline, str(config_dir),
                 *(f"{stage}:{key}" for stage, key in bad_keys.items())]
    done = subprocess.run([PYTHON, "-m", "plugin_tests.meta_load", *args[1:]],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in done.stdout.splitlines()
               if line.startswith('{"pipeline"')]
    assert done.returncode == 0, done.stderr[-3000:]
    return {checkpoint: [r for r in results if r["pipeline"] == pipeline]
            for checkpoint, (pipeline, _) in META_LOADS.items()}


def _assert_every_parameter_loaded(results: list, bad_keys: dict[str, str]) -> None:
    def named(names: list[str]) -> list[str]:
        # vLLM 0.30 and 0.31 report a fused expert weight it loaded without the
        # ``routed_experts`` module its parameter sits in
        return sorted(n.replace(".routed_experts.", ".") for n in names)

    assert sorted(r["stage"] for r in results) == sorted(bad_keys), results
    for result in results:
        assert result["error"] is None, (result["stage"], result["error"])
        assert named(result["loaded"]) == named(result["params"]), result["stage"]
        assert result["bad_shape_error"] and result["bad_shape_error"].startswith(
            bad_keys[result["stage"]]), result


def test_every_qwen3_omni_stage_loader_takes_the_released_checkpoint(meta_loads):
    """The thinker's (vLLM's own model and loader, extended), talker's and code2wav's
    engines, configured from the shipped pipeline over the released config (derived from
    the listing: ``qwen3_omni_config``), built on the meta device in a child process
    (``plugin_tests/meta_load.py``); each loader is fed all 28,010 listed tensors at their
    shapes. Every parameter is loaded and no error is raised: each loader takes every key
    of its prefix (an unknown one raises) and skips the others. The same load with one of
    its tensors a row too long fails naming it."""
    _assert_every_parameter_loaded(meta_loads["qwen3_omni"], META_LOADS["qwen3_omni"][1])


def test_every_bagel_stage_loader_takes_the_released_checkpoint(meta_loads):
    """BAGEL-7B-MoT: the AR stage (vLLM's own ``BagelForConditionalGeneration``, extended)
    and the DiT stage (the plugin's generation expert and FLUX decoder), configured from
    the shipped pipeline over a config built from the vendored facts (``bagel_config``),
    are fed every key of ``ema.safetensors`` and ``ae.safetensors`` as derived from the
    official modeling code (not from the plugin's modules, so not circular). Every
    parameter of each is loaded; a wrong shape fails naming the key."""
    _assert_every_parameter_loaded(meta_loads["bagel"], META_LOADS["bagel"][1])
