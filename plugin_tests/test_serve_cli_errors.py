"""`vllm serve --stage-configs-path` with a bad pipeline fails before any
engine starts, with an error naming the file, stage and field; plain `vllm
serve` arguments parse exactly as without the plugin."""

from __future__ import annotations

import os
import subprocess

import pytest

from plugin_tests.conftest import PYTHON, QWEN3_OMNI_YAML, VLLM


def _serve(tmp_path, yaml_text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml_text)
    env = {**os.environ, "VLLM_OMNI_PLUGIN_BACKEND": "reference"}
    return subprocess.run([VLLM, "serve", str(tmp_path), "--stage-configs-path", str(path),
                           "--port", "0"], capture_output=True, text=True, timeout=240, env=env)


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
    apart from the plugin's own (unset) flag."""
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
    assert with_plugin.pop("stage_configs_path") == "None"
    assert with_plugin == without
