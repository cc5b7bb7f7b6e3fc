"""What ``--stage-configs-path`` may name (``config.pipelines``): a YAML file, a pipeline
shipped in the package by name, or ``auto``, the one named after the checkpoint's
``model_type``."""

from __future__ import annotations

import json
import os

import pytest

from vllm_omni_plugin.config import load_pipeline_config
from vllm_omni_plugin.config.pipelines import (
    BUILTIN_DIR,
    builtin_pipeline,
    builtin_pipelines,
    resolve_stage_configs,
)
from vllm_omni_plugin.config.schema import StageConfigError

NAMES = ("bagel", "bagel_1xh100", "bagel_replicated", "qwen3_omni_moe", "qwen3_omni_moe_1xh200",
         "qwen3_omni_moe_2xh100", "qwen3_omni_moe_fp8_1xh100", "qwen3_omni_moe_pd")


def test_the_package_ships_each_pipeline_and_each_is_valid():
    assert tuple(builtin_pipelines()) == NAMES
    for name, path in builtin_pipelines().items():
        assert os.path.dirname(path) == str(BUILTIN_DIR)
        pipeline = load_pipeline_config(path)
        # a pipeline is named after its model_type, or starts with it
        assert name.startswith(pipeline.model_type), name


@pytest.mark.parametrize("value", ["qwen3_omni_moe", "qwen3_omni_moe.yaml"])
def test_a_builtin_name_names_the_packaged_yaml(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_stage_configs(value) == builtin_pipeline("qwen3_omni_moe")


def test_a_file_wins_over_a_builtin_of_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bagel.yaml").write_text("stages: []\n")
    assert resolve_stage_configs("bagel.yaml") == str(tmp_path / "bagel.yaml")
    assert resolve_stage_configs("bagel") == builtin_pipeline("bagel")  # no such file


def test_a_missing_path_is_left_to_the_loader_which_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in ("mine.yaml", "conf/qwen3_omni_moe.yaml"):
        path = resolve_stage_configs(value)
        assert path == str(tmp_path / value)
        with pytest.raises(StageConfigError, match=f"{value}: file not found"):
            load_pipeline_config(path)


def test_an_unknown_name_fails_naming_the_flag_and_the_builtins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StageConfigError) as err:
        resolve_stage_configs("qwen3_omni")
    text = str(err.value)
    assert text.startswith("field '--stage-configs-path': 'qwen3_omni' is neither a file")
    assert "did you mean 'qwen3_omni_moe'" in text and ", ".join(NAMES) in text
    with pytest.raises(StageConfigError, match="no built-in pipeline 'bagle'.*'bagel'"):
        builtin_pipeline("bagle")


def _checkpoint(path, config: dict | None):
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("model_type", ["qwen3_omni_moe", "bagel"])
def test_auto_picks_the_pipeline_named_after_the_model_type(model_type, tmp_path):
    model = _checkpoint(tmp_path / "ckpt", {"model_type": model_type})
    assert resolve_stage_configs("auto", model) == builtin_pipeline(model_type)


@pytest.mark.parametrize("config, message", [
    (None, "has no config.json with a model_type; name a pipeline instead"),
    ({"architectures": ["X"]}, "has no config.json with a model_type"),
    ({"model_type": "llama"}, "no built-in pipeline for model_type 'llama'"),
])
def test_auto_without_a_known_model_type_fails_saying_so(config, message, tmp_path):
    model = _checkpoint(tmp_path / "ckpt", config)
    with pytest.raises(StageConfigError, match=message):
        resolve_stage_configs("auto", model)
