"""The suite's run order (``plugin_tests/conftest.py``): module times come from the
`.ci/run` records, the newest record that has a module giving its time."""

from __future__ import annotations

import os
from types import SimpleNamespace

from plugin_tests import conftest


def _junit(path, cases: dict[str, list[float]]) -> None:
    path.parent.mkdir(parents=True)
    rows = "".join(f'<testcase classname="{module}" name="t{i}" time="{t}" />'
                   for module, times in cases.items() for i, t in enumerate(times))
    path.write_text(f'<testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')


def test_a_run_in_progress_keeps_the_older_runs_times_of_the_rows_it_has_not_run(
        tmp_path, monkeypatch):
    runs = tmp_path / "ci-runs"
    # the older, finished run: both kinds; the e2e module in its own row
    _junit(runs / "20260101-000000" / "1-a" / "junit.xml",
           {"plugin_tests.unit.test_x": [1.0, 2.0]})
    _junit(runs / "20260101-000000" / "2-b" / "junit.xml",
           {"plugin_tests.e2e.test_y": [100.0, 50.0]})
    # the run in progress: its first two rows ran the unit module (the longest row counts)
    _junit(runs / "20260102-000000" / "1-a" / "junit.xml",
           {"plugin_tests.unit.test_x": [4.0]})
    _junit(runs / "20260102-000000" / "2-c" / "junit.xml",
           {"plugin_tests.unit.test_x": [5.0, 1.0]})
    (runs / "20260102-000000" / "3-d").mkdir()  # the row still running: no JUnit yet
    monkeypatch.setattr(conftest, "CACHE", str(tmp_path))
    assert conftest._recorded_seconds() == {"plugin_tests/unit/test_x.py": 6.0,
                                            "plugin_tests/e2e/test_y.py": 150.0}


def test_no_records_no_times(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "CACHE", str(tmp_path))
    assert conftest._recorded_seconds() == {}


def test_modules_run_longest_first_whatever_their_kind(tmp_path, monkeypatch):
    """Longest-processing-time first over every kind: a long e2e module before a shorter
    engine one, the short unit modules last; a module the record lacks first; equal
    times in kind order; a module's tests stay together, in order."""

    _junit(tmp_path / "ci-runs" / "20260101-000000" / "1-a" / "junit.xml",
           {"plugin_tests.unit.test_u": [1.0], "plugin_tests.engine.test_g": [200.0],
            "plugin_tests.e2e.test_s": [300.0], "plugin_tests.cli.test_c": [1.0]})
    monkeypatch.setattr(conftest, "CACHE", str(tmp_path))

    def item(module: str, name: str):
        return SimpleNamespace(path=os.path.join(conftest.REPO, "plugin_tests", module),
                               name=name)

    items = [item("unit/test_u.py", "u1"), item("unit/test_u.py", "u2"),
             item("cli/test_c.py", "c1"), item("engine/test_g.py", "g1"),
             item("e2e/test_s.py", "s1"), item("e2e/test_s.py", "s2"),
             item("e2e/test_new.py", "n1")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["n1", "s1", "s2", "g1", "u1", "u2", "c1"]
