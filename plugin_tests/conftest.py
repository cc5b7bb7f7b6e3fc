"""Shared fixtures (tiny checkpoints, made by the project's tool once per machine) and the
suite's run order and time guard."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from vllm_omni_plugin.config.pipelines import builtin_pipeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_OMNI_YAML = builtin_pipeline("qwen3_omni_moe")
QWEN3_OMNI_PD_YAML = builtin_pipeline("qwen3_omni_moe_pd")
BAGEL_YAML = builtin_pipeline("bagel")
#: what the official BAGEL code computed on the tiny BAGEL checkpoint (seed 0), written
#: by scripts/bagel_reference.sh
BAGEL_REFERENCE = os.path.join(REPO, "plugin_tests", "fixtures", "bagel_reference")


#: where the suite keeps what outlives a run (tiny checkpoints); .ci/run and
#: scripts/lint.sh use the same directory for their venvs
CACHE = os.environ.get("VLLM_OMNI_PLUGIN_CACHE",
                       os.path.join(os.path.expanduser("~"), ".cache", "vllm-omni-plugin"))


def _checkpoint_key() -> str:
    """What a tiny checkpoint's bytes depend on: the sources of the tool and of the model
    packages it reads names and shapes from, and the libraries that write the files."""
    import hashlib
    from importlib.metadata import version

    import vllm_omni_plugin

    package = os.path.dirname(vllm_omni_plugin.__file__)
    digest = hashlib.sha256()
    for folder in ("tools", "models"):
        for root, dirs, files in os.walk(os.path.join(package, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, package).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    for dist in ("torch", "transformers", "tokenizers", "safetensors"):
        digest.update(f"{dist}=={version(dist)}".encode())
    return digest.hexdigest()[:16]


def file_hashes(path: str) -> dict[str, str]:
    """SHA-256 of every file under ``path``, by path relative to it."""
    import hashlib

    hashes = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                hashes[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return hashes


def cached_tiny_checkpoint(model: str, seed: int = 0) -> str:
    """Path of the tiny ``model`` checkpoint (``tools.tiny_checkpoint``, ``seed``), built
    once per machine under ``CACHE/ckpt/<key>/`` (key: :func:`_checkpoint_key`) and
    checked against the SHA-256 of each file recorded when it was built; a changed or
    partial copy is built again. A stable path lets vLLM's compile cache, whose key
    includes the model path, hit across runs."""
    import fcntl
    import json
    import shutil
    import tempfile

    from vllm_omni_plugin.tools.tiny_checkpoint import build

    root = os.path.join(CACHE, "ckpt", _checkpoint_key())
    out = os.path.join(root, f"{model}-seed{seed}")
    manifest = out + ".sha256.json"
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time on this machine
        if os.path.isdir(out) and os.path.isfile(manifest):
            with open(manifest) as f:
                if json.load(f) == file_hashes(out):
                    return out
        staging = tempfile.mkdtemp(prefix=f".{model}-", dir=root)
        try:
            with pytest.MonkeyPatch.context() as env:
                env.setenv("HF_HUB_OFFLINE", "1")
                env.setenv("TRANSFORMERS_OFFLINE", "1")
                build(model, os.path.join(staging, "ckpt"), seed=seed)
            shutil.rmtree(out, ignore_errors=True)
            os.replace(os.path.join(staging, "ckpt"), out)
            with open(manifest, "w") as f:
                json.dump(file_hashes(out), f)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_omni() -> str:
    """Path of the tiny Qwen3-Omni checkpoint (seed 0): :func:`cached_tiny_checkpoint`."""
    return cached_tiny_checkpoint("qwen3-omni")


@pytest.fixture(scope="session")
def tiny_bagel() -> str:
    """Path of the tiny BAGEL checkpoint (seed 0): :func:`cached_tiny_checkpoint`."""
    return cached_tiny_checkpoint("bagel")


PYTHON = sys.executable
#: the `vllm` console script of the interpreter running the tests
VLLM = os.path.join(os.path.dirname(sys.executable), "vllm")


#: Test kinds (folders of plugin_tests/) in the order their modules run where
#: :data:`DURATIONS` does not order them (equal times): the cheap, broad ones first.
#: unit: in-process; cli: vLLM's CLI and plugin loading in child processes; engine: real
#: vLLM engines driven by scripts; e2e: real `vllm serve` processes.
KIND_ORDER = ("unit", "cli", "engine", "e2e")
#: Unix time after which no further test starts: .ci/run's guard against CI's time
#: limit. A test that would start after it fails, saying so (a cut run never passes).
#: Unset: no limit.
DEADLINE_ENV = "VLLM_OMNI_PLUGIN_TEST_DEADLINE"


#: vLLM's CPU build binds an engine's worker threads to cores
#: (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``), and ``auto`` puts every engine's
#: worker on the same core. Under pytest-xdist (``-n``), each test worker process pins
#: the engines it starts to a core of its own (worker i: the i-th allowed core, modulo
#: their number), so two test files run side by side on two cores instead of one; a
#: binding already in the environment is kept.
def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])


#: Test modules that pytest-xdist hands out as one work unit (``--dist loadfile``): each
#: runs a whole Qwen3-Omni pipeline (3-4 EngineCores), and side by side on two workers
#: they took 150-210 s each where alone, beside lighter files, they took about 110 s
#: (`.ci/run`, vLLM 0.30 and 0.31: their engine processes' own threads are not bound
#: to the worker's core and crowd both cores). The two replica modules start a head and
#: two or three headless processes each (up to seven `vllm serve` processes, 20+
#: EngineCores and workers together): side by side they filled the 24 GiB host, and a
#: head waited 7 minutes for its engines, so they run one after the other.
WORK_UNITS = {
    "plugin_tests/engine/test_pipeline_engine.py": "plugin_tests/engine/pipelines",
    "plugin_tests/engine/test_pipeline_pd_engine.py": "plugin_tests/engine/pipelines",
    "plugin_tests/e2e/test_replicas_netns.py": "plugin_tests/e2e/replicas",
    "plugin_tests/e2e/test_replicas_serve.py": "plugin_tests/e2e/replicas",
}


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of :data:`WORK_UNITS` as one work unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return WORK_UNITS.get(scope, scope)

    return _Scheduling(config, log)


#: Seconds per test module of a full `.ci/run` (committed; written by
#: ``python3 scripts/ci_report.py --durations .ci/durations.json RUN_DIR``): the order
#: the suite hands its modules out in, the same on every machine, a fresh one included.
DURATIONS = os.path.join(REPO, ".ci", "durations.json")


def _recorded_seconds() -> dict[str, float]:
    """Seconds per test module (``plugin_tests/<kind>/<module>.py``) from
    :data:`DURATIONS`; empty when the file is missing."""
    try:
        with open(DURATIONS) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def pytest_collection_modifyitems(config, items):
    """Run the modules that took longest in the recorded run (:data:`DURATIONS`) first,
    whatever their kind (longest-processing-time first: with test files run side by
    side, `-n 2`, a long module started last would run alone at the end, and the many
    short unit modules left for last fill both workers' ends), modules the record lacks
    before them; ties in kind order (:data:`KIND_ORDER`), then file order. A module's
    tests stay together, in order. (pytest-xdist keeps this order with
    ``--no-loadscope-reorder``, as every row of `.ci/run` runs.)"""
    recorded = _recorded_seconds()

    def key(item) -> tuple:
        module = os.path.relpath(str(item.path), REPO)
        kind = module.split(os.sep)[1] if module.count(os.sep) > 1 else ""
        rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
        return -recorded.get(module, float("inf")), rank  # a new module: maybe long

    items.sort(key=key)


def _environment_kept():
    """Leave ``os.environ`` as it was before the ``yield``."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


#: Each test, and each test module with its fixtures, leaves ``os.environ`` as it found
#: it. Engine and end-to-end tests hand this process's environment to vLLM's processes,
#: and unit tests run first: a variable a unit test or module fixture sets would reach
#: every engine after it. Seen in CI: ``advertise_host`` under test set ``VLLM_HOST_IP``
#: (``monkeypatch.delenv`` of an unset name does not undo it), and vLLM's Mooncake side
#: channel then failed to bind and the PD engines hung; a module fixture's
#: ``HF_HUB_OFFLINE`` made vLLM look a model name up in the local hub cache.
@pytest.fixture(autouse=True)
def _environment_restored():
    yield from _environment_kept()


@pytest.fixture(autouse=True, scope="module")
def _module_environment_restored():
    yield from _environment_kept()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline and time.time() > float(deadline):
        pytest.fail(f"not started: the run's time budget is spent ({DEADLINE_ENV})",
                    pytrace=False)
