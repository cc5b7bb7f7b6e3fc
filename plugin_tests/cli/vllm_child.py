"""A child process that runs several steps against vLLM in turn, each as its own
command would run, so that one process (one import of vLLM, 10-16 s) serves the checks
of one environment.

Usage (run by :func:`plugin_tests.cli.children.run_steps`, not by hand)::

    python vllm_child.py SPEC.json OUTDIR

``SPEC.json``: ``{"records": LOGGER or null, "steps": [STEP, ...]}``, each step one of

* ``{"name": N, "vllm": [ARG, ...]}``: vLLM's own CLI entry point
  (``vllm.entrypoints.cli.main.main``, what the ``vllm`` console script calls) with
  ``sys.argv`` set to ``["vllm", ARG, ...]``;
* ``{"name": N, "module": M, "argv": [ARG, ...]}``: ``python -m M ARG ...``
  (``runpy``, as ``__main__``);
* ``{"name": N, "code": SOURCE}``: ``exec(SOURCE)`` in a namespace that all code steps
  share; the value it leaves in ``result`` (JSON) is reported.

Steps run in the given order; each writes its file descriptors 1 and 2 to
``OUTDIR/N.out`` and ``OUTDIR/N.err`` (log handlers that hold ``sys.stdout`` write
there too). Its exit status is what the command's would be: a ``SystemExit``'s code,
1 and the traceback on stderr for an exception, else 0. ``LOGGER``: the message of
every record made by that logger or its descendants in the whole process is reported;
they are seen as they are made (the log record factory), not by a handler, which would
change where they go (a record that no handler takes is printed to stderr by Python).

Writes ``OUTDIR/report.json``: ``{"records": [MESSAGE, ...], "steps": {N: {"rc": RC,
"result": RESULT}}}``. Imports nothing but the standard library before the first step:
the first step imports what its command would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import sys
import traceback


def _watch(logger: str) -> list[str]:
    """The messages of the records that ``logger`` and its descendants make from now on
    (filled in as they are made)."""
    messages: list[str] = []
    make = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if record.name == logger or record.name.startswith(logger + "."):
            messages.append(record.getMessage())
        return record

    logging.setLogRecordFactory(factory)
    return messages


@contextlib.contextmanager
def _fds_to(out_path: str, err_path: str):
    """File descriptors 1 and 2 write to ``out_path`` and ``err_path`` in the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _run(step: dict, namespace: dict) -> None:
    """Run one step (see the module's docstring)."""
    if "vllm" in step:
        from vllm.entrypoints.cli.main import main

        sys.argv = ["vllm", *step["vllm"]]
        main()
    elif "module" in step:
        sys.argv = [step["module"], *step["argv"]]
        runpy.run_module(step["module"], run_name="__main__", alter_sys=True)
    else:
        exec(step["code"], namespace)


def _exit_status(step: dict, namespace: dict) -> int:
    """The exit status of a process that ran ``step`` and then ended, as Python computes
    it (a ``SystemExit`` message goes to stderr, an exception's traceback too)."""
    try:
        _run(step, namespace)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def main(spec_path: str, outdir: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    records = _watch(spec["records"]) if spec["records"] else []
    namespace: dict = {}
    steps = {}
    for step in spec["steps"]:
        name = step["name"]
        namespace.pop("result", None)
        with _fds_to(os.path.join(outdir, f"{name}.out"), os.path.join(outdir, f"{name}.err")):
            rc = _exit_status(step, namespace)
        steps[name] = {"rc": rc, "result": namespace.get("result")}
    with open(os.path.join(outdir, "report.json"), "w") as f:
        json.dump({"records": records, "steps": steps}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
