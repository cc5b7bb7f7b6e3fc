"""vLLM itself loads the plugin: its loader and its CLI run the entry point, omni flags on
the serve parser, out-of-range vLLM disables the plugin, VLLM_PLUGINS switches it off.

vLLM resolves its platform itself: vLLM's CPU build is recognised by its version's
"+cpu" label, a GPU host by its driver. The plugin ships no platform.

Each environment is one fresh child process (:class:`plugin_tests.cli.children.
Environments`) that runs, in order, what the tests of that environment check: vLLM's
CLI first where a test runs it (the CLI then loads the plugin itself, as in a
``vllm serve`` process), vLLM's loader after it. The plugin's warnings are counted over
the whole child. The in-process registration tests are in ``unit/test_register.py``."""

from __future__ import annotations

import re

import pytest

from plugin_tests.cli.children import Environments
from plugin_tests.conftest import QWEN3_OMNI_YAML
from plugin_tests.env_utils import FAKE_VLLM, shadow_vllm_version
from vllm_omni_plugin.config.pipelines import builtin_pipelines

pytestmark = pytest.mark.cli

#: Run vLLM's own general-plugin loader (what every vLLM process does) and report what
#: the plugin did. register() is called directly only a second time, after vLLM ran
#: it, to show that it warns once.
_LOADER = {"name": "loader", "code": """
from vllm.plugins import load_general_plugins
load_general_plugins()
import sys
plugin = sys.modules.get("vllm_omni_plugin")
if plugin is not None and (plugin._registered or plugin._warned):  # vLLM ran register()
    plugin.register()  # a second call warns no more and changes nothing
from vllm import ModelRegistry
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
result = {
  "registered": "OmniPluginQwen3OmniThinker" in ModelRegistry.get_supported_archs(),
  "patched": hasattr(EngineArgs.add_cli_args, "__vllm_omni_plugin_patched__"),
  "platform": type(current_platform).__name__}
"""}

#: The serve flags' hand-off to the engine arguments of the entry stage, the pipeline
#: named as a built-in one.
_OMNI_FLAGS = {"name": "omni-flags", "code": """
import argparse
import vllm_omni_plugin
from vllm.engine.arg_utils import AsyncEngineArgs
vllm_omni_plugin.register()
ns = argparse.Namespace(model="m", stage_configs_path="qwen3_omni_moe", middleware=[])
args = AsyncEngineArgs.from_cli_args(ns)
result = {"extra": args.additional_config, "hf": args.hf_overrides,
          "middleware": ns.middleware}
"""}


def _serve_help(section: str) -> dict:
    return {"name": f"help-{section}", "vllm": ["serve", f"--help={section}"]}


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> Environments:
    """The child of each environment: VLLM_PLUGINS unset, naming the plugin, naming
    another plugin, ``none``; vLLM reporting an out-of-range version, without and with
    the override."""
    fake = shadow_vllm_version(tmp_path_factory.mktemp("shadow-vllm"))
    return Environments(tmp_path_factory, {
        "plugins-unset": ({"VLLM_PLUGINS": None}, [_serve_help("all"), _LOADER, _OMNI_FLAGS]),
        "plugins-omni": ({"VLLM_PLUGINS": "omni"}, [_serve_help("Omni"), _LOADER]),
        "plugins-other": ({"VLLM_PLUGINS": "some_other"}, [_LOADER]),
        "plugins-none": ({"VLLM_PLUGINS": "none"}, [_serve_help("all")]),
        "fake-vllm": (fake, [_serve_help("all"), _LOADER]),
        "fake-vllm-allowed": ({**fake, "VLLM_OMNI_PLUGIN_ALLOW_UNSUPPORTED_VLLM": "1"},
                              [_LOADER]),
    }, records="vllm.omni_plugin")


def _loader(envs: Environments, env: str) -> dict:
    child = envs[env]
    out = child.steps["loader"]
    assert out.rc == 0, out.stderr[-3000:]
    return {**out.result, "warnings": [m for m in child.records if "supports vLLM" in m]}


def _help(envs: Environments, env: str, section: str):
    out = envs[env].steps[f"help-{section}"]
    assert out.rc == 0, out.stderr[-3000:]
    return out


@pytest.mark.parametrize("plugins", [None, "omni"])
def test_vllm_loads_plugin(envs, plugins):
    """VLLM_PLUGINS unset or naming it: vLLM's loader finds the general entry point
    and runs it (models registered, patches on) on vLLM's own platform."""
    result = _loader(envs, f"plugins-{plugins or 'unset'}")
    assert result["warnings"] == [] and result["registered"] and result["patched"]
    from vllm.platforms import current_platform

    assert result["platform"] == type(current_platform).__name__


def test_vllm_plugins_filter_keeps_plugin_out(envs):
    """VLLM_PLUGINS naming other plugins: the entry point does not run."""
    result = _loader(envs, "plugins-other")
    assert result["warnings"] == [] and not result["registered"] and not result["patched"]


def test_vllm_discovers_plugin_and_adds_omni_group(envs):
    """`vllm serve --help=Omni`: vLLM's CLI loads the entry point and shows the group,
    the built-in pipelines' names among its help."""
    out = _help(envs, "plugins-omni", "Omni")
    assert "--stage-configs-path" in out.stdout and "Switches on omni mode" in out.stdout
    names = builtin_pipelines()
    assert {"qwen3_omni_moe", "qwen3_omni_moe_pd", "bagel", "bagel_replicated"} <= set(names)
    assert all(name in out.stdout for name in names)


def test_vllm_plugins_env_switches_plugin_off(envs):
    out = _help(envs, "plugins-none", "all")
    assert "--stage-configs-path" not in out.stdout and "--max-model-len" in out.stdout


def _without_group(text: str, title: str) -> str:
    """``text`` (argparse help) less the argument group titled ``title``: its title
    line, description and options, up to the next unindented line after a blank one."""
    lines = text.splitlines()
    start = lines.index(f"{title}:")
    end = start + 1
    while end < len(lines) and not (lines[end - 1] == "" and lines[end][:1].strip()):
        end += 1
    return "\n".join(lines[:start] + lines[end:])


# A line of vLLM's logger ("INFO 11-29 00:12:05 [importing.py:74] ..."): vLLM logs to
# stdout, and its time stamps differ between two runs.
_LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d ")


def _help_text(envs, env: str) -> str:
    """``vllm serve --help=all`` in environment ``env``, less the log lines."""
    out = _help(envs, env, "all").stdout
    return "\n".join(line for line in out.splitlines() if not _LOG_LINE.match(line))


def test_plain_serve_help_is_vllms_apart_from_the_omni_group(envs):
    """``vllm serve --help=all`` with the plugin installed is vLLM's own (VLLM_PLUGINS=none)
    with one more argument group, the plugin's "Omni"; nothing of vLLM's is changed."""
    with_plugin = _help_text(envs, "plugins-unset")
    plain = _help_text(envs, "plugins-none")
    assert "--stage-configs-path" in with_plugin
    assert _without_group(with_plugin, "Omni") == plain.rstrip("\n")


# -- a vLLM outside the supported range --------------------------------------------
def _supported_range() -> str:
    from vllm_omni_plugin.compat.version import SUPPORTED_RANGE

    return SUPPORTED_RANGE


def test_out_of_range_vllm_registers_nothing(envs):
    """One warning naming the range and the installed version; no model, no patch."""
    result = _loader(envs, "fake-vllm")
    assert len(result["warnings"]) == 1, result["warnings"]
    warning = result["warnings"][0]
    assert FAKE_VLLM in warning and _supported_range() in warning
    assert "VLLM_OMNI_PLUGIN_ALLOW_UNSUPPORTED_VLLM" in warning
    assert not result["registered"] and not result["patched"]


def test_out_of_range_vllm_serve_help_still_works(envs):
    out = _help(envs, "fake-vllm", "all")
    assert "--max-model-len" in out.stdout and "--stage-configs-path" not in out.stdout
    both = out.text
    assert both.count(f"supports vLLM {_supported_range()} but vLLM {FAKE_VLLM}") == 1, both[-3000:]


def test_out_of_range_override_registers_anyway(envs):
    result = _loader(envs, "fake-vllm-allowed")
    assert result["registered"] and result["patched"]
    assert len(result["warnings"]) == 1 and "trying anyway" in result["warnings"][0]


def test_omni_flags_reach_additional_config(envs):
    """The pipeline named by its built-in name is the package's YAML."""
    out = envs["plugins-unset"].steps["omni-flags"]
    assert out.rc == 0, out.stderr[-3000:]
    result = out.result
    settings = result["extra"]["omni_plugin"]
    assert settings["stage_id"] == 0 and settings["stage_configs_path"] == QWEN3_OMNI_YAML
    assert settings["entry"] is True and settings["payload_dir"]
    assert result["hf"]["architectures"] == ["OmniPluginQwen3OmniThinker"]
    assert result["middleware"] == [
        "vllm_omni_plugin.entrypoints.middleware.OmniApiMiddleware"]
