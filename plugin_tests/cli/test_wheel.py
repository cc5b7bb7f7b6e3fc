"""The wheel carries every module and the pipelines: the checkout's wheel (``pip
wheel``), installed, not editable, into a directory of its own, names every built-in
pipeline from a directory outside the checkout and loads it, from its own files."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from plugin_tests.cli.children import run_command
from plugin_tests.conftest import PYTHON, REPO
from plugin_tests.helpers import installed_wheel
from vllm_omni_plugin.config.pipelines import builtin_pipelines

pytestmark = pytest.mark.cli

#: run in the installed wheel's directory: where the package and each named pipeline are
_RESOLVE = """
import json, vllm_omni_plugin
from vllm_omni_plugin.config import load_pipeline_config
from vllm_omni_plugin.config.pipelines import builtin_pipelines, resolve_stage_configs
paths = {name: resolve_stage_configs(name) for name in builtin_pipelines()}
print(json.dumps({"package": vllm_omni_plugin.__file__, "paths": paths,
                  "stages": {n: len(load_pipeline_config(p).stages) for n, p in paths.items()}}))
"""


def test_the_wheel_ships_every_pipeline_and_names_them_when_installed(tmp_path):
    site = installed_wheel(tmp_path)
    (wheel,) = (tmp_path / "wheels").glob("vllm_omni_plugin-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert builtin_pipelines()
    assert {f"vllm_omni_plugin/stage_configs/{name}.yaml" for name in builtin_pipelines()} \
        <= names
    # setup.cfg lists the packages (the pipelines' folder is mapped in): none left out
    checkout = {str(p.relative_to(REPO)) for p in Path(REPO, "vllm_omni_plugin").rglob("*.py")}
    assert checkout <= names, sorted(checkout - names)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_command(["bash", "-c", f"cd {elsewhere} && exec {PYTHON} -c '{_RESOLVE}'"],
                      tmp_path, "resolve", env_extra={"PYTHONPATH": str(site)})
    assert out.rc == 0, out.text[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["package"].startswith(str(site))
    assert set(got["paths"]) == set(builtin_pipelines())
    for name, path in got["paths"].items():
        assert path == f"{site}/vllm_omni_plugin/stage_configs/{name}.yaml"
        assert got["stages"][name] >= 2
