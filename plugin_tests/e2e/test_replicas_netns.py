"""Head and headless replicas in separate network namespaces (real veth link).

The head runs in this namespace and binds its omni master to the veth
address; the headless replicas (the prefill/decode pipeline's prefill thinker and
its talker) run in another namespace, find their address through the route probe
toward the master and are reached over the link. One cluster for the module, with a
cluster token (required on a network address): other heads and replicas started
beside it show that a head without one is refused, the opt-out starts with a warning,
and replicas with a wrong or no token are refused at registration.
Needs root (CAP_NET_ADMIN), `ip` and the plugin's `pd` extra (Mooncake); skipped with the
reason otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid

import pytest
import requests
import yaml

from plugin_tests.conftest import QWEN3_OMNI_PD_YAML
from plugin_tests.helpers import inductor_env
from plugin_tests.serve_utils import ServeProcess, free_port
from vllm_omni_plugin.wire.auth import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

HEAD_IP, REPLICA_IP = "10.231.0.1", "10.231.0.2"
#: the cluster's token: the head takes it by flag, the replicas from the environment
TOKEN = "netns-cluster-secret"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def netns():
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command is not installed")
    name = f"omni-{uuid.uuid4().hex[:6]}"
    host_if, peer_if = f"vh{name[-6:]}", f"vp{name[-6:]}"
    probe = _ip("netns", "add", name)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {probe.stderr.strip()}")
    try:
        for args in (("link", "add", host_if, "type", "veth", "peer", "name", peer_if),
                     ("link", "set", peer_if, "netns", name),
                     ("addr", "add", f"{HEAD_IP}/24", "dev", host_if),
                     ("link", "set", host_if, "up"),
                     ("netns", "exec", name, "ip", "addr", "add", f"{REPLICA_IP}/24",
                      "dev", peer_if),
                     ("netns", "exec", name, "ip", "link", "set", peer_if, "up"),
                     ("netns", "exec", name, "ip", "link", "set", "lo", "up")):
            out = _ip(*args)
            if out.returncode != 0:
                pytest.skip(f"cannot set up a veth link: ip {' '.join(args)}: {out.stderr}")
        yield name
    finally:
        _ip("link", "del", host_if)
        _ip("netns", "del", name)


@pytest.fixture(scope="module")
def cluster(netns, tiny_qwen3_omni, tmp_path_factory):
    """One head and two headless replicas in the namespace, of the prefill/decode
    pipeline: the thinker's prefill stage and the talker run only there.

    Each side advertises the address the other reaches it at (the head's master
    address, the replica's route-probe address), and the prefill replica's bootstrap
    port comes from the master's port range. Yields ``(head, {stage: replica})``."""
    pytest.importorskip("mooncake.engine", reason="the plugin's `pd` extra is not installed")
    root = tmp_path_factory.mktemp("netns")
    with open(QWEN3_OMNI_PD_YAML) as f:
        pipeline = yaml.safe_load(f)
    talker = pipeline["stages"][1]
    talker["default_sampling_params"]["max_tokens"] = 16
    talker["runtime"] = {"num_replicas": 0}
    prefill = next(s for s in pipeline["stages"] if s.get("pd", {}).get("role") == "prefill")
    prefill["runtime"] = {"num_replicas": 0}
    yaml_path = root / "pipeline.yaml"
    yaml_path.write_text(yaml.safe_dump(pipeline))
    env = {k: v for k, v in inductor_env().items() if k != "VLLM_HOST_IP"}
    # vLLM's CPU build pins every engine's worker to core 0 of this 2-core machine; the
    # decode worker busy-waits for the KV cache and starved the prefill replica's
    # bootstrap server on that core (separate hosts share no core)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    common = [tiny_qwen3_omni, "--stage-configs-path", str(yaml_path), "--dtype", "float32",
              "--max-model-len", "2048", "-oma", HEAD_IP, "-omp", str(free_port())]
    head = ServeProcess([*common, "--omni-heartbeat-timeout", "10",
                         "--omni-cluster-token", TOKEN], str(root / "head.log"), env=env)
    replicas = {}
    try:
        head.wait_for_log(r"omni master on tcp://")
        for stage in (prefill["stage_id"], talker["stage_id"]):
            replicas[stage] = ServeProcess([*common, "--headless", "--stage-id", str(stage)],
                                           str(root / f"headless{stage}.log"),
                                           env={**env, CLUSTER_TOKEN_ENV: TOKEN},
                                           prefix=["ip", "netns", "exec", netns])
        head.wait_ready()
        for stage, replica in replicas.items():
            match = replica.wait_for_log(rf"stage {stage} replica \d+ serving on (tcp://\S+)")
            assert match.group(1).startswith(f"tcp://{REPLICA_IP}:")  # the route probe's
            head.wait_for_log(rf"stage {stage} replica \d+ \(remote tcp://10\.231\.0\.2:\d+\) "
                              "attached", timeout_s=60)
        head.model = requests.get(f"{head.url}/v1/models", timeout=10).json()["data"][0]["id"]
        head.common, head.env, head.netns = common, env, netns
        yield head, replicas
    finally:
        for proc in [*replicas.values(), head]:
            proc.stop()


def _served(head, stage: int) -> float:
    """Requests the head has sent to ``stage``'s replicas, all of them together."""
    return sum(head.replica_metric("vllm_omni:replica_requests_total", stage).values())


def test_headless_replica_in_another_network_namespace(cluster):
    """The talker runs only across the link: a spoken answer's talker part is served
    there."""
    head, _ = cluster
    before = _served(head, 1)
    response = head.chat({"model": head.model, "max_tokens": 6, "temperature": 0,
                          "modalities": ["text", "audio"],
                          "messages": [{"role": "user", "content": "Across the link."}]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["audio"]["data"]
    assert _served(head, 1) - before == 1


def test_headless_prefill_replica_in_another_network_namespace(cluster):
    """Prefill/decode disaggregation across hosts: the thinker's prefill stage runs only as
    a headless replica in its own namespace; the head's decode engine pulls each prompt's
    KV cache from it over the link (Mooncake TCP)."""
    import openai

    head, replicas = cluster
    stage = next(s for s in replicas if s != 1)
    assert f"KV transfers advertise {HEAD_IP}" in head.log()
    assert f"KV transfers advertise {REPLICA_IP}" in replicas[stage].log()
    before = _served(head, stage)
    client = openai.OpenAI(base_url=f"{head.url}/v1", api_key="-")
    messages = [{"role": "user", "content": "Prefill over there, decode here."}]
    text = client.chat.completions.create(model=head.model, messages=messages, max_tokens=8,
                                          temperature=0)
    spoken = client.chat.completions.create(
        model=head.model, messages=messages, max_tokens=8, temperature=0,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})
    # a failed KV load would have been an error (kv_load_failure_policy "fail")
    assert text.choices[0].finish_reason == "length"
    assert spoken.choices[0].message.content == text.choices[0].message.content
    assert spoken.choices[0].message.audio.data
    assert _served(head, stage) - before == 2


# -- secure by default: the cluster token on a network address --------------------------
def _exited(proc: ServeProcess, timeout: float = 180) -> str:
    """``proc``'s log once it has exited (it must, with a failure status)."""
    try:
        code = proc.proc.wait(timeout=timeout)
    finally:
        proc.stop()
    assert code != 0, proc.log()[-3000:]
    return proc.log()


def test_a_head_on_a_network_address_needs_a_token_or_the_opt_out(cluster, tmp_path):
    """Beside the cluster's head, two more on the veth address without a token: plain,
    it refuses to start naming the address, the flags, the variable and how to make a
    token; with --omni-cluster-insecure it starts its omni master there, before its
    engine (replicas register while the head loads), and warns."""
    head, _ = cluster
    env = {k: v for k, v in head.env.items() if k != CLUSTER_TOKEN_ENV}

    def other_head(*flags: str, name: str) -> ServeProcess:
        args = [*head.common[:-1], str(free_port()), *flags]  # another master port
        return ServeProcess(args, str(tmp_path / f"{name}.log"), env=env)

    # one after the other, the opt-out stopped once its master listens: started beside
    # the refused one, it went on to start its engines meanwhile (CPU that CI pays)
    insecure = other_head("--omni-cluster-insecure", name="insecure")
    try:
        listening = insecure.wait_for_log(rf"omni master on tcp://{HEAD_IP.replace('.', '[.]')}:")
        assert "(EngineCore" not in insecure.log()[:listening.start()]
        assert f"--omni-cluster-insecure: the omni master and coordinator listen on {HEAD_IP} " \
            "without a cluster token" in insecure.log()
    finally:
        insecure.stop()
    log = _exited(other_head(name="refused"))
    assert f"--omni-master-address {HEAD_IP} is not a loopback address and no cluster " \
        "token is set" in log
    for part in (CLUSTER_TOKEN_ENV, "secrets.token_hex(32)", "--omni-cluster-insecure"):
        assert part in log, part


def test_a_replica_with_a_wrong_or_no_token_is_refused_and_the_head_serves(cluster, tmp_path):
    """Headless talker replicas in the other namespace with another token and with none:
    each exits at registration naming the reason (an answer, not a timeout); the head
    keeps its replicas and serves."""
    head, _ = cluster
    env = {k: v for k, v in head.env.items() if k != CLUSTER_TOKEN_ENV}
    wrong = ServeProcess([*head.common, "--headless", "--stage-id", "1"],
                         str(tmp_path / "wrong.log"), env={**env, CLUSTER_TOKEN_ENV: "other"},
                         prefix=["ip", "netns", "exec", head.netns])
    missing = ServeProcess([*head.common, "--headless", "--stage-id", "1"],
                           str(tmp_path / "missing.log"), env=env,
                           prefix=["ip", "netns", "exec", head.netns])
    says = {wrong: "the head's cluster token differs from this process's",
            missing: "the head requires a cluster token and this process has none"}
    for proc, reason in says.items():
        log = _exited(proc)
        assert "registration with the omni master at tcp://10.231.0.1:" in log, log[-3000:]
        assert reason in log, log[-3000:]
        assert "no reply from the master" not in log
    assert head.replicas_up(1) == {0}
    spoken = head.chat({"model": head.model, "max_tokens": 4, "modalities": ["text", "audio"],
                        "messages": [{"role": "user", "content": "Still there?"}]})
    assert spoken.status_code == 200, spoken.text


def test_the_token_is_in_no_log_and_not_in_metrics(cluster):
    head, replicas = cluster
    assert "--omni-cluster-token" in " ".join(head.proc.args)  # the head took it by flag
    for proc in (head, *replicas.values()):
        assert TOKEN not in proc.log(), proc.log_path
    assert TOKEN not in requests.get(f"{head.url}/metrics", timeout=10).text
    assert head.metrics()[("vllm_omni:cluster_insecure", frozenset())] == 0.0
