"""`vllm serve --stage-configs-path` with a bad pipeline or bad omni flags fails before
any engine starts, with an error naming the file, stage and field or the flag; plain
`vllm serve` arguments parse exactly as without the plugin.

One case of each kind runs as a real `vllm serve` process (:data:`OWN_PROCESS`); the
others run through vLLM's CLI entry point, as the `vllm` command calls it, one after
another in one child process (``in_process``), which also parses the plain arguments
with the plugin on. The deprecated ``--replica-id`` is checked in
``unit/test_register.py``."""

from __future__ import annotations

import pytest
import yaml

from plugin_tests.cli.children import Child, Output, run_command, run_steps
from plugin_tests.conftest import QWEN3_OMNI_PD_YAML, QWEN3_OMNI_YAML, VLLM

pytestmark = pytest.mark.cli

def _over_committed() -> str:
    """The shipped pipeline with a talker that takes most of the device: 0.9 of a GPU,
    and on vLLM's CPU build a KV cache larger than any host's memory."""
    pipeline = yaml.safe_load(open(QWEN3_OMNI_YAML))
    talker = pipeline["stages"][1]
    talker["engine_args"]["gpu_memory_utilization"] = 0.9
    talker["runtime"]["cpu_kv_cache_gib"] = 1 << 20
    return yaml.safe_dump(pipeline)


#: case -> (pipeline YAML, what the error names)
BAD_PIPELINES = {
    "over-committed": (_over_committed(),
                       ["pipeline.yaml", "field 'memory'", "is over-committed",
                        "stage 1 (talker)"]),
    "malformed-yaml": ("stages:\n  - stage_id: 0\n    name: thinker\n   kind: ar\n",
                       ["pipeline.yaml", "line 4", "malformed YAML"]),
    "unknown-processor": (open(QWEN3_OMNI_YAML).read().replace(
        "input_processor: thinker2talker", "input_processor: thinker2talkr"),
        ["pipeline.yaml", "stage 1 ('talker')", "'input_processor'", "thinker2talkr",
         "available: "]),
}

#: case -> (flags after `vllm serve MODEL --stage-configs-path QWEN3_OMNI_YAML --port 0`,
#: what the error says)
BAD_FLAGS = {
    "headless-no-port": (["--headless", "--stage-id", "1"],
                         "--headless --stage-id needs --omni-master-port"),
    "headless-pd-entry": (["--stage-configs-path", QWEN3_OMNI_PD_YAML, "--headless",
                           "--stage-id", "0", "-omp", "9"],
                          "--stage-id 0 is the entry stage, a decode stage (pd)"),
    "headless-unknown-stage": (["--headless", "--stage-id", "7", "-omp", "9"],
                               "--stage-id 7: the pipeline has no such"),
    "stage-id-on-head": (["--stage-id", "1"], "--stage-id 1: without --headless"),
    "ora-on-head": (["-ora", "10.0.0.2"], "--omni-replica-address applies to headless replicas"),
    "dp-size-on-head": (["--omni-dp-size-local", "2"],
                        "--omni-dp-size-local applies to headless replicas"),
    "bad-timeout": (["--omni-heartbeat-timeout", "0"], "--omni-heartbeat-timeout must be positive"),
    "bad-policy": (["--omni-lb-policy", "fastest"], "invalid choice: 'fastest'"),
    "network-master-without-token": (
        ["-oma", "192.0.2.7"], "--omni-master-address 192.0.2.7 is not a loopback address "
        "and no cluster token is set"),
    "bad-stall-timeout": (["--omni-stall-timeout", "-1"], "--omni-stall-timeout must be >= 0"),
    "bad-request-timeout": (["--omni-request-timeout", "0"],
                            "--omni-request-timeout must be positive"),
    "bad-admission-timeout": (["--omni-admission-timeout", "-1"],
                              "--omni-admission-timeout must be >= 0"),
    "unknown-pipeline": (["--stage-configs-path", "qwen3_omni"],
                         "'qwen3_omni' is neither a file nor a built-in pipeline (did you "
                         "mean 'qwen3_omni_moe'"),
    # the served model (the test's work directory) has no config.json
    "auto-without-model-type": (["--stage-configs-path", "auto"],
                                "has no config.json with a model_type; name a pipeline"),
}

#: The cases that run as a `vllm serve` process of their own: one through the head's
#: engine arguments, one through the headless seam.
OWN_PROCESS = ("malformed-yaml", "headless-no-port")

#: Parse a plain `vllm serve` command line with vLLM's serve parser; the namespace,
#: each value as its repr.
_PARSE = {"name": "parse", "code": """
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.cli.serve import ServeSubcommand
parser = FlexibleArgumentParser()
sub = parser.add_subparsers()
ServeSubcommand().subparser_init(sub)
ns = parser.parse_args(["serve", "some/model", "--max-model-len", "512", "--dtype", "float32"])
result = {k: repr(v) for k, v in sorted(vars(ns).items()) if k != "dispatch_function"}
"""}


def _pipeline_argv(case: str, workdir) -> list[str]:
    """`serve` with the case's pipeline: ``workdir/CASE/pipeline.yaml``, ``--port 0``."""
    path = workdir / case / "pipeline.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(BAD_PIPELINES[case][0])
    return ["serve", str(path.parent), "--stage-configs-path", str(path), "--port", "0"]


def _flags_argv(case: str, workdir) -> list[str]:
    """`serve` with the case's flags; ``--port 0``: vLLM binds the API server's port
    before it reads the engine arguments, and keeps it after they failed."""
    return ["serve", str(workdir), "--stage-configs-path", QWEN3_OMNI_YAML, "--port", "0",
            *BAD_FLAGS[case][0]]


_ARGV = {"pipeline": _pipeline_argv, "flags": _flags_argv}


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> Child:
    """One child: the plain arguments parsed, then every bad case not in
    :data:`OWN_PROCESS` through vLLM's CLI entry point (steps ``pipeline-CASE`` and
    ``flags-CASE``)."""
    workdir = tmp_path_factory.mktemp("serve-cases")
    steps = [_PARSE]
    for kind, cases in (("pipeline", BAD_PIPELINES), ("flags", BAD_FLAGS)):
        steps += [{"name": f"{kind}-{case}", "vllm": _ARGV[kind](case, workdir)}
                  for case in cases if case not in OWN_PROCESS]
    return run_steps(steps, tmp_path_factory.mktemp("serve-in-process"))


def _serve_output(request, tmp_path, kind: str, case: str) -> Output:
    """The output of case ``case`` of ``kind`` (``pipeline`` or ``flags``): its own
    `vllm serve` process, or its step in ``in_process``."""
    if case in OWN_PROCESS:
        return run_command([VLLM, *_ARGV[kind](case, tmp_path)], tmp_path, "serve")
    return request.getfixturevalue("in_process").steps[f"{kind}-{case}"]


@pytest.mark.parametrize("case", list(BAD_PIPELINES))
def test_bad_pipeline_fails_before_engines_start(request, tmp_path, case):
    out = _serve_output(request, tmp_path, "pipeline", case)
    text = out.text
    assert out.rc != 0
    for fragment in BAD_PIPELINES[case][1]:
        assert fragment in text, (fragment, text[-3000:])
    assert "EngineCore" not in text  # validated before any engine process started


def test_plain_serve_args_parse_as_without_plugin(in_process, tmp_path):
    """Same argv, plugin on vs off (VLLM_PLUGINS=none): identical namespaces
    apart from the plugin's own flags, all at their defaults."""
    plugin_off = run_steps([_PARSE], tmp_path / "plugins-none",
                           env_extra={"VLLM_PLUGINS": "none"})
    results = []
    for out in (in_process.steps["parse"], plugin_off.steps["parse"]):
        assert out.rc == 0, out.stderr[-3000:]
        results.append(out.result)
    with_plugin, without = results
    from vllm_omni_plugin.config.cli import FLAG_DEFAULTS

    assert with_plugin.pop("stage_configs_path") == "None"
    for name, default in FLAG_DEFAULTS.items():
        assert with_plugin.pop(name) == repr(default), name
    assert with_plugin == without


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_omni_flags_fail_naming_the_flag(request, tmp_path, case):
    out = _serve_output(request, tmp_path, "flags", case)
    text = out.text
    assert out.rc != 0
    assert BAD_FLAGS[case][1] in text, text[-3000:]
    assert "EngineCore" not in text
