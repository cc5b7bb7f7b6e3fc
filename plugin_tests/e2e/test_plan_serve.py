"""End to end: a memory plan written by the plan tool, served. On vLLM's CPU build,

    python -m vllm_omni_plugin.tools.plan <tiny Qwen3-Omni> --pipeline qwen3_omni_moe \
        --devices cpu:3 --max-model-len 2048 --dtype float32 --write plan.yaml
    vllm serve <tiny Qwen3-Omni> --stage-configs-path plan.yaml --max-model-len 2048 ...

with no memory flag or variable: each engine's KV cache is the size the plan wrote, and
a text + audio chat is answered."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from plugin_tests.conftest import PYTHON, REPO
from plugin_tests.serve_utils import serving

pytestmark = pytest.mark.e2e

PLAN_ARGS = ["--pipeline", "qwen3_omni_moe", "--devices", "cpu:3", "--max-model-len", "2048",
             "--dtype", "float32"]


@pytest.fixture(scope="module")
def planned(tiny_qwen3_omni, tmp_path_factory):
    """``(plan YAML path, the tool's printed table, the server)``."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU build's plan (host memory, KV cache sizes)")
    root = tmp_path_factory.mktemp("plan_e2e")
    path = root / "plan.yaml"
    done = subprocess.run([PYTHON, "-m", "vllm_omni_plugin.tools.plan", tiny_qwen3_omni,
                           *PLAN_ARGS, "--write", str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    with serving(tiny_qwen3_omni, ["--stage-configs-path", str(path), "--max-model-len",
                                   "2048", "--dtype", "float32"], str(root / "serve.log"),
                 env=env, memory_flags=False) as server:
        yield path, done.stdout, server


def test_the_plan_fits_and_writes_each_kv_cache_size(planned):
    path, table, _ = planned
    assert "fits on host memory 3 GiB" in table
    text = path.read_text()
    assert text.startswith("# Written by: python -m vllm_omni_plugin.tools.plan MODEL "
                           + " ".join(PLAN_ARGS))
    stages = {s["name"]: s for s in yaml.safe_load(text)["stages"]}
    assert stages["thinker"]["runtime"]["cpu_kv_cache_gib"] > 0
    assert stages["talker"]["runtime"]["cpu_kv_cache_gib"] > 0


def test_the_engines_have_the_planned_kv_caches_and_answer(planned):
    import openai

    path, _, server = planned
    stages = {s["name"]: s for s in yaml.safe_load(path.read_text())["stages"]}
    # vLLM's CPU worker logs each explicit KV cache size
    sizes = sorted(float(x) for x in re.findall(
        r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", server.log()))
    planned_sizes = sorted(stages[n]["runtime"]["cpu_kv_cache_gib"]
                           for n in ("thinker", "talker"))
    assert sizes == pytest.approx(planned_sizes, abs=0.01)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hello"}],
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
        max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.audio.data
