"""A stage model that takes only part of a shared checkpoint (``OwnShards``): vLLM's own
default loader, over a sharded checkpoint on disk, reads only the shards holding the
model's keys (vLLM 0.32 and later; earlier releases read them all)."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_omni_plugin.models.weights import OwnShards

SHARDS = {"model-00001-of-00003.safetensors": ["thinker.embed.weight", "thinker.head.weight"],
          "model-00002-of-00003.safetensors": ["thinker.norm.weight", "talker.proj.weight"],
          "model-00003-of-00003.safetensors": ["talker.head.weight", "code2wav.conv.weight"]}
EVERY_KEY = {key for keys in SHARDS.values() for key in keys}


def _loader_skips_shards() -> bool:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    return "is_unused_weight" in {f.name for f in fields(DefaultModelLoader.Source)}


class _Stage(OwnShards, nn.Module):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.checkpoint_prefixes = prefixes


def _read(folder, model: nn.Module) -> set[str]:
    """The keys vLLM's DefaultModelLoader yields for ``model`` from ``folder``."""
    from safetensors.torch import save_file
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    for file, keys in SHARDS.items():
        save_file({key: torch.zeros(2, 2) for key in keys}, str(folder / file))
    # a ModelConfig needs a whole HF config; the loader reads only these fields of it
    model_config = SimpleNamespace(model=str(folder), revision=None, quantization=None)
    loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    return {name for name, _ in loader.get_all_weights(model_config, model)}


@pytest.mark.parametrize(("prefixes", "shards"), [
    (("code2wav.",), ["model-00003-of-00003.safetensors"]),
    (("talker.",), ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]),
    (("talker.", "code2wav."), ["model-00002-of-00003.safetensors",
                                "model-00003-of-00003.safetensors"]),
])
def test_the_loader_reads_only_the_shards_holding_the_stage_weights(tmp_path, prefixes,
                                                                    shards):
    read = _read(tmp_path, _Stage(prefixes))
    if not _loader_skips_shards():
        assert read == EVERY_KEY
        return
    assert read == {key for shard in shards for key in SHARDS[shard]}
    # the same checkpoint, read for a model that does not say what it uses: all of it
    assert _read(tmp_path, nn.Module()) == EVERY_KEY


def test_unused_keys_are_those_of_other_prefixes():
    model = _Stage(("talker.", "code2wav."))
    assert not model.is_unused_checkpoint_weight("talker.model.layers.0.mlp.gate.weight")
    assert not model.is_unused_checkpoint_weight("code2wav.decoder.0.conv.weight")
    assert model.is_unused_checkpoint_weight("thinker.lm_head.weight")
