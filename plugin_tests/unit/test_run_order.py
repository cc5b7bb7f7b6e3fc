"""The suite's run order (``plugin_tests/conftest.py``): module times come from the
`.ci/run` records, the newest record that has a module giving its time."""

from __future__ import annotations

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

