"""The child processes of the CLI tests. Importing vLLM costs a child 10-16 s, so the
checks of one environment share one child (:mod:`plugin_tests.cli.vllm_child` runs
them as steps, each as its own command would run), and a command runs as a process
of its own only where the process itself is what is tested. What each child printed
stays in files under pytest's tmp dirs."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from plugin_tests.conftest import PYTHON
from plugin_tests.env_utils import child_env
from plugin_tests.helpers import run_process_group

CHILD = Path(__file__).with_name("vllm_child.py")


@dataclass
class Output:
    """What a command or a step left: its exit status, stdout and stderr and, for a
    code step, the ``result`` it set."""

    rc: int
    stdout: str
    stderr: str
    result: object = None

    @property
    def text(self) -> str:
        """stdout and stderr together."""
        return self.stdout + self.stderr


@dataclass
class Child:
    """What a child process reported: the messages of its watched logger (whole process)
    and each step's output by name."""

    records: list[str]
    steps: dict[str, Output]


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


def run_steps(steps: list[dict], outdir: Path, *, env_extra: dict | None = None,
              records: str | None = None, timeout: float = 600) -> Child:
    """Run ``steps`` (see :mod:`plugin_tests.cli.vllm_child`) in one child process in
    this process's environment with ``env_extra`` applied (None removes a name); each
    step's output goes to ``outdir/NAME.out`` and ``.err``, the child's own to
    ``outdir/child.log``. Fails the test when the child itself failed."""
    outdir.mkdir(parents=True, exist_ok=True)
    spec = outdir / "spec.json"
    spec.write_text(json.dumps({"records": records, "steps": steps}, indent=1))
    log = outdir / "child.log"
    with open(log, "w") as f:
        proc = run_process_group([PYTHON, str(CHILD), str(spec), str(outdir)], stdout=f,
                                 stderr=subprocess.STDOUT, timeout=timeout,
                                 env=child_env(env_extra))
    report = outdir / "report.json"
    if proc.returncode != 0 or not report.exists():
        pytest.fail(f"{CHILD.name} exited {proc.returncode}:\n{_read(log)[-6000:]}")
    data = json.loads(report.read_text())
    return Child(records=data["records"], steps={
        name: Output(s["rc"], _read(outdir / f"{name}.out"), _read(outdir / f"{name}.err"),
                     s["result"]) for name, s in data["steps"].items()})


def run_command(cmd: list[str], outdir: Path, name: str, *, env_extra: dict | None = None,
                timeout: float = 240) -> Output:
    """Run ``cmd`` as a process of its own (what it starts dies with it), stdout to
    ``outdir/NAME.out``, stderr to ``outdir/NAME.err``."""
    outdir.mkdir(parents=True, exist_ok=True)
    out, err = outdir / f"{name}.out", outdir / f"{name}.err"
    with open(out, "w") as fout, open(err, "w") as ferr:
        proc = run_process_group(cmd, stdout=fout, stderr=ferr, timeout=timeout,
                                 env=child_env(env_extra))
    return Output(proc.returncode, _read(out), _read(err))


class Environments:
    """One child per environment, run on first use: ``envs[name]`` is the
    :class:`Child` that ran ``steps`` with ``env_extra`` for ``table[name] =
    (env_extra, steps)``."""

    def __init__(self, tmp_path_factory, table: dict[str, tuple[dict, list[dict]]], *,
                 records: str | None = None) -> None:
        self._tmp = tmp_path_factory
        self._table = table
        self._records = records
        self._children: dict[str, Child] = {}

    def __getitem__(self, name: str) -> Child:
        if name not in self._children:
            env_extra, steps = self._table[name]
            self._children[name] = run_steps(steps, self._tmp.mktemp(name),
                                             env_extra=env_extra, records=self._records)
        return self._children[name]
