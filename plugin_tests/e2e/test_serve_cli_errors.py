"""`vllm serve --stage-configs-path` with a bad pipeline fails before any
engine starts, with an error naming the file, stage and field; plain `vllm
serve` arguments parse exactly as without the plugin."""

from __future__ import annotations

import os
import subprocess

import pytest

from plugin_tests.conftest import PYTHON, QWEN3_OMNI_PD_YAML, QWEN3_OMNI_YAML, VLLM
from plugin_tests.helpers import run_process_group


def _serve(tmp_path, yaml_text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml_text)
    env = {**os.environ}
    return run_process_group([VLLM, "serve", str(tmp_path), "--stage-configs-path", str(path),
                              "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, timeout=240, env=env)


@pytest.mark.parametrize("yaml_text, expected", [
    ("stages:\n  - stage_id: 0\n    name: thinker\n   kind: ar\n",
     ["pipeline.yaml", "line 4", "malformed YAML"]),
    (open(QWEN3_OMNI_YAML).read().replace("input_processor: thinker2talker",
                                           "input_processor: thinker2talkr"),
     ["pipeline.yaml", "stage 1 ('talker')", "'input_processor'", "thinker2talkr",
      "available: "]),
], ids=["malformed-yaml", "unknown-processor"])
def test_bad_pipeline_fails_before_engines_start(tmp_path, yaml_text, expected):
    out = _serve(tmp_path, yaml_text)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    for fragment in expected:
        assert fragment in text, (fragment, text[-3000:])
    assert "EngineCore" not in text  # validated before any engine process started


def test_plain_serve_args_parse_as_without_plugin():
    """Same argv, plugin on vs off (VLLM_PLUGINS=none): identical namespaces
    apart from the plugin's own flags, all at their defaults."""
    code = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.cli.serve import ServeSubcommand
parser = FlexibleArgumentParser()
sub = parser.add_subparsers()
ServeSubcommand().subparser_init(sub)
ns = parser.parse_args(["serve", "some/model", "--max-model-len", "512", "--dtype", "float32"])
print(json.dumps({k: repr(v) for k, v in sorted(vars(ns).items()) if k != "dispatch_function"}))
"""
    results = []
    for plugins in (None, "none"):
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
        if plugins:
            env["VLLM_PLUGINS"] = plugins
        out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=240,
                             env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        results.append(__import__("json").loads(out.stdout.strip().splitlines()[-1]))
    with_plugin, without = results
    from vllm_omni_plugin.config.cli import FLAG_DEFAULTS

    assert with_plugin.pop("stage_configs_path") == "None"
    for name, default in FLAG_DEFAULTS.items():
        assert with_plugin.pop(name) == repr(default), name
    assert with_plugin == without


@pytest.mark.parametrize("flags, expected", [
    (["--headless", "--stage-id", "1"], "--headless --stage-id needs --omni-master-port"),
    (["--stage-configs-path", QWEN3_OMNI_PD_YAML, "--headless", "--stage-id", "0", "-omp",
      "9"], "--stage-id 0 is the entry stage, a decode stage (pd)"),
    (["--headless", "--stage-id", "7", "-omp", "9"], "--stage-id 7: the pipeline has no such"),
    (["--stage-id", "1"], "--stage-id 1: without --headless"),
    (["-ora", "10.0.0.2"], "--omni-replica-address applies to headless replicas"),
    (["--omni-dp-size-local", "2"], "--omni-dp-size-local applies to headless replicas"),
    (["--omni-heartbeat-timeout", "0"], "--omni-heartbeat-timeout must be positive"),
    (["--omni-lb-policy", "fastest"], "invalid choice: 'fastest'"),
    (["--omni-admission-timeout", "-1"], "--omni-admission-timeout must be >= 0"),
], ids=["headless-no-port", "headless-pd-entry", "headless-unknown-stage", "stage-id-on-head",
        "ora-on-head", "dp-size-on-head", "bad-timeout", "bad-policy", "bad-admission-timeout"])
def test_bad_omni_flags_fail_naming_the_flag(tmp_path, flags, expected):
    env = {**os.environ}
    out = subprocess.run([VLLM, "serve", str(tmp_path), "--stage-configs-path", QWEN3_OMNI_YAML,
                          *flags], capture_output=True, text=True, timeout=240, env=env)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert expected in text, text[-3000:]
    assert "EngineCore" not in text


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
