"""Helpers shared by the tests: waiting for a condition (every wait in the
suite is for a condition with a bound, never a bare sleep), raw sockets and child
processes that take their own children with them, and the repository's scripts as
modules."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq

#: Seconds: upper bound for anything that should happen "soon".
WAIT = 5.0
#: Seconds: the bound of a wait that a loaded host (2 cores, ``pytest -n 2``) may stretch
#: far beyond its usual milliseconds; reaching it means the awaited thing never came.
LONG_WAIT = 30.0


def script_module(name: str):
    """``scripts/<name>.py`` of the repository, loaded as a module (the scripts are not
    a package)."""
    from plugin_tests.conftest import REPO

    spec = importlib.util.spec_from_file_location(name, Path(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wait_until(pred: Callable[[], bool], timeout: float = WAIT, interval: float = 0.01) -> bool:
    """True as soon as ``pred()`` holds; its last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


async def until(pred: Callable[[], bool], timeout: float = WAIT, interval: float = 0.01,
                what: str = "condition") -> None:
    """Return once ``pred()`` holds, yielding to the event loop meanwhile.

    Raises:
        AssertionError: it did not hold within ``timeout`` seconds (the message names
            ``what``).
    """
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:g} s"
        await asyncio.sleep(interval)


def dealer(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """A DEALER socket connected to ``addr`` that drops unsent frames on close."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


@contextlib.contextmanager
def http_files(files: dict[str, bytes]) -> Iterator[str]:
    """A real HTTP server on a port of the OS's choosing (a thread of this process) that
    answers ``GET /<name>`` with ``files[name]`` (``image/png``) and any other path with
    404; yields its base URL (``http://127.0.0.1:<port>``)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            data = files.get(self.path.lstrip("/"))
            if data is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # not on the test's stderr
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def process_group(cmd: list[str], **popen) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(cmd, **popen)`` in a session of its own; on leaving the block,
    the whole process group is killed (SIGKILL) and the child reaped. vLLM's engine core
    and worker processes outlive a script that timed out or crashed; left behind, they
    keep the cores busy (a worker spins waiting for its engine) for every test after."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


#: vLLM's CPU-CI switch (.ci/run sets it): torch.compile traces with dynamo's eager
#: backend instead of generating inductor kernels, and the CPU worker skips its warm-up
CPU_CI_ENV = "VLLM_CPU_CI_ENV"


def inductor_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) without :data:`CPU_CI_ENV`: the
    engines it starts compile the thinker with inductor and warm up, as users' do.

    For the run that checks parity with the compiled thinker; for every pipeline with
    a prefill/decode thinker (with the switch on, the decode thinker's worker died on
    its first forward: vLLM 0.30 and 0.32, in `.ci/run`; cause not found yet, while the
    offline PD engine pair ran fine); and for the hardening server, whose fuzzed
    requests may generate up to ``--max-model-len`` tokens within a client timeout."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k != CPU_CI_ENV}


def run_process_group(cmd: list[str], *, timeout: float, **popen) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=timeout, **popen)`` through :func:`process_group`:
    what the command started dies with it, on a timeout too.

    Raises:
        subprocess.TimeoutExpired: the command ran past ``timeout`` seconds.
    """
    with process_group(cmd, **popen) as proc:
        stdout, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def script_report(script, returncode: int, stdout: str, stderr: str) -> dict:
    """The JSON object an engine script printed on its last stdout line. Fails the test
    with the script's output when it exited non-zero or printed none."""
    import json

    import pytest

    lines = stdout.strip().splitlines()
    if returncode != 0 or not lines or not lines[-1].startswith("{"):
        pytest.fail(f"{os.path.basename(str(script))} exited {returncode}:\n"
                    f"{stdout[-3000:]}\n{stderr[-6000:]}")
    return json.loads(lines[-1])


def engine_script_results(script, spec: dict, logdir, *, name: str, env: dict | None = None,
                          timeout: float = 600) -> dict:
    """Run an engine script (``plugin_tests/engine/scripts/*.py``) on its JSON spec, with
    the repository importable, offline: the spec in ``{name}.json`` in ``logdir``, the
    script's stdout and stderr (vLLM's logs, and those of the engine core processes it
    starts) in ``{name}.out`` and ``{name}.err`` there. Returns the result of each engine
    of the spec by name: ``{"error": traceback}`` for one that failed (see
    :func:`engine_result`). Fails the test with the script's output when it crashed."""
    import json
    import sys
    from pathlib import Path

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, (repo,
                                                            os.environ.get("PYTHONPATH")))),
                **(env or {})}
    paths = {ext: Path(logdir) / f"{name}.{ext}" for ext in ("json", "out", "err")}
    paths["json"].write_text(json.dumps(spec))
    with open(paths["json"]) as stdin, open(paths["out"], "w") as out, \
            open(paths["err"], "w") as err:
        proc = run_process_group([sys.executable, str(script)], env=full_env, stdin=stdin,
                                 stdout=out, stderr=err, timeout=timeout)
    return script_report(script, proc.returncode, paths["out"].read_text(),
                         paths["err"].read_text())["engines"]


def engine_result(results: dict, name: str) -> dict:
    """``results[name]`` (from :func:`engine_script_results`); fails the test with the
    engine's traceback where it failed."""
    import pytest

    result = results[name]
    if "error" in result:
        pytest.fail(f"engine {name!r} failed:\n{result['error']}")
    return result


def served_bagel_config(checkpoint: str):
    """vLLM's ``BagelConfig`` of a BAGEL checkpoint (its ``config.json``), as an engine
    serving it reads it."""
    import json
    from pathlib import Path

    from vllm.transformers_utils.configs.bagel import BagelConfig

    served = json.loads((Path(checkpoint) / "config.json").read_text())
    return BagelConfig(**{k: v for k, v in served.items() if k != "model_type"})


#: what building the wheel reads from the checkout
WHEEL_SOURCES = ("pyproject.toml", "setup.cfg", "README.md", "vllm_omni_plugin", "stage_configs")


def installed_wheel(root, timeout: float = 300) -> Path:
    """Build the checkout's wheel (``pip wheel``, no dependencies; from a copy of
    :data:`WHEEL_SOURCES` in ``root/src``, so no ``build/`` of an earlier build leaks
    into it) into ``root/wheels`` and install it, not editable, into ``root/site``
    (``pip install --target``): a process with ``PYTHONPATH=root/site`` imports the
    plugin, and vLLM finds its entry point, from the wheel's files. Returns
    ``root/site``; fails the test with pip's output."""
    import shutil

    import pytest

    from plugin_tests.conftest import PYTHON, REPO

    root = Path(root)
    src, wheels, site = root / "src", root / "wheels", root / "site"
    src.mkdir(parents=True)
    for name in WHEEL_SOURCES:
        if os.path.isdir(os.path.join(REPO, name)):
            shutil.copytree(os.path.join(REPO, name), src / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(os.path.join(REPO, name), src / name)

    def pip(*args: str) -> None:
        done = run_process_group([PYTHON, "-m", "pip", *args], timeout=timeout,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            pytest.fail(f"pip {args[0]} exited {done.returncode}:\n{done.stdout[-3000:]}")

    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src))
    (wheel,) = wheels.glob("vllm_omni_plugin-*.whl")
    pip("install", "-q", "--no-deps", "--target", str(site), str(wheel))
    return site


def ci_matrix() -> list[tuple[str, str, str]]:
    """[(vLLM release, build, its test kinds, e.g. "unit, cli, engine")] from ``.ci/run``'s
    MATRIX line (rows of ``release[@build]:kind,kind``, build ``cpu`` unless named; a
    release may have several rows), oldest release first."""
    import re

    from packaging.version import Version

    from plugin_tests.conftest import REPO

    (line,) = re.findall(r'^MATRIX="([^"]*)"$', (Path(REPO) / ".ci/run").read_text(), re.M)
    kinds: dict[tuple[str, str], list[str]] = {}
    for entry in line.split():
        release, row = entry.split(":")
        release, _, build = release.partition("@")
        kinds.setdefault((release, build or "cpu"), []).extend(row.split(","))
    return [(release, build, ", ".join(kinds[release, build]))
            for release, build in sorted(kinds, key=lambda k: Version(k[0]))]


class RowsModel:
    """A stage model's outputs for the worker's payload channel, scripted: each
    :meth:`forward` keeps ``embed`` rows ``[n, 1]`` (float32) holding the values of the
    ranges it is given (the rows' positions, or their indexes in the step), so slicing
    and ordering are visible; ``tts_embed`` ``[3, 1]`` once per request."""

    def __init__(self):
        self.rows = {}

    def forward(self, *positions: range):
        import torch

        self.rows = {"embed": torch.tensor([float(p) for r in positions for p in r])[:, None]}

    def stage_output_rows(self):
        return self.rows

    def stage_output_once(self):
        import torch

        return {"tts_embed": torch.ones(3, 1)}
