"""register(): idempotent, patches applied once, omni flags on the serve parser,
out-of-range vLLM disables the plugin, VLLM_PLUGINS switches it off."""

from __future__ import annotations

import json
import subprocess

import pytest

from plugin_tests.conftest import PYTHON, QWEN3_OMNI_YAML, VLLM


def _run(code: str, env_extra: dict | None = None,
         timeout: int = 180) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_register_is_idempotent_and_patches_once():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_omni_plugin
    from vllm_omni_plugin.compat import MARKER, apply_all

    vllm_omni_plugin.register()
    first = (EngineArgs.add_cli_args, AsyncLLM.from_vllm_config)
    vllm_omni_plugin.register()
    assert apply_all() == []  # already applied: nothing applied twice
    assert (EngineArgs.add_cli_args, AsyncLLM.from_vllm_config) == first
    assert getattr(EngineArgs.add_cli_args, MARKER)


def test_stage_models_registered_lazily():
    from vllm import ModelRegistry

    import vllm_omni_plugin
    from vllm_omni_plugin.models import STAGE_MODELS

    vllm_omni_plugin.register()
    supported = ModelRegistry.get_supported_archs()
    for arch in STAGE_MODELS:
        assert arch in supported
    # upstream's own Qwen3-Omni registration is untouched
    assert "Qwen3OmniMoeForConditionalGeneration" in supported




def test_vllm_discovers_plugin_and_adds_omni_group():
    """vLLM itself loads the entry point (not a direct call); `vllm serve --help`
    shows the Omni group."""
    # vLLM's PyPI wheel needs a platform even for --help on a machine without
    # a GPU; VLLM_TARGET_DEVICE=cpu gives it vLLM's own CPU platform.
    env = {**__import__("os").environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "omni"}
    out = subprocess.run([VLLM, "serve", "--help=Omni"], capture_output=True, text=True,
                         timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--stage-configs-path" in out.stdout and "Switches on omni mode" in out.stdout


def test_vllm_plugins_env_switches_plugin_off():
    out = subprocess.run([VLLM, "serve", "--help=all"], capture_output=True, text=True,
                         timeout=180, env={**__import__("os").environ, "VLLM_PLUGINS": "none",
                                              "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--stage-configs-path" not in out.stdout


def test_out_of_range_vllm_registers_nothing():
    code = """
import logging, json
import vllm_omni_plugin
from vllm_omni_plugin.compat import version
version.vllm_version.cache_clear()
version.vllm_version = lambda: "0.12.0"
records = []
class H(logging.Handler):
    def emit(self, r): records.append(r.getMessage())
logging.getLogger("vllm.omni_plugin").addHandler(H())
vllm_omni_plugin.register()
vllm_omni_plugin.register()
from vllm import ModelRegistry
from vllm.engine.arg_utils import EngineArgs
print(json.dumps({"warnings": records,
  "registered": "OmniPluginQwen3OmniThinker" in ModelRegistry.get_supported_archs(),
  "patched": hasattr(EngineArgs.add_cli_args, "__vllm_omni_plugin_patched__")}))
"""
    out = _run(code, {"VLLM_PLUGINS": "none"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["warnings"]) == 1
    assert "0.12.0" in result["warnings"][0] and ">=0.30.0,<0.34" in result["warnings"][0]
    assert not result["registered"] and not result["patched"]


def test_plain_engine_client_without_omni_flags():
    """Without --stage-configs-path the engine args carry no omni settings and
    from_vllm_config keeps vLLM's class."""
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs

    import vllm_omni_plugin
    from vllm_omni_plugin.config.settings import ADDITIONAL_CONFIG_KEY

    vllm_omni_plugin.register()
    ns = argparse.Namespace(model="m", stage_configs_path=None)
    args = AsyncEngineArgs.from_cli_args(ns)
    assert ADDITIONAL_CONFIG_KEY not in (args.additional_config or {})


def test_omni_flags_reach_additional_config():
    code = f"""
import argparse, json
import vllm_omni_plugin
from vllm.engine.arg_utils import AsyncEngineArgs
vllm_omni_plugin.register()
ns = argparse.Namespace(model="m", stage_configs_path={QWEN3_OMNI_YAML!r}, middleware=[])
args = AsyncEngineArgs.from_cli_args(ns)
print(json.dumps({{"extra": args.additional_config, "hf": args.hf_overrides,
                  "middleware": ns.middleware}}))
"""
    out = _run(code, {"VLLM_OMNI_PLUGIN_BACKEND": "reference"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    settings = result["extra"]["omni_plugin"]
    assert settings["stage_id"] == 0 and settings["stage_configs_path"] == QWEN3_OMNI_YAML
    assert settings["entry"] is True and settings["payload_dir"]
    assert result["hf"]["architectures"] == ["OmniPluginQwen3OmniThinker"]
    assert result["middleware"] == [
        "vllm_omni_plugin.entrypoints.audio_output.OmniAudioMiddleware"]


def test_omni_mode_without_reference_platform_fails_with_the_fix():
    """This test process resolved no plugin platform (no omni argv, no
    VLLM_OMNI_PLUGIN_BACKEND): omni mode must refuse early and name the fix."""
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    import vllm_omni_plugin

    vllm_omni_plugin.register()
    assert type(current_platform).__name__ != "ReferencePlatform"
    with pytest.raises(RuntimeError, match="VLLM_OMNI_PLUGIN_BACKEND=reference"):
        AsyncEngineArgs.from_cli_args(argparse.Namespace(
            model="m", stage_configs_path=QWEN3_OMNI_YAML, middleware=[]))


def test_bad_yaml_fails_before_engines(tmp_path):
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs

    import vllm_omni_plugin
    from vllm_omni_plugin.config import StageConfigError

    vllm_omni_plugin.register()
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [\n  - stage_id: 0\n   name: x\n")
    with pytest.raises(StageConfigError, match="bad.yaml"):
        AsyncEngineArgs.from_cli_args(argparse.Namespace(model="m", stage_configs_path=str(bad)))
