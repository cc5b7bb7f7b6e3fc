"""register() in this process: idempotent, patches applied once, stage models
registered, the declared entry points installed; the omni flags' hand-off to the
engine arguments without omni mode, with a bad YAML, with a deprecated flag.

vLLM loading the plugin itself (its loader, its CLI, VLLM_PLUGINS, an out-of-range
vLLM) is checked in child processes by ``cli/test_plugin_registration.py``."""

from __future__ import annotations

import pytest


def test_register_is_idempotent_and_patches_once():
    import vllm.entrypoints.cli.serve as serve  # imported by vLLM's CLI before plugins
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_omni_plugin
    from vllm_omni_plugin.compat import MARKER, apply_all

    vllm_omni_plugin.register()
    # The headless seam applies only once vLLM's CLI module is loaded; if an
    # earlier test registered before that, apply it now, as the CLI would.
    apply_all()
    first = (EngineArgs.add_cli_args, AsyncLLM.from_vllm_config, serve.run_headless)
    vllm_omni_plugin.register()
    assert apply_all() == []  # already applied: nothing applied twice
    assert (EngineArgs.add_cli_args, AsyncLLM.from_vllm_config, serve.run_headless) == first
    assert all(getattr(f, MARKER) for f in first)


def test_stage_models_registered_lazily():
    from vllm import ModelRegistry

    import vllm_omni_plugin
    from vllm_omni_plugin.models import STAGE_MODELS

    vllm_omni_plugin.register()
    supported = ModelRegistry.get_supported_archs()
    for arch in STAGE_MODELS:
        assert arch in supported
    # upstream's own Qwen3-Omni registration is untouched
    assert "Qwen3OmniMoeForConditionalGeneration" in supported


def test_installed_entry_points_are_the_declared_ones():
    """The environment vLLM runs in carries this checkout's entry points (setup.cfg)."""
    import configparser
    from importlib.metadata import entry_points

    from plugin_tests.conftest import REPO

    cfg = configparser.ConfigParser()
    cfg.read(f"{REPO}/setup.cfg")
    assert "vllm.platform_plugins" not in cfg["options.entry_points"]  # vLLM's own platforms
    for group in ("vllm.general_plugins",):
        declared = dict(line.split("=", 1) for line in
                        cfg["options.entry_points"][group].strip().splitlines())
        declared = {k.strip(): v.strip() for k, v in declared.items()}
        installed = {ep.name: ep for ep in entry_points(group=group) if ep.name == "omni"}
        assert declared == {name: ep.value for name, ep in installed.items()}, group
        assert installed["omni"].dist.metadata["Name"] == "vllm-omni-plugin"


def test_plain_engine_client_without_omni_flags():
    """Without --stage-configs-path the engine args carry no omni settings and
    from_vllm_config keeps vLLM's class."""
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs

    import vllm_omni_plugin
    from vllm_omni_plugin.config.settings import ADDITIONAL_CONFIG_KEY

    vllm_omni_plugin.register()
    ns = argparse.Namespace(model="m", stage_configs_path=None)
    args = AsyncEngineArgs.from_cli_args(ns)
    assert ADDITIONAL_CONFIG_KEY not in (args.additional_config or {})


def test_bad_yaml_fails_before_engines(tmp_path):
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs

    import vllm_omni_plugin
    from vllm_omni_plugin.config import StageConfigError

    vllm_omni_plugin.register()
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [\n  - stage_id: 0\n   name: x\n")
    with pytest.raises(StageConfigError, match="bad.yaml"):
        AsyncEngineArgs.from_cli_args(argparse.Namespace(model="m", stage_configs_path=str(bad)))


def test_deprecated_replica_id_warns_and_is_ignored():
    import argparse
    import logging

    from vllm_omni_plugin.config.cli import logger, validate_omni_args

    ns = argparse.Namespace(replica_id=3)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        validate_omni_args(ns)
    finally:
        logger.removeHandler(handler)
    assert any("--replica-id is deprecated and ignored" in r.getMessage() for r in records)
    assert ns.omni_dp_size_local == 1  # defaults filled in, nothing derived from the id
