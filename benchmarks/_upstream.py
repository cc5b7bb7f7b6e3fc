"""Locate and load upstream vllm-omni's coordinator modules, for benchmarks only.

Upstream is never installed into the project venv (vLLM's CLI hands ``--omni``
to any importable ``vllm_omni`` package, which would shadow this plugin) and no
upstream code lives in this repository. It is read at run time from a side
directory that the user prepares once, either of:

* ``.venv/bin/pip install --no-deps --target /tmp/vllm-omni-0.30.0 vllm-omni==0.30.0``
  (a directory holding ``vllm_omni/``), or
* ``.venv/bin/pip download --no-deps vllm-omni==0.30.0 -d DIR`` (a directory
  holding ``vllm_omni-0.30.0-py3-none-any.whl``, or the ``.whl`` itself; it is
  unpacked into a temporary directory, removed at exit).

Two ways to load it (``mode``):

* ``"files"`` (default): the five coordinator submodules (``messages``,
  ``load_balancer``, ``omni_coordinator``, ``omni_coord_client_for_stage``,
  ``omni_coord_client_for_hub``) are executed from their files with
  ``importlib.util.spec_from_file_location`` under a private parent package
  name (:data:`ALIAS`), so their relative imports (``from .messages import
  ...``) resolve among themselves. Nothing is added to ``sys.path`` and no
  module named ``vllm_omni`` is ever registered. This is needed because
  ``import vllm_omni.distributed.omni_coordinator`` runs
  ``vllm_omni/__init__.py`` (imports vLLM and torch, applies upstream's vLLM
  patches, needs ``aenum``; with this venv it fails with ``No module named
  'aenum'`` after ~4 s and ~2,700 modules) and ``vllm_omni/distributed/__init__.py``
  (all KV connectors). Those five files import only the standard library and
  ``zmq``; ``runtime.py`` (imports ``vllm``) and the package ``__init__`` are
  skipped -- the benchmarks construct ``OmniCoordinator`` directly.
* ``"package"``: prepend the side directory to ``sys.path`` of *this process
  only* and ``import vllm_omni.distributed.omni_coordinator`` normally (works
  only in an environment with all of upstream's dependencies).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

#: Environment variable naming the side directory (or wheel); ``--upstream`` wins.
ENV = "VLLM_OMNI_UPSTREAM"
#: Where the setup instructions put it.
DEFAULT_LOCATION = "/tmp/vllm-omni-0.30.0"
#: The upstream release the seed API was taken from.
EXPECTED_VERSION = "0.30.0"
#: Private parent-package name the submodules are loaded under in ``files`` mode.
ALIAS = "_bench_upstream_omni_coordinator"
#: Path of the coordinator package inside the distribution.
COORD_SUBDIR = Path("vllm_omni", "distributed", "omni_coordinator")
#: Loaded in this order (each only imports the ones before it, stdlib and zmq).
SUBMODULES = (
    "messages",
    "load_balancer",
    "omni_coordinator",
    "omni_coord_client_for_stage",
    "omni_coord_client_for_hub",
)

SETUP_HELP = f"""\
upstream vllm-omni {EXPECTED_VERSION} not found ({{where}}).

Prepare it once, OUTSIDE the project venv (never `pip install` it into .venv:
vLLM's CLI would hand `--omni` to it), with either of:

  .venv/bin/pip install --no-deps --target {DEFAULT_LOCATION} vllm-omni=={EXPECTED_VERSION}
  .venv/bin/pip download --no-deps vllm-omni=={EXPECTED_VERSION} -d /tmp/vllm-omni-dl

then point the benchmark at it (default: {DEFAULT_LOCATION}):

  .venv/bin/python benchmarks/coordinator_bench.py --upstream {DEFAULT_LOCATION}
  .venv/bin/python benchmarks/coordinator_bench.py --upstream /tmp/vllm-omni-dl  # has the .whl
  {ENV}=/tmp/vllm-omni-dl/vllm_omni-{EXPECTED_VERSION}-py3-none-any.whl \\
      .venv/bin/python benchmarks/coordinator_bench.py
"""


class UpstreamMissing(RuntimeError):
    """The side directory / wheel is absent or does not hold the coordinator package."""


@dataclass
class Upstream:
    """The loaded upstream coordinator modules."""

    root: Path  # directory that contains vllm_omni/
    source: str  # what the user pointed at
    version: str | None  # from *.dist-info/METADATA, if present
    mode: str  # "files" or "package"
    messages: types.ModuleType
    load_balancer: types.ModuleType
    omni_coordinator: types.ModuleType
    client_for_stage: types.ModuleType
    client_for_hub: types.ModuleType


def _extract_wheel(whl: Path) -> Path:
    dest = Path(tempfile.mkdtemp(prefix="vllm-omni-upstream-"))
    atexit.register(shutil.rmtree, dest, True)
    with zipfile.ZipFile(whl) as zf:
        zf.extractall(dest)
    return dest


def find_root(location: str | None = None) -> tuple[Path, str]:
    """The directory holding ``vllm_omni/`` and a description of where it came from.

    ``location``: a directory with ``vllm_omni/``, a directory with a
    ``vllm_omni-*.whl``, or a ``.whl``; default ``$VLLM_OMNI_UPSTREAM``, then
    :data:`DEFAULT_LOCATION`.

    Raises:
        UpstreamMissing: with setup instructions.
    """
    source = location or os.environ.get(ENV) or DEFAULT_LOCATION
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".whl":
        root = _extract_wheel(path)
    elif (path / COORD_SUBDIR).is_dir():
        root = path
    elif path.is_dir() and (wheels := sorted(path.glob("vllm_omni-*.whl"))):
        pick = [w for w in wheels if f"-{EXPECTED_VERSION}-" in w.name] or wheels
        root = _extract_wheel(pick[-1])
        source = str(pick[-1])
    else:
        raise UpstreamMissing(SETUP_HELP.format(where=f"looked at {path}"))
    if not (root / COORD_SUBDIR).is_dir():
        raise UpstreamMissing(SETUP_HELP.format(where=f"{source} has no {COORD_SUBDIR}"))
    return root, source


def read_version(root: Path) -> str | None:
    for meta in sorted(root.glob("vllm_omni-*.dist-info/METADATA")):
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def _load_files(root: Path) -> dict[str, types.ModuleType]:
    pkg_dir = root / COORD_SUBDIR
    if ALIAS not in sys.modules:
        pkg = types.ModuleType(ALIAS)
        pkg.__path__ = [str(pkg_dir)]  # type: ignore[attr-defined]
        pkg.__package__ = ALIAS
        sys.modules[ALIAS] = pkg
    mods: dict[str, types.ModuleType] = {}
    for name in SUBMODULES:
        full = f"{ALIAS}.{name}"
        if full in sys.modules:
            mods[name] = sys.modules[full]
            continue
        spec = importlib.util.spec_from_file_location(full, pkg_dir / f"{name}.py")
        if spec is None or spec.loader is None:
            raise UpstreamMissing(SETUP_HELP.format(where=f"cannot load {pkg_dir / name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[full]
            raise
        mods[name] = mod
    return mods


def _load_package(root: Path) -> dict[str, types.ModuleType]:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    base = "vllm_omni.distributed.omni_coordinator"
    importlib.import_module(base)
    return {name: importlib.import_module(f"{base}.{name}") for name in SUBMODULES}


def load(location: str | None = None, mode: str = "files") -> Upstream:
    """Find upstream (see :func:`find_root`) and load its coordinator modules.

    Raises:
        UpstreamMissing: not found (message has setup instructions).
        ImportError: ``mode="package"`` in an environment without upstream's deps.
    """
    if mode not in ("files", "package"):
        raise ValueError(f"mode must be 'files' or 'package', got {mode!r}")
    root, source = find_root(location)
    mods = _load_files(root) if mode == "files" else _load_package(root)
    return Upstream(
        root=root,
        source=source,
        version=read_version(root),
        mode=mode,
        messages=mods["messages"],
        load_balancer=mods["load_balancer"],
        omni_coordinator=mods["omni_coordinator"],
        client_for_stage=mods["omni_coord_client_for_stage"],
        client_for_hub=mods["omni_coord_client_for_hub"],
    )
