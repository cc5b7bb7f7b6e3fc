"""The docs' reference tables say what the code does, both ways.

Each check reads one table of ``docs/`` and compares it with the code it documents:
the ``vllm serve`` flags and their defaults with the plugin's argparse group, the
environment variables with the ones the package reads, the pipeline YAML fields and
their defaults with the schema's models, the endpoints with the API middleware's
routes, the HTTP statuses with those the package answers with, and the metrics with
what the ``/metrics`` collector yields. A row for something that does not exist, a
thing without a row, or a wrong default is reported. The last test plants such
mismatches in a page's text and checks that each is reported. And every public function
on tensors says their shapes and dtypes in its docstring.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "vllm_omni_plugin"
NONE = "(none)"


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The Markdown tables of ``text``: (header cells, body rows of cells)."""
    found, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2:
            found.append((block[0], block[2:]))
        block = []
    return found


def rows(text: str, header: list[str]) -> list[list[str]]:
    """The body rows of every table of ``text`` with this header."""
    return [row for head, body in tables(text) if head == header for row in body]


def codes(cell: str) -> list[str]:
    """The ``code`` spans of a cell."""
    return re.findall(r"`([^`]+)`", cell)


def shown(value) -> str:
    """A default as the docs write it."""
    if value is None:
        return NONE
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if value == "":
        return '""'
    return str(value)


def documented_default(cell: str) -> str:
    spans = codes(cell)
    return spans[0] if spans else cell


def _compare(what: str, documented: dict[str, str], actual: dict[str, str]) -> list[str]:
    problems = [f"{what} {name}: documented, not in the code" for name in documented
                if name not in actual]
    problems += [f"{what} {name}: in the code, not documented" for name in actual
                 if name not in documented]
    problems += [f"{what} {name}: documented default {documented[name]!r}, the code's "
                 f"{actual[name]!r}" for name in documented
                 if name in actual and documented[name] != actual[name]]
    return problems


# -- the checks: each returns its mismatches --------------------------------------------
def flag_problems(text: str) -> list[str]:
    from vllm_omni_plugin.config.cli import GROUP_TITLE, add_omni_args

    parser = argparse.ArgumentParser()
    add_omni_args(parser)
    (group,) = [g for g in parser._action_groups if g.title == GROUP_TITLE]
    actual, aliases = {}, {}
    for action in group._group_actions:
        long = action.option_strings[0]
        actual[long] = shown(action.default)
        aliases[long] = sorted(action.option_strings)
    documented, doc_aliases = {}, {}
    for flag, default, _ in rows(text, ["flag", "default", "meaning"]):
        names = [span.split()[0] for span in codes(flag) if span.startswith("-")]
        documented[names[0]] = documented_default(default)
        doc_aliases[names[0]] = sorted(names)
    problems = _compare("flag", documented, actual)
    problems += [f"flag {name}: documented as {doc_aliases[name]}, the code's "
                 f"{aliases[name]}" for name in documented
                 if name in aliases and doc_aliases[name] != aliases[name]]
    return problems


def environment_problems(text: str) -> list[str]:
    import vllm.envs

    ours = set()
    for path in PACKAGE.rglob("*.py"):
        ours.update(re.findall(r"\bVLLM_OMNI_PLUGIN_[A-Z_]+\b", path.read_text()))
    documented = [codes(row[0])[0] for row in rows(text, ["variable", "meaning"])]
    problems = [f"variable {name}: read by the package, not documented"
                for name in sorted(ours - set(documented))]
    for name in documented:
        known = name in ours if name.startswith("VLLM_OMNI_PLUGIN_") else \
            name in vllm.envs.environment_variables
        if not known:
            problems.append(f"variable {name}: documented, read by neither the package "
                            "nor vLLM")
    return problems


def _schema_defaults() -> dict[str, str]:
    from vllm_omni_plugin.config import schema

    models = {"": schema.PipelineConfig, "stages[]": schema.StageConfig,
              "runtime": schema.RuntimeConfig, "pd": schema.PDConfig,
              "streaming": schema.StreamingConfig}
    actual = {}
    for prefix, model in models.items():
        for name, info in model.model_fields.items():
            if info.default is not PydanticUndefined:
                default = shown(info.default)
            elif info.default_factory is not None:
                made = info.default_factory()
                default = "[]" if isinstance(made, list) else "{}"
            else:
                default = "required"
            path = name if prefix in ("", "stages[]") else f"{prefix}.{name}"
            actual[path] = default
    return actual


def field_problems(text: str) -> list[str]:
    documented = {codes(field)[0]: documented_default(default)
                  for field, default, _ in rows(text, ["field", "default", "meaning"])}
    return _compare("field", documented, _schema_defaults())


def endpoint_problems(text: str) -> list[str]:
    from vllm_omni_plugin.entrypoints import middleware

    routes = {value for name, value in vars(middleware).items()
              if name.endswith("_PATH") and isinstance(value, str)}
    documented = {codes(path)[0] for _, path, _ in rows(text, ["method", "path", "what"])}
    return ([f"endpoint {p}: documented, not routed" for p in sorted(documented - routes)]
            + [f"endpoint {p}: routed, not documented" for p in sorted(routes - documented)])


def status_problems(text: str) -> list[str]:
    answered = set()
    pattern = re.compile(r"\bstatus\s*=\s*(\d{3})\b|send_json\(send, (\d{3})\b")
    for path in PACKAGE.rglob("*.py"):
        for match in pattern.finditer(path.read_text()):
            answered.add(int(match.group(1) or match.group(2)))
    answered.discard(200)
    documented = {int(re.match(r"\d{3}", status).group()) for status, _ in
                  rows(text, ["status", "when"])}
    return ([f"status {s}: documented, never answered" for s in sorted(documented - answered)]
            + [f"status {s}: answered, not documented" for s in sorted(answered - documented)])


def metric_problems(text: str) -> list[str]:
    from vllm_omni_plugin.engine.admission import AdmissionGate
    from vllm_omni_plugin.replicas.metrics import PoolCollector, RowCacheWatch

    row_cache = RowCacheWatch([(0, lambda: None)])  # as after its first read
    row_cache.stats = [{"blocks": 0, "max_blocks": 0, "bytes": 0, "hit_blocks": 0}]
    actual = {}
    for family in PoolCollector({}, AdmissionGate({}, 1.0), row_cache=row_cache).collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        actual[name] = family.type
    documented = {codes(metric)[0]: kind
                  for metric, kind, _ in rows(text, ["metric", "type", "meaning"])}
    return _compare("metric", documented, actual)


PAGES = {
    "serving/cli.md": (flag_problems, environment_problems),
    "serving/stage_configs.md": (field_problems,),
    "serving/openai_api.md": (endpoint_problems, status_problems),
    "features/replicas.md": (metric_problems,),
}


#: a docstring's word for a dtype
DTYPE = re.compile(r"float32|float16|bfloat16|int64|int32|uint8|bool|dtype|float\b|int\b|long")


def tensor_docstring_problems(root: Path = PACKAGE) -> list[str]:
    """Public functions of the package that take or return a ``torch.Tensor`` and whose
    docstring gives no shape (``[...]``, or "shape") or no dtype. ``load_weights``
    (vLLM's checkpoint iterator) is exempt."""
    import ast

    problems = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or \
                    node.name.startswith("_") or node.name == "load_weights":
                continue
            signature = ast.unparse(node.args) + (ast.unparse(node.returns)
                                                  if node.returns else "")
            doc = ast.get_docstring(node) or ""
            if "Tensor" in signature and not (("[" in doc or "shape" in doc)
                                              and DTYPE.search(doc)):
                problems.append(f"{path.relative_to(root.parent)}:{node.lineno} "
                                f"{node.name}: no shape or dtype in its docstring")
    return problems


def test_functions_on_tensors_give_shapes_and_dtypes():
    assert tensor_docstring_problems() == []


def test_the_reference_tables_match_the_code():
    problems = [f"docs/{page}: {problem}" for page, checks in PAGES.items()
                for check in checks for problem in check((DOCS / page).read_text())]
    assert problems == []


def test_a_planted_mismatch_is_reported_either_way():
    """A wrong default, a row for a flag that does not exist, a missing row, and the same
    for a YAML field, an endpoint, a status and a metric: each is reported."""
    cli = (DOCS / "serving/cli.md").read_text()
    planted = cli.replace("| `--omni-heartbeat-timeout SECONDS` | `30` |",
                          "| `--omni-heartbeat-timeout SECONDS` | `60` |")
    planted = re.sub(r"^\| `--omni-lb-policy`.*\n", "", planted, flags=re.M)
    planted = planted.replace("\n| `--replica-id` |",
                              "\n| `--omni-made-up` | `1` | no such flag |\n| `--replica-id` |")
    problems = flag_problems(planted)
    assert "flag --omni-heartbeat-timeout: documented default '60', the code's '30'" \
        in problems
    assert "flag --omni-lb-policy: in the code, not documented" in problems
    assert "flag --omni-made-up: documented, not in the code" in problems

    fields = (DOCS / "serving/stage_configs.md").read_text().replace(
        "| `runtime.max_restarts` | `5` |", "| `runtime.max_restart` | `5` |")
    assert set(field_problems(fields)) == {
        "field runtime.max_restart: documented, not in the code",
        "field runtime.max_restarts: in the code, not documented"}

    api = (DOCS / "serving/openai_api.md").read_text()
    api = api.replace("`/v1/audio/voices`", "`/v1/voices`").replace("| 504 |", "| 502 |")
    assert set(endpoint_problems(api) + status_problems(api)) == {
        "endpoint /v1/voices: documented, not routed",
        "endpoint /v1/audio/voices: routed, not documented",
        "status 502: documented, never answered", "status 504: answered, not documented"}

    metrics = re.sub(r"^\| `vllm_omni:replica_stalls_total`.*\n", "",
                     (DOCS / "features/replicas.md").read_text(), flags=re.M)
    assert metric_problems(metrics) == [
        "metric vllm_omni:replica_stalls_total: in the code, not documented"]
