"""End to end: the quick start as a user who installed the wheel runs it. The checkout's
wheel installed (not editable) into a directory of its own (``helpers.installed_wheel``),
then, from a directory outside the checkout, plain

    vllm serve <tiny Qwen3-Omni> --stage-configs-path qwen3_omni_moe \
        --max-model-len 2048 --dtype float32

with no memory flag or variable and no worker binding in the environment: the built-in
pipeline's stage shares and KV cache sizes, and ``--omni-placement auto``, as shipped.
One text + audio chat through the official ``openai`` SDK."""

from __future__ import annotations

import base64
import io
import os
import re
from pathlib import Path

import pytest

from plugin_tests.helpers import installed_wheel
from plugin_tests.serve_utils import serving

pytestmark = pytest.mark.e2e

#: what the test environment may set that a user's does not
UNSET = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")


@pytest.fixture(scope="module")
def server(tiny_qwen3_omni, tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel_e2e")
    site = installed_wheel(root)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    with serving(tiny_qwen3_omni, ["--stage-configs-path", "qwen3_omni_moe",
                                   "--max-model-len", "2048", "--dtype", "float32"],
                 str(root / "serve.log"), env={**env, "PYTHONPATH": str(site)},
                 cwd=str(elsewhere), memory_flags=False) as proc:
        yield proc


def test_the_server_runs_the_installed_wheels_pipeline(server):
    site = Path(server.log_path).parent / "site"
    assert f"omni mode: pipeline {site}/vllm_omni_plugin/stage_configs/qwen3_omni_moe.yaml " \
        "(stages 0 thinker, 1 talker, 2 code2wav)" in server.log()


def test_text_and_audio_with_no_memory_flags(server):
    import openai
    import soundfile as sf

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hello"}],
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
        max_tokens=8, temperature=0)
    message = r.choices[0].message
    assert message.content
    data, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
    assert rate == 24000 and len(data) > 0


def test_the_engines_have_the_pipelines_kv_cache_size(server):
    """``runtime.cpu_kv_cache_gib: 1`` reached the thinker's and the talker's engines
    (vLLM's CPU worker logs an explicit size; without one it sizes the cache from a share
    of host memory); code2wav has no attention layers and no KV cache."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("KV cache sizes in GiB are the CPU build's")
    assert len(re.findall(r"Explicitly set \(1\.0/[\d.]+\) GiB for KV cache",
                          server.log())) == 2


def test_downstream_engines_read_only_their_shards(server, tiny_qwen3_omni):
    """The tiny checkpoint is sharded with an index, as the release is: vLLM's loader
    (0.32 and later) skips, in the talker's and code2wav's engines, the shards holding
    none of their keys, and logs how many."""
    import json
    from dataclasses import fields

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if "is_unused_weight" not in {f.name for f in fields(DefaultModelLoader.Source)}:
        pytest.skip("vLLM before 0.32 reads every shard")
    with open(os.path.join(tiny_qwen3_omni, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shards = set(weight_map.values())
    for prefix in ("talker.", "code2wav."):
        skipped = len(shards - {f for k, f in weight_map.items() if k.startswith(prefix)})
        assert 0 < skipped < len(shards), prefix
        assert f"Skipped {skipped}/{len(shards)} safetensors shard(s) holding no weights " \
            "the model loads" in server.log(), prefix


def test_auto_placement_on_the_cpu_build(server):
    """``--omni-placement auto`` on vLLM's CPU build (the workers' CPU affinity): with 3 or
    more cores, the thinker's worker on the first half of all but the last core, the
    talker's and code2wav's on the rest; with 2, vLLM's own binding (every worker on the
    first core, the second left to the other processes), measured faster there."""
    import psutil
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("placement over CPU cores is vLLM's CPU build's")
    cores = sorted(os.sched_getaffinity(0))
    log = server.log()
    affinity = {stage: psutil.Process(server.stage_worker(stage)[1]).cpu_affinity()
                for stage in (0, 1, 2)}
    if len(cores) < 3:
        assert "placement: stage 0 (thinker) on vLLM default; stage 1 (talker) on vLLM " \
            "default; stage 2 (code2wav) on vLLM default" in log
        assert all(a == cores[:1] for a in affinity.values()), affinity
        return
    usable = cores[:-1]
    first = usable[:len(usable) - len(usable) // 2]
    assert f"placement: stage 0 (thinker) on cores {','.join(map(str, first))}" in log
    assert affinity[0] == first
    assert set(affinity[1]) | set(affinity[2]) <= set(usable) - set(first)
