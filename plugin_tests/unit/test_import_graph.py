"""No import circle inside ``vllm_omni_plugin``.

The graph is read from the source with ``ast`` (nothing is imported): an edge
for every ``import``/``from ... import`` of a plugin module, at module level
or inside a function (a lazy import still ties the two modules together),
also under ``if TYPE_CHECKING:`` (a type is a dependency too).
``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = "vllm_omni_plugin"
ROOT = Path(__file__).resolve().parents[2]


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
