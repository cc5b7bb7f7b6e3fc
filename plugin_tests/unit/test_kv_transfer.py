"""The plugin's KV connector: registration, descriptor batches, start-up checks.

The writes go to a scripted transfer engine (a fake standing in for Mooncake's
``TransferEngine``, so that write sizes, ordering and failures can be chosen); the real
engine between two vLLM engines is ``plugin_tests/engine/test_pd_engine.py``.
"""

from __future__ import annotations

import os
import socket
import threading
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as m

from vllm_omni_plugin.compat import mooncake as compat_mooncake
from vllm_omni_plugin.kv_transfer import (
    CONNECTOR_NAME,
    EXTRA_BOOTSTRAP_PORT,
    EXTRA_MAX_DESCS_PER_PEER,
    EXTRA_TRANSFER_TIMEOUT,
    register_connectors,
)
from vllm_omni_plugin.kv_transfer import mooncake as omni_mooncake

WAIT_S = 10


class ScriptedTransferEngine:
    """Records each ``batch_transfer_sync_write``; ``status`` scripts return codes in call
    order; ``hold[session]`` makes the next write to that session wait for an event."""

    def __init__(self, status=()):
        self.calls: list[tuple[str, list[int], list[int], list[int]]] = []
        self.status = list(status)
        self.entered: dict[str, threading.Event] = {}
        self.hold: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def batch_transfer_sync_write(self, session, src, dst, lengths):
        with self._lock:
            self.calls.append((session, list(src), list(dst), list(lengths)))
            self.entered.setdefault(session, threading.Event()).set()
            hold = self.hold.pop(session, None)
            status = self.status.pop(0) if self.status else 0
        if hold is not None:
            assert hold.wait(WAIT_S)
        return status


def _worker(engine, max_descs=3):
    """A connector worker around ``engine`` without Mooncake's start-up (only the state
    ``_send_blocks`` reads)."""
    worker = object.__new__(omni_mooncake.OmniMooncakeConnectorWorker)
    worker.engine = engine
    worker.xfer_stats = m.MooncakeKVConnectorStats()
    worker._omni_max_descs = max_descs
    worker._omni_peer_locks = {}
    worker._omni_peer_locks_guard = threading.Lock()
    worker.shutdown = lambda: None  # vLLM's __del__ shuts down what this worker never started
    return worker


def test_registered_with_vllm_factory():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register_connectors()
    assert register_connectors() is False  # a second register() in the process is a no-op
    config = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_producer")
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls is omni_mooncake.OmniMooncakeConnector
    assert issubclass(cls, m.MooncakeConnector)


def test_send_blocks_splits_writes_by_descriptor_limit():
    engine = ScriptedTransferEngine()
    src, dst, lengths = list(range(8)), list(range(100, 108)), [16] * 8
    assert _worker(engine, max_descs=3)._send_blocks("peer:1", src, dst, lengths) == 0
    assert [c[1] for c in engine.calls] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [c[2] for c in engine.calls] == [[100, 101, 102], [103, 104, 105], [106, 107]]
    assert all(c[0] == "peer:1" for c in engine.calls)


def test_coalesce_merges_runs_adjoining_on_both_sides_in_any_order():
    # a request's blocks in a descending run (vLLM's block pool frees them reversed):
    # local blocks 7, 6, 5 -> remote blocks 12, 11, 10, 16 bytes each
    src, dst, lengths = omni_mooncake.coalesce_descriptors(
        [7 * 16, 6 * 16, 5 * 16], [12 * 16, 11 * 16, 10 * 16], [16, 16, 16])
    assert (src, dst, lengths) == ([5 * 16], [10 * 16], [48])


def test_coalesce_keeps_apart_what_adjoins_on_one_side_only():
    # 0->100 and 16->200 adjoin at the source only; 32->216 adjoins 16->200 on both;
    # 64->300 leaves a gap at the source; 48 bytes at 80 adjoin 64 (16 bytes) on both
    src, dst, lengths = omni_mooncake.coalesce_descriptors(
        [80, 0, 32, 16, 64], [316, 100, 216, 200, 300], [48, 16, 8, 16, 16])
    assert src == [0, 16, 64]
    assert dst == [100, 200, 300]
    assert lengths == [16, 24, 64]
    assert sum(lengths) == 48 + 16 + 8 + 16 + 16


def test_send_blocks_writes_coalesced_descriptors():
    engine = ScriptedTransferEngine()
    src = [3 * 16, 2 * 16, 1 * 16, 9 * 16]
    dst = [43 * 16, 42 * 16, 41 * 16, 60 * 16]
    assert _worker(engine)._send_blocks("peer:1", src, dst, [16] * 4) == 0
    assert engine.calls == [("peer:1", [16, 9 * 16], [41 * 16, 60 * 16], [48, 16])]


def test_send_blocks_stops_at_first_failed_write():
    engine = ScriptedTransferEngine(status=[0, -1, 0])
    worker = _worker(engine, max_descs=2)
    assert worker._send_blocks("peer:1", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [8] * 5) == -1
    assert len(engine.calls) == 2  # the third batch is not sent after a failure


def test_send_blocks_one_writer_per_peer():
    """vLLM's sender threads write concurrently; writes to one peer run one at a time,
    writes to another peer are not held up."""
    engine = ScriptedTransferEngine()
    worker = _worker(engine)
    release = threading.Event()
    engine.hold["a:1"] = release
    first = threading.Thread(target=worker._send_blocks, args=("a:1", [1], [1], [8]))
    first.start()
    engine.entered.setdefault("a:1", threading.Event())
    assert engine.entered["a:1"].wait(WAIT_S)
    second = threading.Thread(target=worker._send_blocks, args=("a:1", [2], [2], [8]))
    second.start()
    other = threading.Thread(target=worker._send_blocks, args=("b:1", [3], [3], [8]))
    other.start()
    other.join(WAIT_S)
    assert not other.is_alive()  # another peer is not blocked
    assert [c[1] for c in engine.calls if c[0] == "a:1"] == [[1]]  # second waits
    release.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert [c[1] for c in engine.calls if c[0] == "a:1"] == [[1], [2]]


def _vllm_config(role="kv_producer", **extra):
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_role=role, kv_connector_extra_config=extra))


@pytest.mark.parametrize("value", [0, -5, "8", 1.5, True])
def test_bad_extra_config_values_name_the_key(value):
    with pytest.raises(ValueError, match=EXTRA_MAX_DESCS_PER_PEER):
        omni_mooncake._preflight(_vllm_config(**{EXTRA_MAX_DESCS_PER_PEER: value}))


@pytest.mark.parametrize("value", [0, -1.5, "3", True])
def test_bad_transfer_timeout_names_the_key(value):
    with pytest.raises(ValueError, match=EXTRA_TRANSFER_TIMEOUT):
        omni_mooncake._preflight(_vllm_config(**{EXTRA_TRANSFER_TIMEOUT: value}))


# -- transfer timeout: vLLM's coroutines scripted where a real peer cannot be made to
# -- hang on cue (the real processes are plugin_tests/engine/test_pd_engine.py) ----------
def _timed_worker(timeout):
    worker = object.__new__(omni_mooncake.OmniMooncakeConnectorWorker)
    worker._omni_timeout = timeout
    worker._omni_deadlines = {}
    worker._pending_bootstrap_queries = {}
    worker._remote_agents = {}
    worker.reqs_need_send = {}
    worker.shutdown = lambda: None  # vLLM's __del__ shuts down what this worker never started
    worker.failed: list = []
    worker._handle_failed_recv = lambda metas, req_ids, reason: worker.failed.append(
        (sorted(req_ids), reason))
    return worker


def _pull(addr="http://10.0.0.9:8998"):
    return SimpleNamespace(remote_bootstrap_addr=addr, failed=False)


def test_pull_that_outlasts_the_timeout_fails_its_requests(monkeypatch):
    import asyncio

    async def hang(self, *args):
        await asyncio.Event().wait()

    monkeypatch.setattr(m.MooncakeConnectorWorker, "_start_load_kv",
                        lambda self, reqs: asyncio.sleep(0))
    monkeypatch.setattr(m.MooncakeConnectorWorker, "receive_kv_from_single_worker", hang)
    worker = _timed_worker(0.05)
    metas = {"r1": _pull(), "r2": _pull()}

    async def scenario():
        await worker._start_load_kv({"engine-p": metas})
        assert set(worker._omni_deadlines) == {"r1", "r2"}
        await worker.receive_kv_from_single_worker("tcp://10.0.0.9:5555", metas)

    asyncio.run(scenario())
    ((req_ids, reason),) = worker.failed
    assert req_ids == ["r1", "r2"]
    assert "no KV cache from tcp://10.0.0.9:5555 within 0.05 s" in reason
    assert EXTRA_TRANSFER_TIMEOUT in reason and worker._omni_deadlines == {}


def test_bootstrap_query_that_outlasts_the_timeout_wakes_its_waiters(monkeypatch):
    import asyncio

    addr = "http://10.0.0.9:8998"

    async def query(self, engine_id, pull_metas):  # vLLM's: registers, then never answers
        self._pending_bootstrap_queries[addr] = asyncio.Event()
        await asyncio.Event().wait()

    monkeypatch.setattr(m.MooncakeConnectorWorker, "handle_new_engine_id", query)
    worker = _timed_worker(0.05)
    metas = {"r1": _pull(addr)}
    asyncio.run(worker.handle_new_engine_id("engine-p", metas))
    ((req_ids, reason),) = worker.failed
    assert req_ids == ["r1"] and f"bootstrap server {addr} did not answer within" in reason
    assert worker._pending_bootstrap_queries == {} and worker._omni_deadlines == {}


def test_without_a_timeout_vllm_waits_as_it_does(monkeypatch):
    import asyncio

    seen = []

    async def receive(self, addr, metas):
        seen.append(addr)

    monkeypatch.setattr(m.MooncakeConnectorWorker, "receive_kv_from_single_worker", receive)
    worker = _timed_worker(None)
    asyncio.run(worker.receive_kv_from_single_worker("tcp://p:1", {"r1": _pull()}))
    assert seen == ["tcp://p:1"] and worker.failed == []


def test_prefill_side_holds_kv_for_half_the_timeout_then_refuses_to_write(monkeypatch):
    import asyncio
    import time

    built = []

    async def record(self, metadata):  # vLLM's: 480 s by default
        for transfer_id, _blocks in metadata.reqs_to_send.values():
            self.reqs_need_send[transfer_id].expire_time = time.perf_counter() + 480

    async def build(self, ready_reqs, agent_meta, local_regions, remote_regions):
        built.append([d for d, _ in ready_reqs])
        return [1], [2], [3], [], None

    monkeypatch.setattr(m.MooncakeConnectorWorker, "record_send_reqs", record)
    monkeypatch.setattr(m.MooncakeConnectorWorker, "_build_transfer_params", build)
    worker = _timed_worker(4.0)
    fresh, old = (SimpleNamespace(expire_time=float("inf")) for _ in range(2))
    worker.reqs_need_send = {"t-fresh": fresh, "t-old": old}
    before = time.perf_counter()
    asyncio.run(worker.record_send_reqs(SimpleNamespace(reqs_to_send={
        "p1": ("t-fresh", [[1]]), "p2": ("t-old", [[2]])})))
    assert before + 2.0 <= fresh.expire_time <= time.perf_counter() + 2.0
    old.expire_time = time.perf_counter() - 1  # held past its limit
    src, dst, lengths, err_reqs, err_msg = asyncio.run(worker._build_transfer_params(
        [("d-fresh", fresh), ("d-old", old)], None, [], []))
    assert built == [["d-fresh"]] and (src, dst, lengths) == ([1], [2], [3])
    assert err_reqs == ["d-old"] and "longer than 2 s" in err_msg


def test_missing_mooncake_names_the_fix(monkeypatch):
    monkeypatch.setattr(m, "TransferEngine", None)  # as where `mooncake.engine` fails
    with pytest.raises(RuntimeError, match=r"vllm-omni-plugin\[pd\].*libibverbs1"):
        omni_mooncake._preflight(_vllm_config())


def _listening_port(sock: socket.socket) -> int:
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock.getsockname()[1]


def test_bootstrap_port_in_use_is_an_error():
    with socket.socket() as busy:
        port = _listening_port(busy)
        with pytest.raises(RuntimeError, match=f"port {port} is in use"):
            compat_mooncake.ensure_port_free(port)
    compat_mooncake.ensure_port_free(port)  # closed: free again


def test_bootstrap_port_reaches_vllm_through_its_env_cache(monkeypatch):
    """vLLM's worker has cached its environment before the connector starts; the port the
    plugin sets is still the one vLLM reads (and the cache stays on)."""
    from vllm import envs

    monkeypatch.setenv(compat_mooncake.BOOTSTRAP_PORT_ENV, "8998")  # restored after the test
    envs.enable_envs_cache()
    try:
        assert envs.VLLM_MOONCAKE_BOOTSTRAP_PORT == 8998  # cached
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        compat_mooncake.use_bootstrap_port(port)
        assert envs.VLLM_MOONCAKE_BOOTSTRAP_PORT == port
        assert hasattr(envs.__getattr__, "cache_clear")
        assert os.environ[compat_mooncake.BOOTSTRAP_PORT_ENV] == str(port)
    finally:
        envs.disable_envs_cache()


def test_preflight_checks_the_configured_bootstrap_port(monkeypatch):
    monkeypatch.setattr(m, "should_launch_bootstrap_server", lambda config: True)
    monkeypatch.setattr(m, "TransferEngine", object)  # checked first; importable or not
    with socket.socket() as busy:
        port = _listening_port(busy)
        with pytest.raises(RuntimeError, match=f"port {port} is in use"):
            omni_mooncake._preflight(_vllm_config(**{EXTRA_BOOTSTRAP_PORT: port}))
        # the decode side starts no bootstrap server: the port does not matter there
        omni_mooncake._preflight(_vllm_config("kv_consumer", **{EXTRA_BOOTSTRAP_PORT: port}))


def test_cpu_device_index_only_while_building():
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the shim applies on vLLM's CPU platform only")
    original = torch.accelerator.current_device_index
    with compat_mooncake.cpu_device_index() as patched:
        assert torch.accelerator.current_device_index() == 0
    assert torch.accelerator.current_device_index is original
    if patched:  # the index is unavailable outside the shim
        with pytest.raises(RuntimeError):
            torch.accelerator.current_device_index()


def _pd(role="prefill", **fields):
    from vllm_omni_plugin.config.schema import PDConfig

    return PDConfig(role=role, decode_stage=0 if role == "prefill" else None, **fields)


def test_kv_transfer_config_per_role_is_what_vllm_accepts():
    from vllm.config import KVTransferConfig

    from vllm_omni_plugin.kv_transfer import kv_transfer_config, new_engine_id

    pd = _pd(protocol="tcp", max_descs_per_peer=64)
    prefill = KVTransferConfig(**kv_transfer_config(
        pd, new_engine_id("thinker_prefill"), pd.transfer_timeout(30.0), 9001))
    assert prefill.kv_connector == CONNECTOR_NAME and prefill.kv_role == "kv_producer"
    assert prefill.engine_id.startswith("thinker_prefill-")
    assert prefill.kv_load_failure_policy == "fail"
    assert prefill.kv_connector_extra_config == {
        "mooncake_protocol": "tcp", EXTRA_MAX_DESCS_PER_PEER: 64, EXTRA_BOOTSTRAP_PORT: 9001,
        EXTRA_TRANSFER_TIMEOUT: 30.0}
    pd = _pd("decode", device_name="mlx5_0", transfer_timeout_s=4.5)
    decode = KVTransferConfig(**kv_transfer_config(pd, "d", pd.transfer_timeout(30.0)))
    assert decode.kv_role == "kv_consumer" and EXTRA_BOOTSTRAP_PORT not in (
        decode.kv_connector_extra_config)
    assert decode.kv_connector_extra_config[EXTRA_TRANSFER_TIMEOUT] == 4.5
    assert decode.kv_connector_extra_config["device_name"] == "mlx5_0"
    assert new_engine_id("x") != new_engine_id("x")  # a new one for every engine start


def test_prefill_engine_params_pair_a_decode_request():
    from vllm_omni_plugin.kv_transfer import (
        decode_request_params,
        kv_transfer_config,
        prefill_engine_params,
        prefill_request_params,
    )

    def config(pd, port=None):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(
            **kv_transfer_config(pd, "e-1", 30.0, port)))

    engine = prefill_engine_params(config(_pd(), 9001), "10.0.0.7")
    assert engine == {"remote_engine_id": "e-1",
                      "remote_bootstrap_addr": "http://10.0.0.7:9001"}
    assert prefill_engine_params(config(_pd("decode")), "h") is None
    assert prefill_engine_params(SimpleNamespace(kv_transfer_config=None), "h") is None
    assert prefill_request_params("t") == {"do_remote_decode": True, "do_remote_prefill": False,
                                           "transfer_id": "t"}
    assert decode_request_params("t", engine) == {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t", **engine}


def test_prefill_stage_takes_the_decode_engines_kv_layout():
    from vllm_omni_plugin.config.cli import prefill_base_args

    decode = SimpleNamespace(engine_args={"hf_overrides": {"architectures": ["A"]},
                                          "worker_cls": "w", "max_num_seqs": 8})
    resolved = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
        model_config=SimpleNamespace(max_model_len=2048, quantization=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    args = prefill_base_args({"model": "m", "dtype": "float32"}, decode, resolved)
    assert args == {"model": "m", "dtype": "float32", "hf_overrides": {"architectures": ["A"]},
                    "worker_cls": "w", "max_num_seqs": 8, "block_size": 32,
                    "kv_cache_dtype": "auto", "max_model_len": 2048,
                    "tensor_parallel_size": 1, "pipeline_parallel_size": 1}


@pytest.mark.parametrize("host,preset,want", [
    ("127.0.0.2", None, "127.0.0.2"),         # the address peers reach this process at
    ("127.0.0.2", "127.0.0.3", "127.0.0.3"),  # the operator's VLLM_HOST_IP wins
    ("0.0.0.0", None, None),                  # a wildcard says nothing: vLLM decides
    ("head.example", None, None),             # a host name: vLLM decides
])
def test_advertise_host(monkeypatch, host, preset, want):
    from vllm_omni_plugin.kv_transfer import HOST_IP_ENV, advertise_host

    monkeypatch.delenv(HOST_IP_ENV, raising=False)
    if preset:
        monkeypatch.setenv(HOST_IP_ENV, preset)
    assert advertise_host(host, 0) == want
    assert os.environ.get(HOST_IP_ENV) == want


@pytest.mark.parametrize("host,preset", [
    ("198.51.100.7", None),         # a head's --omni-master-address of another host
    ("127.0.0.1", "198.51.100.7"),  # an operator's VLLM_HOST_IP of another host
])
def test_advertise_host_refuses_an_address_of_another_host(monkeypatch, host, preset):
    """198.51.100.0/24 is TEST-NET-2 (RFC 5737), never an address of this host: vLLM's side
    channel could not bind it, so start-up stops naming the variable."""
    from vllm_omni_plugin.kv_transfer import HOST_IP_ENV, advertise_host

    monkeypatch.delenv(HOST_IP_ENV, raising=False)
    if preset:
        monkeypatch.setenv(HOST_IP_ENV, preset)
    with pytest.raises(ValueError, match=r"VLLM_HOST_IP=198\.51\.100\.7 is not an address of "
                                         r"this host .*stage 3"):
        advertise_host(host, 3)


def test_headless_prefill_replica_takes_the_decode_stage_model(tmp_path):
    """``--headless --stage-id`` of a prefill stage: the decode stage's model settings
    (architecture, worker) under the command line's, the KV layout from the command line."""
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs

    from plugin_tests.conftest import QWEN3_OMNI_PD_YAML
    from vllm_omni_plugin.config.cli import add_omni_args, headless_plan
    from vllm_omni_plugin.config.loader import load_pipeline_config

    parser = argparse.ArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    parser.add_argument("--headless", action="store_true")  # `vllm serve`'s own flag
    add_omni_args(parser)
    pipeline = load_pipeline_config(QWEN3_OMNI_PD_YAML)
    prefill = pipeline.prefill_stage_for(pipeline.entry_stage.stage_id)
    args = parser.parse_args(["--model", str(tmp_path), "--stage-configs-path",
                              QWEN3_OMNI_PD_YAML, "--headless", "--stage-id",
                              str(prefill.stage_id), "-oma", "127.0.0.1", "-omp", "9",
                              "--block-size", "64", "--max-model-len", "1024"])
    plan = headless_plan(args)
    assert plan.stage.is_prefill
    decode_args = pipeline.entry_stage.engine_args
    assert plan.base_args["hf_overrides"] == decode_args["hf_overrides"]
    assert plan.base_args["worker_cls"] == decode_args["worker_cls"]
    assert plan.base_args["block_size"] == 64 and plan.base_args["max_model_len"] == 1024
