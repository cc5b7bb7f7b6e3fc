"""Summarise one `.ci/run`: per row (a vLLM release and the test kinds it ran), the tests
run, passed, failed, skipped and expected to fail (xfail), each with its reason, the test
time per folder, the slowest tests, and the vLLM EngineCores started; and check each
row's skips and xfails against the committed list of those it expects.

Usage: ``python3 scripts/ci_report.py [--expected FILE] [--durations FILE] RUN_DIR``
(standard library only).
RUN_DIR holds one folder per row, as `.ci/run` writes them:

* ``row.json``: ``{"release", "build", "kinds", "seconds", "exit", "transformers", "workers"}``
  (``seconds``: the row's wall time; ``workers``: pytest-xdist workers, test files run
  side by side, so the per-folder times, summed over tests, may add up to more);
* ``junit.xml``: pytest's JUnit XML (a test's time includes its fixtures' set-up, so a
  module's first test carries the start of the server or engines it shares);
* ``tmp/``: pytest's base temporary directory, where every engine script, `vllm serve`
  and headless replica of the tests writes its log. EngineCores are counted there: vLLM
  logs ``Initializing a V1 LLM engine`` once per EngineCore it starts
  (``vllm/v1/engine/core.py``), in a separate process or in-process alike.

``--expected FILE`` (`.ci/expected_skips.txt`): one line per skip or xfail a row expects,
``ROW OUTCOME TEST_ID``, where ROW is the row as `.ci/run`'s MATRIX writes it
(``0.30.0:unit,cli,engine``, ``0.33.0@cuda:unit,cli``), OUTCOME ``skip`` or ``xfail``, and
TEST_ID the test's pytest id; ``#`` starts a comment. A skip or xfail of a row that its
list lacks is UNEXPECTED: a broken environment (a missing dependency, a test that no
longer runs) must not pass as a skip. An expected one that did not happen is reported as
stale, without failing.

``--durations FILE`` (`.ci/durations.json`): also write the seconds of each test module in
this run, ``{"plugin_tests/<kind>/<module>.py": seconds}``, its tests' JUnit times summed,
the most over the rows: the order the suite hands its modules out in
(plugin_tests/conftest.py). Commit it after a full run when modules were added or their
times moved.

Prints the report; exits 1 when a row had an unexpected skip or xfail, else 0 (the
rest of the verdict is `.ci/run`'s).
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

#: what vLLM's EngineCore logs once when it starts (vllm/v1/engine/core.py, 0.30-0.32)
ENGINE_CORE_LINE = b"Initializing a V1 LLM engine"
#: the names of the engine and server logs the tests write (serve.log, engines.out, ...)
LOG_SUFFIXES = (".log", ".out")
#: what plugin_tests/conftest.py says of a test that did not start for lack of time
NOT_STARTED = "not started: the run's time budget is spent"
SLOWEST = 25
#: the outcomes a row must list to have them, as written in the expected list
EXPECTABLE = {"skipped": "skip", "xfailed": "xfail"}


def engine_cores(tmp_dir: str) -> int:
    """Occurrences of :data:`ENGINE_CORE_LINE` in the logs (:data:`LOG_SUFFIXES`) under
    ``tmp_dir``; other files there are checkpoints, some of them tens of GB (sparse)."""
    count = 0
    for root, _, files in os.walk(tmp_dir):
        for name in files:
            if not name.endswith(LOG_SUFFIXES):
                continue
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    count += f.read().count(ENGINE_CORE_LINE)
            except OSError:
                continue
    return count


def _cases(junit: str):
    """``(test id, folder, seconds, outcome, message)`` for each test case; outcome is
    ``passed``, ``failure``, ``error``, ``skipped`` or ``xfailed`` (JUnit XML has no
    xfail: pytest writes it as ``skipped`` of type ``pytest.xfail``)."""
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname = case.get("classname", "")
        parts = classname.split(".")
        folder = parts[1] if len(parts) > 2 and parts[0] == "plugin_tests" else "?"
        test_id = f"{classname.replace('.', '/')}.py::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = tag, (node.get("message") or "").strip()
                if tag == "skipped" and node.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                break
        yield test_id, folder, float(case.get("time") or 0.0), outcome, message


def module_seconds(run_dir: str) -> dict[str, float]:
    """Seconds per test module (``plugin_tests/<kind>/<module>.py``) in the run under
    ``run_dir``: its tests' JUnit times summed per row, the most over the rows; a row
    without a readable JUnit XML counts for nothing."""
    seconds: dict[str, float] = {}
    for row in sorted(os.listdir(run_dir)):
        per_row: dict[str, float] = defaultdict(float)
        try:
            for test_id, _, time_s, _, _ in _cases(os.path.join(run_dir, row, "junit.xml")):
                per_row[test_id.split("::", 1)[0]] += time_s
        except (ET.ParseError, OSError):
            continue
        for module, time_s in per_row.items():
            seconds[module] = max(seconds.get(module, 0.0), time_s)
    return seconds


def row_key(row: dict) -> str:
    """The row as `.ci/run`'s MATRIX writes it: ``RELEASE[@BUILD]:KINDS``."""
    build = row.get("build", "cpu")
    return f"{row['release']}{'' if build == 'cpu' else '@' + build}:{row['kinds']}"


def read_expected(path: str) -> dict[str, set[tuple[str, str]]]:
    """The expected skips and xfails of ``path``: row -> {(outcome, test id)}, outcome
    ``skipped`` or ``xfailed``. Raises ValueError naming the file and line of a line
    that is not ``ROW skip|xfail TEST_ID``."""
    expected: dict[str, set[tuple[str, str]]] = defaultdict(set)
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) != 3 or fields[1] not in ("skip", "xfail"):
                raise ValueError(f"{path}:{number}: expected 'ROW skip|xfail TEST_ID', "
                                 f"got {line.strip()!r}")
            outcome = next(o for o, word in EXPECTABLE.items() if word == fields[1])
            expected[fields[0]].add((outcome, fields[2]))
    return expected


def report_row(row_dir: str, expected: dict[str, set[tuple[str, str]]] | None = None
               ) -> tuple[list[str], int]:
    """The report lines of one row and its number of unexpected skips and xfails
    (0 without ``expected``)."""
    with open(os.path.join(row_dir, "row.json")) as f:
        row = json.load(f)
    title = (f"vLLM {row['release']} [{row['kinds']}] (transformers {row['transformers']}): "
             f"exit {row['exit']}, {row['seconds']} s wall with {row.get('workers', 1)} "
             "test worker(s)")
    junit = os.path.join(row_dir, "junit.xml")
    if not os.path.isfile(junit):
        return [title, "  no JUnit XML: pytest did not finish collecting"], 0
    cases = list(_cases(junit))
    outcomes = Counter(c[3] for c in cases)
    not_started = [c for c in cases if NOT_STARTED in c[4]]
    lines = [title,
             f"  tests: {len(cases)} run, {outcomes['passed']} passed, "
             f"{outcomes['failure']} failed, {outcomes['error']} errors, "
             f"{outcomes['skipped']} skipped, {outcomes['xfailed']} xfailed; "
             f"{len(not_started)} not started for lack of time",
             f"  EngineCores started: {engine_cores(os.path.join(row_dir, 'tmp'))}"]
    folders: dict[str, list[float]] = defaultdict(list)
    for _, folder, seconds, _, _ in cases:
        folders[folder].append(seconds)
    lines.append("  test time per folder (summed over its tests): " + ", ".join(
        f"{folder} {sum(times):.0f} s ({len(times)} tests)"
        for folder, times in sorted(folders.items(), key=lambda kv: -sum(kv[1]))))
    for outcome in ("skipped", "xfailed"):
        reasons = Counter(c[4] for c in cases if c[3] == outcome)
        for reason, n in reasons.most_common():
            lines.append(f"  {outcome} x{n}: {reason}")
    unexpected = 0
    if expected is not None:
        wanted = expected.get(row_key(row), set())
        happened = {(c[3], c[0]): c[4] for c in cases if c[3] in EXPECTABLE}
        for (outcome, test_id), message in sorted(happened.items()):
            if (outcome, test_id) not in wanted:
                unexpected += 1
                lines.append(f"  UNEXPECTED {EXPECTABLE[outcome].upper()} (not in the row's "
                             f"expected list): {test_id}: "
                             f"{message.splitlines()[0][:200] if message else ''}")
        for outcome, test_id in sorted(wanted - set(happened)):
            lines.append(f"  stale expected {EXPECTABLE[outcome]} (it did not happen): {test_id}")
    for test_id, _, _, outcome, message in cases:
        if outcome in ("failure", "error"):
            lines.append(f"  {outcome.upper()}: {test_id}: {message.splitlines()[0][:200]}"
                         if message else f"  {outcome.upper()}: {test_id}")
    lines.append(f"  slowest {SLOWEST}:")
    for test_id, _, seconds, _, _ in sorted(cases, key=lambda c: -c[2])[:SLOWEST]:
        lines.append(f"    {seconds:8.1f} s  {test_id}")
    return lines, unexpected


def main(argv: list[str]) -> int:
    options: dict[str, str] = {}
    while argv[:1] in (["--expected"], ["--durations"]) and len(argv) >= 2:
        options[argv[0]], argv = argv[1], argv[2:]
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    expected_path = options.get("--expected")
    expected = read_expected(expected_path) if expected_path else None
    run_dir = argv[0]
    rows = sorted(d for d in os.listdir(run_dir)
                  if os.path.isfile(os.path.join(run_dir, d, "row.json")))
    unexpected = 0
    for name in rows:
        lines, count = report_row(os.path.join(run_dir, name), expected)
        unexpected += count
        print("\n".join(lines))
    if "--durations" in options:
        with open(options["--durations"], "w") as f:
            json.dump({module: round(time_s, 1) for module, time_s
                       in sorted(module_seconds(run_dir).items())}, f, indent=0)
            f.write("\n")
    if unexpected:
        print(f"{unexpected} unexpected skip(s) or xfail(s): a row may skip or xfail only "
              f"what {expected_path} lists for it")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
