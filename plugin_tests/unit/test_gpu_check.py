"""``scripts/gpu_check.sh`` and ``plugin_tests/gpu_check.py`` without an engine: the
verdict on the modes the stages report, on answers and on skipped cases; the driver check
before anything is installed; ``scripts/setup_env.sh`` without the prefill/decode
prerequisites. The engines' dry run is ``plugin_tests/engine/test_gpu_check.py``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from plugin_tests import gpu_check
from plugin_tests.conftest import REPO
from plugin_tests.gpu_check import EXPECTED_MODES, case_status, exit_status, mode_problems
from vllm_omni_plugin.config.pipelines import builtin_pipeline

V2 = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
V1 = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
CPU = "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
#: the shipped Qwen3-Omni pipeline: the talker and code2wav eager
EAGER = {0: False, 1: True, 2: True}


def _settings(runner=V2, async_scheduling=True, thinker_graphs="FULL_AND_PIECEWISE",
              **stage0) -> dict:
    """Three stages' settings as the engine script reports them (JSON: string keys)."""
    def stage(graphs):
        return {"model_runner": [runner], "cudagraph_mode": f"CUDAGraphMode.{graphs}",
                "async_scheduling": async_scheduling, "tensor_parallel_size": 1,
                "dtype": "bfloat16"}
    settings = {"0": stage(thinker_graphs), "1": stage("NONE"), "2": stage("NONE")}
    settings["0"].update(stage0)
    return settings


def _result(settings, answers=12, agreed=12) -> dict:
    return {"settings": settings, "eager": {str(k): v for k, v in EAGER.items()},
            "answers": answers, "agreed": agreed, "choices": 100, "exact": 100,
            "worst": {}, "waveform_err": 0.0, "problems": []}


GPU, CPU_BUILD = EXPECTED_MODES["gpu"], EXPECTED_MODES["cpu"]


def test_the_gpu_defaults_pass_the_gpu_expectation():
    assert mode_problems(_settings(), GPU, EAGER) == []
    assert case_status(_result(_settings()), GPU) == ("ok", [])


@pytest.mark.parametrize("settings,named", [
    (_settings(runner=V1), "V1 model runner, not V2"),  # VLLM_USE_V2_MODEL_RUNNER=0
    (_settings(async_scheduling=False), "async scheduling off, not on"),  # --no-async-scheduling
    (_settings(thinker_graphs="PIECEWISE"), "stage 0 has CUDA graphs PIECEWISE"),
    (_settings(thinker_graphs="NONE"), "stage 0 has CUDA graphs NONE"),  # enforce_eager
])
def test_a_forced_v1_runner_sync_scheduling_or_other_graphs_fail_the_gpu_check(settings,
                                                                               named):
    """Before: the modes were printed only; a case with every answer agreeing passed
    whatever the runner, graphs or scheduling."""
    status, problems = case_status(_result(settings), GPU)
    assert status == "FAILED"
    assert any(named in p for p in problems), problems
    assert exit_status({"bf16": _result(settings)}, GPU) == 1


def test_an_eager_stage_must_have_no_graphs():
    settings = _settings()
    settings["1"]["cudagraph_mode"] = "CUDAGraphMode.FULL_AND_PIECEWISE"
    assert mode_problems(settings, GPU, EAGER) == [
        "stage 1 has CUDA graphs FULL_AND_PIECEWISE, not NONE (eager in the YAML)"]


def test_the_cpu_build_modes_are_the_cpu_expectation_and_fail_the_gpu_one():
    """What vLLM's CPU build reports (its V1 CPUModelRunner, sync, no graphs) is what
    ``--cpu`` requires, and fails ``--expect-modes gpu``."""
    cpu = _settings(runner=CPU, async_scheduling=False, thinker_graphs="NONE")
    assert mode_problems(cpu, CPU_BUILD, EAGER) == []
    problems = mode_problems(cpu, GPU, EAGER)
    assert "stage 0 runs the CPU model runner, not V2" in problems
    assert "stage 2 has async scheduling off, not on" in problems
    assert "stage 0 has CUDA graphs NONE, not FULL_AND_PIECEWISE" in problems
    # and the GPU's modes fail the CPU expectation
    assert len(mode_problems(_settings(), CPU_BUILD, EAGER)) == 3 + 3 + 1


def test_a_case_with_no_answer_fails():
    """Before: 0/0 answers agreed counted as agreement, exit 0."""
    result = _result(_settings(), answers=0, agreed=0)
    assert case_status(result, GPU) == ("FAILED", ["no answer was compared"])
    assert exit_status({"fp32": result}, GPU) == 1


def test_a_skipped_case_fails_unless_allowed():
    """Before: tp2 SKIPPED on one GPU still exited 0."""
    results = {"fp32": _result(_settings()), "tp2": {"skipped": "needs 2 GPUs, 1 visible"}}
    assert case_status(results["tp2"], GPU) == ("SKIPPED", ["needs 2 GPUs, 1 visible"])
    assert exit_status(results, GPU) == 1
    assert exit_status(results, GPU, allow_skip=True) == 0
    # nothing ran: a failure, skips allowed or not
    assert exit_status({"tp2": results["tp2"]}, GPU, allow_skip=True) == 1
    assert exit_status({"fp32": {"error": "stage 0 failed to start"}}, GPU,
                       allow_skip=True) == 1


def test_the_report_shows_the_modes_required_and_each_problem():
    results = {"bf16": _result(_settings(async_scheduling=False)),
               "tp2": {"skipped": "needs 2 GPUs, 1 visible"}}
    text = gpu_check.render(results, "cuda", "gpu", {"vLLM": "0.32.0", "FlashInfer": "on"})
    assert "vLLM 0.32.0, FlashInfer on" in text
    assert "modes required (gpu): V2 model runner, async scheduling on" in text
    assert "bf16  FAILED: 12/12 answers agree with HF" in text
    assert "stage 0 has async scheduling off, not on" in text
    assert "tp2   SKIPPED: needs 2 GPUs, 1 visible" in text


def test_graph_expectation_follows_the_shipped_yamls():
    """The stages the check expects without graphs are the eager ones of the YAMLs it
    serves: Qwen3-Omni's talker and code2wav, both BAGEL stages."""
    assert gpu_check.pipeline_eager(builtin_pipeline("qwen3_omni_moe")) == EAGER
    assert gpu_check.pipeline_eager(builtin_pipeline("bagel")) == {0: True, 1: True}


def test_arguments(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--record-bagel"])
    assert "--record-bagel records the CPU's images: add --cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--cpu", "--scenarios", "cancel"])


def test_a_case_may_name_its_own_scenarios(capsys):
    """``--cases NAME[:SCENARIO,...]``: a case's own scenarios, else ``--scenarios``'s;
    an unknown case or scenario, or scenarios for the BAGEL case, stop the check naming
    them."""
    assert gpu_check.case_arg("tp2") == ("tp2", None)
    assert gpu_check.case_arg("bf16:media") == ("bf16", ["media"])
    assert gpu_check.case_arg("fp32:parity,streamed") == ("fp32", ["parity", "streamed"])
    for item, error in (("bf17", "unknown case 'bf17': one of fp32, bf16, tp2, bagel"),
                        ("bf16:cancel", "case bf16: unknown scenario 'cancel'"),
                        ("bagel:parity", "case bagel serves no scenarios")):
        with pytest.raises(SystemExit):
            gpu_check.main(["--cpu", "--cases", item])
        assert error in capsys.readouterr().err, item


# -- the scripts --------------------------------------------------------------------------
def _fake_bin(tmp_path: Path, **scripts: str) -> str:
    """A PATH whose first folder holds ``scripts`` (name -> shell body) and the basic
    tools; ``nvidia-smi`` only where given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    system = [d for d in os.environ["PATH"].split(":")
              if d and not os.path.exists(os.path.join(d, "nvidia-smi"))]
    return ":".join([str(bin_dir), *system])


def _gpu_check_sh(tmp_path, path: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path,
           "VLLM_OMNI_PLUGIN_VENV": str(tmp_path / "must-not-be-made")}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_an_old_driver_stops_the_check_before_installing(tmp_path):
    """vLLM's CUDA wheels run on CUDA 13: driver R580 or newer. Before: nothing checked
    it, and setup_env.sh installed the CUDA wheel first."""
    nvidia_smi = ('case "$*" in *driver_version*) echo 550.54.15 ;; '
                  '*) echo "NVIDIA H100 80GB HBM3, 81559 MiB" ;; esac')
    proc = _gpu_check_sh(tmp_path, _fake_bin(tmp_path, **{"nvidia-smi": nvidia_smi}))
    assert proc.returncode == 4, proc.stderr
    assert "NVIDIA driver 550.54.15 is too old" in proc.stderr
    assert "R580 or newer" in proc.stderr
    assert not (tmp_path / "must-not-be-made").exists()


def test_no_driver_stops_the_check_naming_the_dry_run(tmp_path):
    proc = _gpu_check_sh(tmp_path, _fake_bin(tmp_path))
    assert proc.returncode == 4, proc.stderr
    assert "nvidia-smi not found" in proc.stderr and "--cpu" in proc.stderr
    assert not (tmp_path / "must-not-be-made").exists()


def _base_key() -> str:
    """The key setup_env.sh gives the venv's base stamp (its default torch versions and
    the lines between its "base install" markers)."""
    text = (Path(REPO) / "scripts" / "setup_env.sh").read_text()
    versions = [re.search(rf'^{name}="\$\{{{name}:-([^}}]+)\}}"$', text, re.M).group(1)
                for name in ("TORCH_VERSION", "TORCHVISION_VERSION")]
    lines, inside = [f"torch {versions[0]} torchvision {versions[1]}\n"], False
    for line in text.splitlines():
        inside = inside or line.startswith("# >>> base install")
        if inside:
            lines.append(line + "\n")
        if line.startswith("# <<< base install"):
            break
    return hashlib.sha1("".join(lines).encode()).hexdigest()[:12]


@pytest.mark.parametrize("pd", ["0", "1"])
def test_setup_env_installs_pd_prerequisites_only_when_asked(tmp_path, pd):
    """A venv that exists (its stamps), on a host without libibverbs: by default
    setup_env.sh installs the PD prerequisites (apt-get, as root; pip's pd extra); with
    VLLM_OMNI_PLUGIN_PD=0 (gpu_check.sh without --pd) neither, and it succeeds without
    root. Before: no way to skip them (exit 3 without root)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    for tool in ("pip", "python"):
        (venv / "bin" / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {log}\n")
        (venv / "bin" / tool).chmod(0o755)
    (venv / f".omni-plugin-env-0.32.0-cpu-{_base_key()}").touch()
    path = _fake_bin(tmp_path, ldconfig="exit 0",  # no library known
                     **{"apt-get": f'echo apt-get "$@" >> {log}; exit 1',
                        "id": "echo 1000", "sudo": "exit 1"})
    env = {**os.environ, "PATH": path, "VLLM_OMNI_PLUGIN_VENV": str(venv),
           "VLLM_OMNI_PLUGIN_BUILD": "cpu", "VLLM_VERSION": "0.32.0",
           "VLLM_OMNI_PLUGIN_PD": pd}
    proc = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    calls = log.read_text() if log.exists() else ""
    if pd == "1":
        assert proc.returncode == 3, proc.stderr
        assert "Mooncake (prefill/decode) needs libibverbs.so.1" in proc.stderr
        assert "pip" not in calls
    else:
        assert proc.returncode == 0, proc.stderr
        assert "apt-get" not in calls and "mooncake" not in calls
        installs = re.findall(r"^pip install .*$", calls, re.M)
        assert any('-e .[test]' in line for line in installs), calls
        assert not any("pd" in line for line in installs), calls


# -- --released ---------------------------------------------------------------------------
def test_a_plan_header_names_its_command_devices_and_length():
    from plugin_tests.gpu_check_released import plan_header

    args, fits, max_model_len = plan_header(builtin_pipeline("qwen3_omni_moe_1xh200"))
    assert args[:4] == ["--pipeline", "qwen3_omni_moe", "--devices", "1x140"]
    assert fits == (1, 140.0) and max_model_len == 32768
    with pytest.raises(ValueError, match="is not a plan"):
        plan_header(builtin_pipeline("qwen3_omni_moe"))


def _released_dir(tmp_path: Path, model_type: str, gib: float) -> Path:
    """A checkpoint directory as the plan lookup reads it: config.json's model_type and
    the safetensors index's total size."""
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": int(gib * 2**30)}, "weight_map": {}}))
    return folder


#: what nvidia-smi reports as an H100 80GB's and an H200's memory, MiB
H100, H200 = 81559, 143771


@pytest.mark.parametrize("model_type,gpus,plan", [
    ("qwen3_omni_moe", (1, H200), "qwen3_omni_moe_1xh200"),
    ("qwen3_omni_moe", (1, H100), "qwen3_omni_moe_fp8_1xh100"),  # one H100: the FP8 plan
    ("qwen3_omni_moe", (2, H100), "qwen3_omni_moe_2xh100"),
    ("bagel", (1, H100), "bagel_1xh100"),
])
def test_released_without_plan_serves_what_auto_serves(tmp_path, model_type, gpus, plan):
    """No --plan: the plan ``--stage-configs-path auto`` serves on these GPUs (the
    released checkpoints' weights, about 66 and 29 GiB: more than the default
    pipelines' shares hold)."""
    from plugin_tests.gpu_check_released import resolve_plan
    from vllm_omni_plugin.config.placement import Host

    host = Host("gpu", tuple(range(gpus[0])), "CUDA_VISIBLE_DEVICES", gpus[1] * 2**20)
    folder = _released_dir(tmp_path, model_type, 66.0 if model_type != "bagel" else 29.0)
    assert Path(resolve_plan(None, folder, host)).stem == plan
    assert Path(resolve_plan("bagel_1xh100", folder, host)).stem == "bagel_1xh100"


def test_released_plan_errors(tmp_path):
    from plugin_tests.gpu_check_released import resolve_plan
    from vllm_omni_plugin.config.placement import Host
    from vllm_omni_plugin.config.schema import StageConfigError

    host = Host("gpu", (0,), "CUDA_VISIBLE_DEVICES", 24 * 2**30)
    with pytest.raises(ValueError, match="no config.json"):
        resolve_plan(None, tmp_path, host)
    folder = _released_dir(tmp_path, "qwen3_omni_moe", 66.0)
    with pytest.raises(StageConfigError, match="--devices 1x24"):
        resolve_plan(None, folder, host)
    with pytest.raises(ValueError, match="is not a plan"):
        resolve_plan("qwen3_omni_moe", folder, host)


def test_released_kv_cache_against_the_plan():
    """Each engine's KV cache (blocks x block size, as vLLM's EngineCore reported it to
    the client) against the plan's tokens; under KV_FLOOR of them fails."""
    from plugin_tests.gpu_check_released import verdict

    settings = _settings()
    served = {"settings": settings, "eager": EAGER,
              "kv": {"0": {"blocks": 6000, "block_size": 16},
                     "1": {"blocks": 1000, "block_size": 16}, "2": {"blocks": 0, "block_size": 16}},
              "answer": {"error": None, "text": "Hello!", "payload": {"waveform": [48000]}}}
    plan = {"0": {"name": "thinker", "kv_tokens": 100_000, "kv_bytes": 100_000 * 98304,
                  "kv_per_token": 98304},
            "1": {"name": "talker", "kv_tokens": 10_000, "kv_bytes": 10_000 * 16384,
                  "kv_per_token": 16384},
            "2": {"name": "code2wav", "kv_tokens": 0, "kv_bytes": 0, "kv_per_token": 0}}
    lines, problems = verdict(served, plan)
    assert problems == []
    assert lines[0].endswith("KV 96,000 tokens (8.79 GiB) vs planned 100,000 (9.16 GiB): 0.96")
    assert "no KV cache (planned none)" in lines[2]
    served["kv"]["1"]["blocks"] = 400  # 6,400 tokens: 0.64 of the plan's
    served["settings"]["0"]["async_scheduling"] = False
    _, problems = verdict(served, plan)
    assert problems == ["stage 1: KV cache 0.64 of the plan's (under 0.8)",
                        "stage 0 has async scheduling off, not on"]


def test_released_arguments(capsys, tmp_path):
    with pytest.raises(SystemExit):
        gpu_check.main(["--cpu", "--released", str(tmp_path)])
    assert "--released serves a released checkpoint on GPUs: drop --cpu" in \
        capsys.readouterr().err
