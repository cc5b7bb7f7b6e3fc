"""Stage input processor registry: real pluggy, real entry points on sys.path."""

from __future__ import annotations

import sys
import textwrap

import pluggy
import pytest

from vllm_omni_plugin.processors import (
    ENTRY_POINT_GROUP,
    StageInput,
    UnknownProcessorError,
    UpstreamOutput,
    available_processors,
    get_plugin_manager,
    get_processor,
    hookimpl,
    registry,
)

PLUGIN_SRC = """
from vllm_omni_plugin.processors import StageInput, hookimpl

def {proc}(upstream, stage, request_extras):
    return StageInput(prompt_token_ids=upstream[0].output_token_ids + [{tag}])

@hookimpl
def {hook}():
    return {{"{proc}": {proc}}}
"""


@pytest.fixture(autouse=True)
def fresh_manager():
    get_plugin_manager.cache_clear()
    yield
    get_plugin_manager.cache_clear()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Return ``add(module, proc, tag=0, hook=...)``: installs a dist with an entry point."""
    monkeypatch.syspath_prepend(str(tmp_path))
    modules: list[str] = []

    def add(module: str, proc: str, tag: int = 0,
            hook: str = "omni_register_stage_input_processors") -> None:
        (tmp_path / f"{module}.py").write_text(
            textwrap.dedent(PLUGIN_SRC.format(proc=proc, tag=tag, hook=hook)))
        info = tmp_path / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{module} = {module}\n")
        modules.append(module)

    yield add
    for m in modules:
        sys.modules.pop(m, None)


def test_entry_point_processor_is_found_and_callable(site):
    site("omni_test_procs_a", "my_proc", tag=7)
    proc = get_processor("my_proc")
    assert "my_proc" in available_processors()
    assert get_plugin_manager().get_plugin("omni_test_procs_a") is not None
    out = proc([UpstreamOutput(0, [1], [2, 3])], None, {})
    assert isinstance(out, StageInput)
    assert out.prompt_token_ids == [2, 3, 7]
    assert out.payload == {} and out.sampling_overrides == {}


def test_unknown_processor_lists_available(site):
    site("omni_test_procs_b", "my_proc")
    with pytest.raises(UnknownProcessorError) as ei:
        get_processor("my_prco")
    assert isinstance(ei.value, KeyError)
    assert ei.value.name == "my_prco" and "my_proc" in ei.value.available
    assert str(ei.value).startswith("unknown processor 'my_prco'; available: ")
    assert "my_proc" in str(ei.value)


def test_duplicate_name_names_both_plugins(site):
    site("omni_test_procs_c", "dup_proc")
    site("omni_test_procs_d", "dup_proc")
    with pytest.raises(ValueError, match="'dup_proc'") as ei:
        available_processors()
    assert "omni_test_procs_c" in str(ei.value) and "omni_test_procs_d" in str(ei.value)


def test_misspelled_hook_is_rejected(site):
    site("omni_test_procs_e", "p", hook="omni_register_stage_input_procesors")
    with pytest.raises(pluggy.PluginValidationError):
        get_plugin_manager()


def test_plugin_object_and_bad_return_type():
    class Good:
        @hookimpl
        def omni_register_stage_input_processors(self):
            return {"obj_proc": len}

    class Bad:
        @hookimpl
        def omni_register_stage_input_processors(self):
            return ["not", "a", "mapping"]

    pm = get_plugin_manager()
    pm.register(Good(), name="good")
    assert get_processor("obj_proc") is len
    pm.register(Bad(), name="bad")
    with pytest.raises(TypeError, match="'bad'"):
        available_processors()


def test_missing_builtin_is_skipped_but_broken_builtin_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "BUILTIN_MODULES", ("omni_test_no_such_module",))
    get_plugin_manager()  # no error
    get_plugin_manager.cache_clear()
    (tmp_path / "omni_test_broken.py").write_text("import omni_test_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "BUILTIN_MODULES", ("omni_test_broken",))
    with pytest.raises(ModuleNotFoundError, match="omni_test_missing_dependency"):
        get_plugin_manager()
