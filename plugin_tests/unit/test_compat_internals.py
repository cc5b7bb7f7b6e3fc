"""Canaries of the vLLM internals the plugin reads (``compat/internals.py``).

Each entry of :data:`~vllm_omni_plugin.compat.internals.INTERNALS` is checked against the
installed vLLM's source, parsed without importing it (so every release row runs them, the
0.33 CUDA-wheel row without engines too): an instance attribute must still be assigned in
a method of its class, a field still declared, a method still defined with the same
parameters (and an overridden one still overridden with them), the source a behaviour
relies on still there. A failure means vLLM moved the thing: update its accessor and
entry. Also checked: every accessor names the releases it was read from, and no module
outside ``compat/`` reads one of the indexed internals itself. What needs a running
EngineCore (``is_sleeping`` goes unanswered while it is stopped; ``engine_processes``
gives its real pid) is checked on the CPU rows in ``plugin_tests/engine/
test_pipeline_engine.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_omni_plugin.compat import internals
from vllm_omni_plugin.compat.internals import (
    ATTRIBUTE,
    FIELD,
    FUNCTION,
    INTERNALS,
    METHOD,
    OVERRIDE,
    RELEASES,
    SOURCE,
    Internal,
)
from vllm_omni_plugin.compat.version import vllm_version

PACKAGE = Path(internals.__file__).resolve().parents[1]


def _release() -> str:
    return ".".join(vllm_version().split("+")[0].split(".")[:2])


def _root(top: str) -> Path:
    """The directory of top-level package ``top`` (found, not imported)."""
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.submodule_search_locations, top
    return Path(next(iter(spec.submodule_search_locations)))


def _module_file(module: str) -> Path:
    top, *rest = module.split(".")
    base = _root(top).joinpath(*rest)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise AssertionError(f"no module {module} in the installed {top}")


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_module_file(module).read_text())


def _body_def(body: list[ast.stmt], name: str):
    """The class or function ``name`` defined in ``body`` (also under module-level
    ``if``/``try``), or None."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name == name:
            return node
        if isinstance(node, (ast.If, ast.Try)):
            nested = [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                      *(s for h in getattr(node, "handlers", []) for s in h.body)]
            found = _body_def(nested, name)
            if found is not None:
                return found
    return None


def _resolve(path: str):
    """``(module, node)``: the class, function or method that ``module:Qual.name`` names."""
    module, _, qualname = path.partition(":")
    node = _tree(module)
    for part in qualname.split("."):
        found = _body_def(node.body, part)
        assert found is not None, f"{module} defines no {qualname} ({part} not found)"
        node = found
    return module, node


def _params(fn) -> list[str]:
    args = fn.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]


def _self_assigned(cls: ast.ClassDef) -> set[str]:
    """Names assigned as ``self.NAME`` (plain, annotated, augmented or tuple targets) in
    any method of ``cls``."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id == "self":
                names.add(target.attr)
    return names


def _declared(cls: ast.ClassDef) -> set[str]:
    """Class-level annotated names (dataclass and msgspec fields, ``TypedDict`` keys)."""
    return {n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _module_binds(body: list[ast.stmt], name: str) -> bool:
    """Whether module-level code (also under ``if``/``try``) binds ``name``."""
    for node in body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
        elif isinstance(node, (ast.If, ast.Try)):
            nested = [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                      *(s for h in getattr(node, "handlers", []) for s in h.body)]
            if _module_binds(nested, name):
                return True
    return False


def check(entry: Internal) -> None:
    """Assert that ``entry`` is where the installed vLLM keeps it (see the module doc)."""
    if entry.kind == SOURCE and ":" not in entry.path:
        root = _module_file(entry.path).parent
        text = "\n".join(p.read_text() for p in sorted(root.rglob("*.py")))
        for needle in entry.detail:
            assert needle in text, f"no module of {entry.path} has {needle!r}"
        return
    module, qualname = entry.path.split(":")
    owner_path, _, name = qualname.rpartition(".")
    if entry.kind in (ATTRIBUTE, FIELD):
        _, cls = _resolve(f"{module}:{owner_path}")
        found = _self_assigned(cls) if entry.kind == ATTRIBUTE else _declared(cls)
        assert name in found, f"{entry.path}: {cls.name} no longer has {entry.kind} {name}"
        return
    if entry.kind == FUNCTION and _body_def(_tree(module).body, qualname) is None:
        assert entry.detail is None, f"{entry.path} is no longer a function"
        assert _module_binds(_tree(module).body, qualname), f"{module} has no {qualname}"
        return
    _, node = _resolve(entry.path)
    if entry.kind == SOURCE:
        text = ast.unparse(node)
        for needle in entry.detail:
            assert needle in text, f"{entry.path} no longer has {needle!r}"
        return
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), entry.path
    if entry.detail is not None:
        assert _params(node) == list(entry.detail), (entry.path, _params(node))
    if entry.kind == OVERRIDE:
        _, ours = _resolve(entry.owner)
        assert isinstance(ours, type(node)), f"{entry.owner}: async-ness differs from vLLM's"
        assert _params(ours) == _params(node), (entry.owner, _params(ours), _params(node))


# -- the canaries -------------------------------------------------------------------------
def _entry_id(entry: Internal) -> str:
    module, _, qualname = entry.path.partition(":")
    return f"{module.rpartition('.')[2]}:{qualname}" if qualname else module


@pytest.mark.parametrize("entry", INTERNALS, ids=_entry_id)
def test_internal_is_where_vllm_keeps_it(entry):
    if _release() not in entry.releases:
        pytest.skip(f"read from vLLM {', '.join(entry.releases)}, not {_release()}")
    check(entry)


def test_every_entry_is_well_formed_and_owned():
    """Kinds known, releases within the supported range, and each owner exists: an
    accessor of ``compat/internals.py`` that names the vLLM releases in its docstring, or
    the plugin's ``module:Qual.name`` / ``module.function``."""
    kinds = {ATTRIBUTE, FIELD, METHOD, OVERRIDE, FUNCTION, SOURCE}
    for entry in INTERNALS:
        assert entry.kind in kinds, entry
        assert set(entry.releases) <= set(RELEASES), entry
        if entry.kind == SOURCE:
            assert entry.detail, entry
        prefix = f"{internals.__name__}."
        if entry.owner.startswith(prefix):
            accessor = getattr(internals, entry.owner.removeprefix(prefix))
            doc = inspect.getdoc(accessor) or ""
            assert f"vLLM {RELEASES[0]}-{RELEASES[-1]}" in doc or \
                f"{RELEASES[0]}-{RELEASES[-1]}" in doc, f"{entry.owner} names no releases"
        elif ":" in entry.owner:
            _resolve(entry.owner)
        else:
            module, _, function = entry.owner.rpartition(".")
            assert _body_def(_tree(module).body, function) is not None, entry.owner
    assert len({tuple(e[:3]) for e in INTERNALS}) == len(INTERNALS), "duplicate entries"


def test_every_accessor_is_indexed():
    """Each public function of ``compat/internals.py`` reads something in INTERNALS."""
    owners = {e.owner for e in INTERNALS}
    for name, value in vars(internals).items():
        if inspect.isfunction(value) and value.__module__ == internals.__name__ \
                and not name.startswith("_"):
            assert f"{internals.__name__}.{name}" in owners, name


def test_a_moved_internal_fails_its_canary():
    """The checks see a change: a renamed attribute, field, parameter or source text."""
    moved = [
        Internal("x", "vllm.v1.engine.async_llm:AsyncLLM.engine_cores", ATTRIBUTE),
        Internal("x", "vllm.v1.engine.core_client:BackgroundResources.engine_managers", FIELD),
        Internal("x", "vllm.v1.engine.core:EngineCore.is_sleeping", METHOD, ("self", "x")),
        Internal("x", "vllm.v1.engine.async_llm:AsyncLLM.is_sleeping", SOURCE,
                 ("self.engine_core.is_sleeping()",)),
        Internal("x", "vllm.entrypoints", SOURCE, ("state.vllm_configuration = ",)),
        Internal("x", "vllm.envs:no_such_function", FUNCTION),
        Internal("vllm_omni_plugin.kv_transfer.mooncake:OmniMooncakeConnectorWorker._send_blocks",
                 "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector:"
                 "MooncakeConnectorWorker.record_send_reqs", OVERRIDE, ("self", "metadata")),
    ]
    for entry in moved:
        with pytest.raises(AssertionError):
            check(entry)


# -- liveness without an engine (the engine rows check it on a running EngineCore) --------
def test_is_sleeping_is_a_utility_call_the_engine_core_answers():
    """``AsyncLLM.is_sleeping`` (the stall watch's probe) asks the EngineCore process:
    the client's ``is_sleeping_async`` is a utility call, which the EngineCore's busy loop
    answers between steps; ``liveness_probe`` is that call. Read from the imported
    classes (the entries above read the files)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.engine.core_client import AsyncMPClient

    assert "self.engine_core.is_sleeping_async()" in inspect.getsource(AsyncLLM.is_sleeping)
    client = inspect.getsource(AsyncMPClient.is_sleeping_async)
    assert "call_utility" in client and '"is_sleeping"' in client, client
    assert "EngineCoreRequestType.UTILITY" in inspect.getsource(
        EngineCoreProc._handle_client_request)

    class Engine:
        async def is_sleeping(self):
            return "answered"

    import asyncio

    assert asyncio.run(internals.liveness_probe(Engine())) == "answered"


def test_engine_processes_of_an_engine_without_them_is_none():
    """An engine whose EngineCore runs in this process (``InprocClient``: no
    ``resources``) or a client without processes: None, so that the supervisor polls."""
    from vllm.v1.engine.core_client import InprocClient

    assert internals.engine_processes(SimpleNamespace()) is None
    inproc = SimpleNamespace(engine_core=object.__new__(InprocClient))
    assert internals.engine_processes(inproc) is None


# -- accessors on real vLLM objects (no engine) ---------------------------------------------
def test_sampling_param_fields_are_sampling_params_own():
    from vllm import SamplingParams

    fields = internals.sampling_param_fields()
    assert {"max_tokens", "temperature", "extra_args", "stop_token_ids"} <= set(fields)
    params = SamplingParams(max_tokens=3)
    assert all(hasattr(params, name) for name in fields)


def _engine_core_request(**values):
    """vLLM's own ``EngineCoreRequest``, built by keyword from its declared fields (None for
    the required ones not in ``values``)."""
    import msgspec
    from vllm.v1.engine import EngineCoreRequest

    fields = EngineCoreRequest.__struct_fields__
    required = {f: None for f, d in zip(fields, msgspec.structs.fields(EngineCoreRequest),
                                         strict=True) if d.required}
    return EngineCoreRequest(**{**required, "request_id": "r", "arrival_time": 0.0, **values})


def test_prompt_token_ids_of_engine_core_requests_and_engine_inputs():
    """Token ids of the shapes vLLM's API server hands ``generate``: vLLM's own
    ``EngineCoreRequest`` and engine inputs; None with multimodal features or embeddings."""
    import torch
    from vllm.inputs.engine import tokens_input

    request = _engine_core_request
    assert internals.prompt_token_ids_of(request(prompt_token_ids=[1, 2])) == [1, 2]
    assert internals.prompt_token_ids_of(request(prompt_token_ids=[1], mm_features=[1])) is None
    assert internals.prompt_token_ids_of(
        request(prompt_token_ids=[1], prompt_embeds=torch.zeros(1, 2))) is None
    assert internals.prompt_token_ids_of(tokens_input([5, 6])) == [5, 6]
    assert internals.prompt_token_ids_of({"type": "embeds", "prompt_embeds": 1}) is None
    assert internals.prompt_token_ids_of({"prompt_token_ids": [3]}) == [3]
    assert internals.prompt_token_ids_of({"prompt_token_ids": [3],
                                          "multi_modal_data": {"image": 1}}) is None


def test_cache_salt_of_engine_core_requests_and_engine_inputs():
    """The client's ``cache_salt`` where vLLM's API server keeps it: an ``EngineCoreRequest``
    (the prefill stage of PD must cache under it), engine inputs and prompt mappings."""
    from vllm.inputs.engine import tokens_input

    request = _engine_core_request(prompt_token_ids=[1], cache_salt="tenant-a")
    assert internals.cache_salt_of(request) == "tenant-a"
    assert internals.cache_salt_of(tokens_input([5], cache_salt="tenant-b")) == "tenant-b"
    assert internals.cache_salt_of(tokens_input([5])) is None
    assert internals.cache_salt_of({"prompt": "hi", "cache_salt": "c"}) == "c"


# -- nothing outside compat/ reads them itself ----------------------------------------------
#: Attribute names of INTERNALS specific enough to mean vLLM's object wherever read (the
#: generic ones, e.g. ``layers`` or ``processes``, name the plugin's own objects too), and
#: vLLM internals read through a public method instead (``AsyncLLM.output_processor``:
#: ``get_num_unfinished_requests()``).
GUARDED = {"engine_core", "resources", "engine_manager", "output_processor", "mm_features",
           "__struct_fields__", "hf_text_config", "model_runner", "language_model",
           "_get_2d_sincos_pos_embed", "_pending_bootstrap_queries", "_remote_agents",
           "reqs_need_send", "_handle_failed_recv", "TransferEngine",
           "should_launch_bootstrap_server", "get_mooncake_bootstrap_addr"}
#: What may still name them outside compat/: (module, name) -> why.
ALLOWED = {
    # ModelConfig.hf_text_config is read as public config (vLLM's models read it too);
    # only writing it is internal (compat.internals.text_model_config)
    ("vllm_omni_plugin.tools.plan", "hf_text_config"): "read",
}


def _reads(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """``(name, line, stored)`` of every attribute access and every ``getattr``/``hasattr``/
    ``setattr`` with a constant name in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.append((node.attr, node.lineno, isinstance(node.ctx, ast.Store)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            found.append((node.args[1].value, node.lineno, node.func.id == "setattr"))
    return found


def test_no_module_outside_compat_reads_an_indexed_internal():
    names = {e.path.rpartition(".")[2].rpartition(":")[2] for e in INTERNALS}
    assert GUARDED - {"output_processor", "__struct_fields__"} <= names  # indexed names
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if module.startswith("vllm_omni_plugin.compat"):
            continue
        for name, line, stored in _reads(ast.parse(path.read_text())):
            allowed = ALLOWED.get((module, name))
            if name in GUARDED and not (allowed == "read" and not stored):
                problems.append(f"{rel}:{line} reads {name}: use compat/internals.py")
    assert not problems, "\n".join(problems)


def test_the_contributing_page_names_every_accessor():
    """``docs/contributing/compat.md``'s table of the internals names each accessor of
    ``compat/internals.py``, and nothing else."""
    page = PACKAGE.parent / "docs" / "contributing" / "compat.md"
    text = page.read_text().split("## The internals", 1)[1]
    header = "| accessor | vLLM path | releases |"
    assert header in text, f"{page}: no table {header!r}"
    documented = set()
    for line in text.split(header, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        documented |= set(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    accessors = {e.owner.removeprefix(f"{internals.__name__}.") for e in INTERNALS
                 if e.owner.startswith(f"{internals.__name__}.")}
    assert documented == accessors, (documented ^ accessors)
