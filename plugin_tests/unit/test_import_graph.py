"""No import circle inside ``vllm_omni_plugin``, and no import up a floor.

The graph is read from the source with ``ast`` (nothing is imported): an edge
for every ``import``/``from ... import`` of a plugin module, at module level
or inside a function (a lazy import still ties the two modules together),
also under ``if TYPE_CHECKING:`` (a type is a dependency too).
``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg``.

The floors and the seams (the edges allowed to point up a floor) are the two tables
of ``docs/contributing/layout.md``'s "Floors": the page is the one place they are
written, and this test holds the package to it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from plugin_tests.unit.test_docs import codes, rows

PACKAGE = "vllm_omni_plugin"
ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs/contributing/layout.md"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps: set[str | None] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(owner(a.name) for a in node.names if a.name.startswith(PACKAGE))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.startswith(PACKAGE):
                    deps.update(f"{source}.{a.name}" if f"{source}.{a.name}" in mods
                                else owner(source) for a in node.names)
        graph[module] = {d for d in deps if d and d != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    # a function-level import and a relative one
    assert "vllm_omni_plugin.processors.registry" in graph["vllm_omni_plugin.config.loader"]
    assert "vllm_omni_plugin.replicas.replica" in graph["vllm_omni_plugin.replicas.pool"]


def test_detects_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_the_package():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def _paths() -> dict[str, str]:
    """Module -> its file, relative to the package (``compat/engine_client.py``,
    ``models/__init__.py``, ``__init__.py``)."""
    return {m: p.relative_to(ROOT / PACKAGE).as_posix() for m, p in _modules().items()}


def _room(path: str) -> str:
    """What stands on a floor: the top-level folder (``engine/``) or module of ``path``."""
    top, sep, _ = path.partition("/")
    return top + sep


def floors(text: str) -> dict[str, int]:
    """Folder or top-level module -> its floor (1 at the bottom), from the layout page."""
    return {room: int(floor) for floor, cell in rows(text, ["floor", "folders and modules"])
            for room in codes(cell)}


def seams(text: str) -> set[tuple[str, str]]:
    """The (module, imported module) files allowed to point up, from the layout page."""
    return {(codes(module)[0], codes(target)[0])
            for module, target, _why in rows(text, ["module", "imports", "why"])}


def layer_problems(graph: dict[str, set[str]], text: str) -> list[str]:
    """What breaks the layout page's floors in ``graph``: a folder or module on no floor
    (or a floor's entry that is not in the package), an edge up a floor that is not a
    seam, and a seam that no longer points up."""
    paths = _paths()
    floor = floors(text)
    rooms = {_room(p) for p in paths.values()}
    problems = [f"{room}: on no floor" for room in sorted(rooms - floor.keys())]
    problems += [f"{room}: on a floor, not in the package"
                 for room in sorted(floor.keys() - rooms)]
    up = {(paths[m], paths[d]) for m, deps in graph.items() for d in deps
          if floor.keys() >= {_room(paths[m]), _room(paths[d])}
          and floor[_room(paths[d])] > floor[_room(paths[m])]}
    allowed = seams(text)
    problems += [f"{m} -> {d}: up from floor {floor[_room(m)]} to {floor[_room(d)]}"
                 for m, d in sorted(up - allowed)]
    problems += [f"seam {m} -> {d}: no longer an import up a floor"
                 for m, d in sorted(allowed - up)]
    return problems


def test_imports_keep_to_the_floors():
    problems = layer_problems(import_graph(), LAYOUT.read_text())
    assert not problems, (
        "docs/contributing/layout.md's floors are broken (import the other way round, name "
        "what vLLM loads by a qualified-name string, or add a seam with its reason): "
        + "; ".join(problems))


def test_an_import_up_a_floor_and_a_stale_seam_are_reported():
    graph = import_graph()
    graph[f"{PACKAGE}.config.cli"].add(f"{PACKAGE}.entrypoints.middleware")
    graph[f"{PACKAGE}.compat.engine_client"].discard(f"{PACKAGE}.engine.omni_client")
    text = LAYOUT.read_text().replace("| `wire/`, ", "| ").replace(
        "| `envs.py`, ", "| `gone/`, `envs.py`, ")
    assert layer_problems(graph, text) == [
        "wire/: on no floor",
        "gone/: on a floor, not in the package",
        "config/cli.py -> entrypoints/middleware.py: up from floor 5 to 11",
        "seam compat/engine_client.py -> engine/omni_client.py: no longer an import up a floor",
    ]


def test_the_names_config_writes_as_strings_import_to_their_objects():
    """``config/`` names what vLLM loads by qualified name from a higher floor (the API's
    ``--middleware``, the placing ``distributed_executor_backend``) as a string, not an
    import: each string imports to the object it names."""
    from vllm_omni_plugin.config.cli import MIDDLEWARE_QUALNAME
    from vllm_omni_plugin.config.placement import EXECUTOR_QUALNAME, UNIPROC_EXECUTOR_QUALNAME
    from vllm_omni_plugin.entrypoints.middleware import OmniApiMiddleware
    from vllm_omni_plugin.worker.placement import OmniPlacedExecutor, OmniPlacedUniProcExecutor

    for qualname, obj in [(MIDDLEWARE_QUALNAME, OmniApiMiddleware),
                          (EXECUTOR_QUALNAME, OmniPlacedExecutor),
                          (UNIPROC_EXECUTOR_QUALNAME, OmniPlacedUniProcExecutor)]:
        module, _, name = qualname.rpartition(".")
        assert getattr(importlib.import_module(module), name) is obj, qualname
