"""scripts/ci_report.py on a real pytest run: a skip or xfail the row's expected list
lacks is UNEXPECTED and fails the report; a hang fails its test (pytest-timeout) and the
run still writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_tests.helpers import script_module

ROOT = Path(__file__).resolve().parents[2]
ROW = "0.32.0:unit,cli,engine"

PLANTED = '''
import time
import pytest

def test_passes():
    assert True

def test_skips():
    pytest.importorskip("a_module_that_is_not_installed")

@pytest.mark.xfail(reason="a known difference", raises=AssertionError, strict=True)
def test_xfails():
    assert False

def test_hangs():
    time.sleep(3600)
'''


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One row of a CI run: the planted tests run by pytest with a 3 s time limit."""
    base = tmp_path_factory.mktemp("ci")
    tests = base / "tests"
    tests.mkdir()
    (tests / "test_planted.py").write_text(PLANTED)
    row = base / "run" / "1-0.32.0-cpu-unit-cli-engine"
    row.mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--timeout", "3", f"--junitxml={row / 'junit.xml'}",
                           str(tests / "test_planted.py")],
                          cwd=tests, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    (row / "row.json").write_text(json.dumps(
        {"release": "0.32.0", "build": "cpu", "kinds": "unit,cli,engine", "seconds": 5,
         "exit": done.returncode, "transformers": "?", "workers": 1}))
    return base / "run"


def _expected(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "expected_skips.txt"
    path.write_text("# comment\n" + "".join(line + "\n" for line in lines))
    return path


def test_an_unlisted_skip_and_xfail_fail_the_report(run_dir, tmp_path, capsys):
    ci_report = script_module("ci_report")
    assert ci_report.main(["--expected", str(_expected(tmp_path, [])), str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "UNEXPECTED SKIP (not in the row's expected list): test_planted.py::test_skips: " \
        "could not import 'a_module_that_is_not_installed'" in out
    assert "UNEXPECTED XFAIL (not in the row's expected list): test_planted.py::test_xfails" \
        in out
    assert "1 skipped, 1 xfailed" in out
    assert "2 unexpected skip(s) or xfail(s)" in out


def test_a_hang_fails_its_test_and_the_row_still_reports(run_dir, tmp_path, capsys):
    ci_report = script_module("ci_report")
    ci_report.main(["--expected", str(_expected(tmp_path, [])), str(run_dir)])
    out = capsys.readouterr().out
    assert "FAILURE: test_planted.py::test_hangs: Failed: Timeout (>3.0s) from pytest-timeout" \
        in out
    assert "4 run, 1 passed, 1 failed" in out


def test_listed_skips_pass_and_a_stale_entry_is_reported(run_dir, tmp_path, capsys):
    ci_report = script_module("ci_report")
    expected = _expected(tmp_path, [f"{ROW} skip test_planted.py::test_skips",
                                    f"{ROW}  xfail  test_planted.py::test_xfails  # why",
                                    f"{ROW} skip test_planted.py::test_passes"])
    assert ci_report.main(["--expected", str(expected), str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "UNEXPECTED" not in out
    assert "stale expected skip (it did not happen): test_planted.py::test_passes" in out


def test_an_entry_for_another_row_does_not_cover_this_one(run_dir, tmp_path):
    expected = _expected(tmp_path, ["0.30.0:unit,cli,engine skip test_planted.py::test_skips",
                                    f"{ROW} xfail test_planted.py::test_xfails"])
    assert script_module("ci_report").main(["--expected", str(expected), str(run_dir)]) == 1


def test_a_malformed_line_names_the_file_and_line(tmp_path):
    expected = _expected(tmp_path, [f"{ROW} skipped test_planted.py::test_skips"])
    with pytest.raises(ValueError, match=r"expected_skips.txt:2: expected 'ROW skip\|xfail "
                                         r"TEST_ID'"):
        script_module("ci_report").read_expected(str(expected))


def test_the_committed_list_parses_and_names_matrix_rows():
    """Every row of .ci/expected_skips.txt is a row of .ci/run's MATRIX."""
    expected = script_module("ci_report").read_expected(str(ROOT / ".ci" / "expected_skips.txt"))
    matrix = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                  if line.startswith("MATRIX="))
    rows = set(matrix.split("=", 1)[1].strip('"').split())
    assert expected and set(expected) <= rows, set(expected) - rows


def test_engine_cores_are_counted_in_the_logs_only(tmp_path):
    """The count reads the tests' logs, not the checkpoints beside them: a released
    checkpoint's sparse 29 GB weights file once ran the report out of memory."""
    line = script_module("ci_report").ENGINE_CORE_LINE
    (tmp_path / "serve.log").write_bytes(line + b"\n" + line)
    (tmp_path / "engines.out").write_bytes(line)
    with open(tmp_path / "ema.safetensors", "wb") as f:
        f.write(line)
        f.truncate(64 << 30)    # sparse: no disk, but reading it whole would need 64 GiB
    assert script_module("ci_report").engine_cores(str(tmp_path)) == 3


def test_a_dead_test_worker_fails_its_row_naming_the_test(tmp_path, capsys):
    """A test worker killed mid-test (a real SIGKILL to itself) under `.ci/run`'s xdist
    flags: the row ends at once and the report names the test it ran (with xdist's
    restart, a replacement worker once never got the dead one's files and the row hung
    until CI's kill)."""
    flags = ["-n", "2", "--dist", "loadfile", "--max-worker-restart", "0"]
    ci_run = (ROOT / ".ci" / "run").read_text()
    assert "--dist loadfile" in ci_run and "--max-worker-restart 0" in ci_run
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_dies.py").write_text(
        "import os, signal\n\ndef test_dies():\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    (tests / "test_lives.py").write_text("def test_lives():\n    pass\n")
    row = tmp_path / "run" / "1-0.32.0-cpu-unit-cli-engine"
    row.mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *flags, f"--junitxml={row / 'junit.xml'}", str(tests)],
                          cwd=tests, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    (row / "row.json").write_text(json.dumps(
        {"release": "0.32.0", "build": "cpu", "kinds": "unit,cli,engine", "seconds": 5,
         "exit": done.returncode, "transformers": "?", "workers": 2}))
    script_module("ci_report").main([str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "ERROR: test_dies.py::test_dies: failed on setup with \"worker 'gw" in out
    assert "crashed while running 'test_dies.py::test_dies'" in out
    assert "2 run, 1 passed, 0 failed, 1 errors" in out
