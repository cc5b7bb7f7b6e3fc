"""register(): idempotent, patches applied once, omni flags on the serve parser,
out-of-range vLLM disables the plugin, VLLM_PLUGINS switches it off."""

from __future__ import annotations

import json
import subprocess

import pytest

from plugin_tests.conftest import PYTHON, QWEN3_OMNI_YAML, VLLM
from plugin_tests.env_utils import FAKE_VLLM, child_env, shadow_vllm_version
from plugin_tests.helpers import run_process_group


def _run(code: str, env_extra: dict | None = None,
         timeout: int = 180) -> subprocess.CompletedProcess:
    return run_process_group([PYTHON, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, timeout=timeout,
                             env=child_env(env_extra))


def test_register_is_idempotent_and_patches_once():
    import vllm.entrypoints.cli.serve as serve  # imported by vLLM's CLI before plugins
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_omni_plugin
    from vllm_omni_plugin.compat import MARKER, apply_all

    vllm_omni_plugin.register()
    # The headless seam applies only once vLLM's CLI module is loaded; if an
    # earlier test registered before that, apply it now, as the CLI would.
    apply_all()
    first = (EngineArgs.add_cli_args, AsyncLLM.from_vllm_config, serve.run_headless)
    vllm_omni_plugin.register()
    assert apply_all() == []  # already applied: nothing applied twice
    assert (EngineArgs.add_cli_args, AsyncLLM.from_vllm_config, serve.run_headless) == first
    assert all(getattr(f, MARKER) for f in first)


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




# -- discovery by vLLM itself (fresh subprocesses) ---------------------------------
# vLLM resolves its platform itself: vLLM's CPU build is recognised by its version's
# "+cpu" label, a GPU host by its driver. The plugin ships no platform.


#: Run vLLM's own general-plugin loader (what every vLLM process does) and report
#: what the plugin did. register() is called directly only a second time, after
#: vLLM ran it, to show that it warns once.
_LOADER = """
import json, logging
import vllm.logger  # configures vLLM's logging, which resets handlers below "vllm"
records = []
class H(logging.Handler):
    def emit(self, r): records.append(r.getMessage())
logging.getLogger("vllm.omni_plugin").addHandler(H())
from vllm.plugins import load_general_plugins
load_general_plugins()
import sys
plugin = sys.modules.get("vllm_omni_plugin")
if plugin is not None and (plugin._registered or plugin._warned):  # vLLM ran register()
    plugin.register()  # a second call warns no more and changes nothing
from vllm import ModelRegistry
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
print(json.dumps({"warnings": [m for m in records if "supports vLLM" in m],
  "registered": "OmniPluginQwen3OmniThinker" in ModelRegistry.get_supported_archs(),
  "patched": hasattr(EngineArgs.add_cli_args, "__vllm_omni_plugin_patched__"),
  "platform": type(current_platform).__name__}))
"""


def _loader(env_extra: dict) -> dict:
    out = _run(_LOADER, env_extra)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _serve_help(section: str, env_extra: dict) -> subprocess.CompletedProcess:
    out = run_process_group([VLLM, "serve", f"--help={section}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, timeout=180,
                            env=child_env(env_extra))
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_installed_entry_points_are_the_declared_ones():
    """The environment vLLM runs in carries this checkout's entry points (setup.cfg)."""
    import configparser
    from importlib.metadata import entry_points

    from plugin_tests.conftest import REPO

    cfg = configparser.ConfigParser()
    cfg.read(f"{REPO}/setup.cfg")
    assert "vllm.platform_plugins" not in cfg["options.entry_points"]  # vLLM's own platforms
    for group in ("vllm.general_plugins",):
        declared = dict(line.split("=", 1) for line in
                        cfg["options.entry_points"][group].strip().splitlines())
        declared = {k.strip(): v.strip() for k, v in declared.items()}
        installed = {ep.name: ep for ep in entry_points(group=group) if ep.name == "omni"}
        assert declared == {name: ep.value for name, ep in installed.items()}, group
        assert installed["omni"].dist.metadata["Name"] == "vllm-omni-plugin"


@pytest.mark.parametrize("plugins", [None, "omni"])
def test_vllm_loads_plugin(plugins):
    """VLLM_PLUGINS unset or naming it: vLLM's loader finds the general entry point
    and runs it (models registered, patches on) on vLLM's own platform."""
    result = _loader({"VLLM_PLUGINS": plugins})
    assert result["warnings"] == [] and result["registered"] and result["patched"]
    from vllm.platforms import current_platform

    assert result["platform"] == type(current_platform).__name__


def test_vllm_plugins_filter_keeps_plugin_out():
    """VLLM_PLUGINS naming other plugins: the entry point does not run."""
    result = _loader({"VLLM_PLUGINS": "some_other"})
    assert result["warnings"] == [] and not result["registered"] and not result["patched"]


def test_vllm_discovers_plugin_and_adds_omni_group():
    """`vllm serve --help=Omni`: vLLM's CLI loads the entry point and shows the group."""
    out = _serve_help("Omni", {"VLLM_PLUGINS": "omni"})
    assert "--stage-configs-path" in out.stdout and "Switches on omni mode" in out.stdout


def test_vllm_plugins_env_switches_plugin_off():
    out = _serve_help("all", {"VLLM_PLUGINS": "none"})
    assert "--stage-configs-path" not in out.stdout and "--max-model-len" in out.stdout


# -- a vLLM outside the supported range --------------------------------------------
@pytest.fixture
def fake_vllm_version(tmp_path) -> dict:
    return shadow_vllm_version(tmp_path)


def _supported_range() -> str:
    from vllm_omni_plugin.compat.version import SUPPORTED_RANGE

    return SUPPORTED_RANGE


def test_out_of_range_vllm_registers_nothing(fake_vllm_version):
    """One warning naming the range and the installed version; no model, no patch."""
    result = _loader(fake_vllm_version)
    assert len(result["warnings"]) == 1, result["warnings"]
    warning = result["warnings"][0]
    assert FAKE_VLLM in warning and _supported_range() in warning
    assert "VLLM_OMNI_PLUGIN_ALLOW_UNSUPPORTED_VLLM" in warning
    assert not result["registered"] and not result["patched"]


def test_out_of_range_vllm_serve_help_still_works(fake_vllm_version):
    out = _serve_help("all", fake_vllm_version)
    assert "--max-model-len" in out.stdout and "--stage-configs-path" not in out.stdout
    both = out.stdout + out.stderr
    assert both.count(f"supports vLLM {_supported_range()} but vLLM {FAKE_VLLM}") == 1, both[-3000:]


def test_out_of_range_override_registers_anyway(fake_vllm_version):
    result = _loader({**fake_vllm_version, "VLLM_OMNI_PLUGIN_ALLOW_UNSUPPORTED_VLLM": "1"})
    assert result["registered"] and result["patched"]
    assert len(result["warnings"]) == 1 and "trying anyway" in result["warnings"][0]


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
    out = _run(code, {})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    settings = result["extra"]["omni_plugin"]
    assert settings["stage_id"] == 0 and settings["stage_configs_path"] == QWEN3_OMNI_YAML
    assert settings["entry"] is True and settings["payload_dir"]
    assert result["hf"]["architectures"] == ["OmniPluginQwen3OmniThinker"]
    assert result["middleware"] == [
        "vllm_omni_plugin.entrypoints.audio_output.OmniAudioMiddleware"]


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
