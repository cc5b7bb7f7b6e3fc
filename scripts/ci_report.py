"""Summarise one `.ci/run`: per row (a vLLM release and the test kinds it ran), the tests
run, passed, failed and skipped (with the reasons), the test time per folder, the
slowest tests, and the vLLM EngineCores started.

Usage: ``python3 scripts/ci_report.py RUN_DIR`` (standard library only). RUN_DIR holds one
folder per row, as `.ci/run` writes them:

* ``row.json``: ``{"release", "kinds", "seconds", "exit", "transformers", "workers"}``
  (``seconds``: the row's wall time; ``workers``: pytest-xdist workers, test files run
  side by side, so the per-folder times, summed over tests, may add up to more);
* ``junit.xml``: pytest's JUnit XML (a test's time includes its fixtures' set-up, so a
  module's first test carries the start of the server or engines it shares);
* ``tmp/``: pytest's base temporary directory, where every engine script, `vllm serve`
  and headless replica of the tests writes its log. EngineCores are counted there: vLLM
  logs ``Initializing a V1 LLM engine`` once per EngineCore it starts
  (``vllm/v1/engine/core.py``), in a separate process or in-process alike.

Prints the report; exits 0 (the verdict is `.ci/run`'s).
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

#: what vLLM's EngineCore logs once when it starts (vllm/v1/engine/core.py, 0.30-0.32)
ENGINE_CORE_LINE = b"Initializing a V1 LLM engine"
#: what plugin_tests/conftest.py says of a test that did not start for lack of time
NOT_STARTED = "not started: the run's time budget is spent"
SLOWEST = 25


def engine_cores(tmp_dir: str) -> int:
    """Occurrences of :data:`ENGINE_CORE_LINE` in the files under ``tmp_dir``."""
    count = 0
    for root, _, files in os.walk(tmp_dir):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    count += f.read().count(ENGINE_CORE_LINE)
            except OSError:
                continue
    return count


def _cases(junit: str):
    """``(test id, folder, seconds, outcome, message)`` for each test case."""
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
                break
        yield test_id, folder, float(case.get("time") or 0.0), outcome, message


def report_row(row_dir: str) -> list[str]:
    with open(os.path.join(row_dir, "row.json")) as f:
        row = json.load(f)
    title = (f"vLLM {row['release']} [{row['kinds']}] (transformers {row['transformers']}): "
             f"exit {row['exit']}, {row['seconds']} s wall with {row.get('workers', 1)} "
             "test worker(s)")
    junit = os.path.join(row_dir, "junit.xml")
    if not os.path.isfile(junit):
        return [title, "  no JUnit XML: pytest did not finish collecting"]
    cases = list(_cases(junit))
    outcomes = Counter(c[3] for c in cases)
    not_started = [c for c in cases if NOT_STARTED in c[4]]
    lines = [title,
             f"  tests: {len(cases)} run, {outcomes['passed']} passed, "
             f"{outcomes['failure']} failed, {outcomes['error']} errors, "
             f"{outcomes['skipped']} skipped; {len(not_started)} not started for lack of time",
             f"  EngineCores started: {engine_cores(os.path.join(row_dir, 'tmp'))}"]
    folders: dict[str, list[float]] = defaultdict(list)
    for _, folder, seconds, _, _ in cases:
        folders[folder].append(seconds)
    lines.append("  test time per folder (summed over its tests): " + ", ".join(
        f"{folder} {sum(times):.0f} s ({len(times)} tests)"
        for folder, times in sorted(folders.items(), key=lambda kv: -sum(kv[1]))))
    reasons = Counter(c[4] for c in cases if c[3] == "skipped")
    for reason, n in reasons.most_common():
        lines.append(f"  skipped x{n}: {reason}")
    for test_id, _, _, outcome, message in cases:
        if outcome in ("failure", "error"):
            lines.append(f"  {outcome.upper()}: {test_id}: {message.splitlines()[0][:200]}"
                         if message else f"  {outcome.upper()}: {test_id}")
    lines.append(f"  slowest {SLOWEST}:")
    for test_id, _, seconds, _, _ in sorted(cases, key=lambda c: -c[2])[:SLOWEST]:
        lines.append(f"    {seconds:8.1f} s  {test_id}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    run_dir = argv[0]
    rows = sorted(d for d in os.listdir(run_dir)
                  if os.path.isfile(os.path.join(run_dir, d, "row.json")))
    for name in rows:
        print("\n".join(report_row(os.path.join(run_dir, name))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
