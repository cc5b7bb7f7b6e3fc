"""Every compat patch accepts every call vLLM makes to what it patches.

``functools.wraps`` makes ``inspect.signature`` report the original's parameters, so a
wrapper that drops one (``compute_hash(self)`` over vLLM's
``compute_hash(self, include_version=True)``) looks right until vLLM calls it with that
keyword. These tests read past ``functools.wraps`` (``follow_wrapped=False``) and check,
on the installed vLLM (every release row of CI runs them):

* that every way of calling the original (each split of its parameters between
  positions and keywords) binds to the patched function too;
* that every call vLLM's own source makes to the patched name (its positional count and
  keyword names, found by parsing vLLM's package) binds to the patched function wherever it
  binds to the original (a call to another class's method of the same name binds to
  neither, or to both);
* and they call the cheap targets for real the way vLLM does, in omni and in plain mode.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from functools import cache
from pathlib import Path

import pytest

from vllm_omni_plugin.compat import MARKER, PATCH_MODULES


def _declared_targets() -> list[tuple[str, str]]:
    """``(patch module short name, target)`` for every ``TARGETS`` entry."""
    return [(name.rsplit(".", 1)[1], target) for name in PATCH_MODULES
            for target in importlib.import_module(name).TARGETS]


TARGETS = _declared_targets()


@pytest.fixture(scope="module", autouse=True)
def _registered():
    """The plugin registered as vLLM's CLI has it: the CLI imports its serve module before
    it loads plugins, so ``serve_headless`` finds its target."""
    import vllm.entrypoints.cli.serve  # noqa: F401

    import vllm_omni_plugin
    from vllm_omni_plugin.compat import apply_all

    vllm_omni_plugin.register()
    apply_all()  # register() is once per process: the serve module may be newer than it


def _resolve(target: str):
    """``(function, bound)``: the plain function now installed at ``target`` (a class or
    static method's ``__func__``), and whether callers pass its first parameter implicitly
    (a method or class method called on an instance or class)."""
    module_name, _, path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for attr in parents:
        owner = getattr(owner, attr)
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, staticmethod):
        return raw.__func__, False
    if isinstance(raw, classmethod):
        return raw.__func__, True
    return raw, inspect.isclass(owner)


def _every_way_to_call(signature: inspect.Signature) -> list[tuple[int, tuple[str, ...]]]:
    """Each ``(positional count, keyword names)`` a caller can pass all of ``signature``'s
    named parameters with: the first k positionally, the rest by name, for every k; and
    each with only the required ones."""
    params = [p for p in signature.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    only = sum(p.kind is p.POSITIONAL_ONLY for p in params)
    calls = []
    for subset in (params, [p for p in params if p.default is p.empty]):
        names = [p.name for p in subset]
        for k in range(only, len([p for p in positional if p in subset]) + 1):
            calls.append((k, tuple(names[k:])))
    return calls


def _binds(signature: inspect.Signature, positional: int, keywords) -> bool:
    try:
        signature.bind(*range(positional), **dict.fromkeys(keywords))
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("patch,target", TARGETS, ids=[t for _, t in TARGETS])
def test_the_patched_target_accepts_every_call_the_original_accepts(patch, target):
    patched, _ = _resolve(target)
    original = inspect.unwrap(patched)
    if not getattr(patched, MARKER, False):  # not needed on this vLLM (feature detection)
        assert original is patched, f"{target}: wrapped, but not by {patch}"
        return
    assert original is not patched, f"{target}: the wrapper does not keep __wrapped__"
    wrapper_sig = inspect.signature(patched, follow_wrapped=False)
    original_sig = inspect.signature(original)
    refused = [(k, kws) for k, kws in _every_way_to_call(original_sig)
               if not _binds(wrapper_sig, k, kws)]
    assert not refused, (f"{target}: vLLM's {original_sig} accepts calls that the patch's "
                         f"{wrapper_sig} refuses (positional count, keywords): {refused}")


# -- how vLLM's own source calls each patched name --------------------------------------
def _vllm_files() -> list[Path]:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    return sorted(root.rglob("*.py"))


@cache
def _call_sites(name: str) -> tuple[tuple[str, int, int, tuple[str, ...]], ...]:
    """Every call of ``name`` (``x.name(...)`` or ``name(...)``) in vLLM's package:
    ``(file, line, positional count, keyword names)``; calls with ``*args`` or
    ``**kwargs`` are left out (any signature that takes both binds them)."""
    sites = []
    needle = f"{name}("
    for path in _vllm_files():
        text = path.read_text(errors="replace")
        if needle not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else None
            if called != name or any(isinstance(a, ast.Starred) for a in node.args) \
                    or any(k.arg is None for k in node.keywords):
                continue
            sites.append((str(path), node.lineno, len(node.args),
                          tuple(k.arg for k in node.keywords)))
    return tuple(sites)


@pytest.mark.parametrize("patch,target", TARGETS, ids=[t for _, t in TARGETS])
def test_every_call_in_vllms_source_reaches_the_patched_target(patch, target):
    """The call sites of the target's name in vLLM's source that bind to vLLM's own
    signature bind to the patch's too; at least one of them exists (else the patch wraps
    something vLLM no longer calls)."""
    patched, bound = _resolve(target)
    original = inspect.unwrap(patched)
    wrapper_sig = inspect.signature(patched, follow_wrapped=False)
    original_sig = inspect.signature(original)
    implicit = 1 if bound else 0
    reached = [site for site in _call_sites(target.partition(":")[2].rsplit(".", 1)[-1])
               if _binds(original_sig, site[2] + implicit, site[3])]
    assert reached, f"{target}: vLLM's source never calls it"
    refused = [f"{file}:{line} ({n} positional, keywords {kws})"
               for file, line, n, kws in reached
               if not _binds(wrapper_sig, n + implicit, kws)]
    assert not refused, f"{target}: vLLM calls it in ways the patch refuses: {refused}"


# -- the cheap targets called for real ------------------------------------------------
def _config(omni: bool):
    from vllm.config import VllmConfig

    from vllm_omni_plugin.config.settings import OmniSettings

    extra = {"user_key": 1}
    if omni:
        extra = OmniSettings(stage_configs_path="/p.yaml").additional_config(extra)
    return VllmConfig(additional_config=extra)


@pytest.mark.parametrize("include_version", [True, False])
@pytest.mark.parametrize("omni", [True, False], ids=["omni", "plain"])
def test_compute_hash_as_vllms_flashinfer_warmup_calls_it(omni, include_version):
    """``vllm_config.compute_hash(include_version=False)`` (vLLM's FlashInfer autotune
    warm-up, 0.30-0.33) works; in plain mode the patch returns exactly vLLM's hash, in omni
    mode vLLM's hash of the config without the plugin's settings."""
    from vllm.config import VllmConfig

    original = inspect.unwrap(VllmConfig.compute_hash)
    config = _config(omni)
    got = config.compute_hash(include_version=include_version)
    assert got == original(_config(False), include_version=include_version)
    assert (got == original(config, include_version=include_version)) is not omni


def test_serve_args_as_vllms_cli_calls_them():
    """``EngineArgs.add_cli_args(parser)`` and ``AsyncEngineArgs.from_cli_args(args)`` as
    ``vllm serve`` calls them: without ``--stage-configs-path`` the parsed engine arguments
    equal those of vLLM's own methods."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(add):
        parser = add(FlexibleArgumentParser())
        return parser.parse_args(["--model", "m", "--max-model-len", "64"])

    plain = parse(inspect.unwrap(EngineArgs.__dict__["add_cli_args"].__func__))
    patched = parse(AsyncEngineArgs.add_cli_args)
    assert hasattr(patched, "stage_configs_path") and not hasattr(plain, "stage_configs_path")
    original_from = inspect.unwrap(EngineArgs.__dict__["from_cli_args"].__func__)
    assert AsyncEngineArgs.from_cli_args(patched) == original_from(AsyncEngineArgs, plain)
