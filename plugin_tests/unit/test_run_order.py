"""The suite's run order (``plugin_tests/conftest.py``): module times come from the
committed record of a full `.ci/run` (``.ci/durations.json``), which
``scripts/ci_report.py --durations`` writes from a run's JUnit XML."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from plugin_tests import conftest
from plugin_tests.helpers import script_module


def _junit(path, cases: dict[str, list[float]]) -> None:
    path.parent.mkdir(parents=True)
    rows = "".join(f'<testcase classname="{module}" name="t{i}" time="{t}" />'
                   for module, times in cases.items() for i, t in enumerate(times))
    path.write_text(f'<testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    (path.parent / "row.json").write_text(json.dumps(
        {"release": "0.32.0", "build": "cpu", "kinds": "unit", "seconds": 1, "exit": 0,
         "transformers": "?", "workers": 1}))


def test_a_modules_time_is_its_tests_summed_the_most_over_the_rows(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _junit(run / "1-a" / "junit.xml", {"plugin_tests.unit.test_x": [4.0],
                                       "plugin_tests.e2e.test_y": [100.0, 50.0]})
    _junit(run / "2-b" / "junit.xml", {"plugin_tests.unit.test_x": [5.0, 1.0]})
    (run / "3-c").mkdir()  # a row that wrote no JUnit XML counts for nothing
    durations = tmp_path / "durations.json"
    assert script_module("ci_report").main(["--durations", str(durations), str(run)]) == 0
    monkeypatch.setattr(conftest, "DURATIONS", str(durations))
    assert conftest._recorded_seconds() == {"plugin_tests/unit/test_x.py": 6.0,
                                            "plugin_tests/e2e/test_y.py": 150.0}


def test_no_record_no_times(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "DURATIONS", str(tmp_path / "missing.json"))
    assert conftest._recorded_seconds() == {}


def test_the_committed_record_names_only_modules_that_exist():
    for module in conftest._recorded_seconds():
        assert os.path.isfile(os.path.join(conftest.REPO, module)), module


def test_modules_run_longest_first_whatever_their_kind(tmp_path, monkeypatch):
    """Longest-processing-time first over every kind: a long e2e module before a shorter
    engine one, the short unit modules last; a module the record lacks first; equal
    times in kind order; a module's tests stay together, in order."""
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps(
        {"plugin_tests/unit/test_u.py": 1.0, "plugin_tests/engine/test_g.py": 200.0,
         "plugin_tests/e2e/test_s.py": 300.0, "plugin_tests/cli/test_c.py": 1.0}))
    monkeypatch.setattr(conftest, "DURATIONS", str(durations))

    def item(module: str, name: str):
        return SimpleNamespace(path=os.path.join(conftest.REPO, "plugin_tests", module),
                               name=name)

    items = [item("unit/test_u.py", "u1"), item("unit/test_u.py", "u2"),
             item("cli/test_c.py", "c1"), item("engine/test_g.py", "g1"),
             item("e2e/test_s.py", "s1"), item("e2e/test_s.py", "s2"),
             item("e2e/test_new.py", "n1")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["n1", "s1", "s2", "g1", "u1", "u2", "c1"]
