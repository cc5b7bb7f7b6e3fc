"""KV transfer throughput of ``OmniMooncakeConnector`` between two real vLLM engines on
loopback TCP, side by side with raw Mooncake and torch ``copy_`` of the same bytes; and the
latency of one request with a remote prefill vs a local one.

Usage (repository root, project venv with the `pd` extra)::

    .venv/bin/python benchmarks/pd_transfer_bench.py                 # 3 trials, >= 64 MiB each
    .venv/bin/python benchmarks/pd_transfer_bench.py --trials 5 --requests 160

What is timed:

* **connector**: a prefill engine (``kv_producer``) and a decode engine (``kv_consumer``)
  of the tiny Qwen3-Omni thinker stage (float32, block size ``--block-size``, default 32).
  The prefill engine computes ``--requests`` prompts of ``--prompt-len`` tokens (one
  output token each, untimed); then the decode engine is given the same prompts with the pairing
  parameters and one output token each, and the wall time of that call is taken: the
  decode engine's scheduling, the pull requests, the prefill engine's writes, the
  completion notices and one forward of the last prompt token per request. The figure
  is therefore a lower bound of the transfer rate. Bytes = the prompts' full KV blocks
  (``2 * layers * kv_heads * head_dim * 4`` bytes per token).
* **raw Mooncake**: two ``TransferEngine`` (TCP, loopback) in two processes; the same
  bytes per trial, written with ``batch_transfer_sync_write`` in descriptors of the
  connector's mean descriptor size (vLLM writes one per contiguous run of blocks and
  layer, so the size depends on how fragmented the two engines' free block lists are;
  over TCP the cost is mostly per descriptor), at most 1024 per call.
* **connector writes**: vLLM's own transfer statistics of the prefill engine (bytes and
  duration of each ``batch_transfer_sync_write``), collected through a stat logger.
* **raw Mooncake beside busy loops**: the same, while two processes spin on the CPU, as the
  two engines' busy loops do while a transfer runs (on a host with few cores Mooncake's
  TCP threads share them).
* **torch copy_**: ``dst.copy_(src)`` of the same bytes in host memory.

The engines run with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless it is set: vLLM's CPU
build otherwise binds both engines' workers to the same core on a 2-core host.
* **latency**: one request of ``--prompt-len`` tokens and 16 new tokens: decode engine
  alone vs prefill engine then decode engine (the orchestrator's sequence).

Prints a table; medians over ``--trials``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, make_checkpoint  # noqa: E402

MAX_DESCS = 1024


def _engine_args(kv_bytes: int, block_size: int) -> dict:
    return {
        "hf_overrides": {"architectures": ["OmniPluginQwen3OmniThinker"]},
        "worker_cls": "vllm_omni_plugin.worker.omni_worker.OmniWorker",
        "max_model_len": 512, "dtype": "float32", "enforce_eager": True, "seed": 0,
        "gpu_memory_utilization": 0.2, "enable_prefix_caching": False,
        "block_size": block_size,
        "kv_cache_memory_bytes": kv_bytes, "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
    }


def _kv_bytes_per_token(ckpt: Path) -> int:
    text = json.loads((ckpt / "config.json").read_text())["thinker_config"]["text_config"]
    return 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * text["head_dim"] * 4


class _TransferStats:
    """A vLLM stat logger (``stat_loggers=``) that accumulates the prefill engine's KV
    connector statistics (vLLM's ``MooncakeKVConnectorStats``: bytes and duration of each
    write)."""

    collected: list = []

    def __init__(self, vllm_config, engine_index: int = 0):
        pass

    def record(self, scheduler_stats, *args, **kwargs):
        data = getattr(scheduler_stats, "kv_connector_stats", None)
        if data:
            _TransferStats.collected.append(data)

    def log_engine_initialized(self):
        pass

    @classmethod
    async def take(cls, min_bytes: int = 0, timeout_s: float = 30.0) -> dict:
        """vLLM's reduced figures of the writes recorded since the last call, once they
        add up to ``min_bytes`` (the prefill engine reports them on its later steps)."""
        from vllm_omni_plugin.kv_transfer.mooncake import OmniMooncakeConnector

        deadline = time.monotonic() + timeout_s
        while True:
            total = None
            for data in cls.collected:
                stats = OmniMooncakeConnector.build_kv_connector_stats(data=data)
                total = stats if total is None else total.aggregate(stats)
            moved = sum(total.data["bytes_transferred"]) if total is not None else 0
            if moved >= min_bytes or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        cls.collected = []
        return total.reduce() if total is not None else {}


async def _generate(engine, prompt, params, request_id):
    final = None
    async for out in engine.generate(prompt, params, request_id):
        final = out
    return final


async def _batch(engine, prompts, params):
    return await asyncio.gather(*(
        _generate(engine, p, q, f"r-{uuid.uuid4().hex[:12]}")
        for p, q in zip(prompts, params, strict=True)))


async def bench_connector(ckpt: Path, args) -> dict:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_omni_plugin.kv_transfer import (
        CONNECTOR_NAME,
        EXTRA_BOOTSTRAP_PORT,
        KV_TRANSFER_PARAMS,
        decode_request_params,
        prefill_request_params,
    )

    per_token = _kv_bytes_per_token(ckpt)
    blocks = args.prompt_len // args.block_size
    kv_bytes = args.requests * blocks * args.block_size * per_token
    cache = int(kv_bytes * 1.6) + (32 << 20)
    port = free_port()
    ids = {r: f"bench-{r}-{uuid.uuid4().hex[:8]}" for r in ("prefill", "decode")}

    def engine(name, kv_role, extra, stat_loggers=None):
        config = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role=kv_role,
                                  engine_id=ids[name], kv_connector_extra_config=extra)
        engine_args = AsyncEngineArgs(str(ckpt), **_engine_args(cache, args.block_size),
                                      kv_transfer_config=config, disable_log_stats=False)
        return AsyncLLM.from_engine_args(engine_args, stat_loggers=stat_loggers)

    prefill = engine("prefill", "kv_producer",
                     {"mooncake_protocol": "tcp", EXTRA_BOOTSTRAP_PORT: port}, [_TransferStats])
    decode = engine("decode", "kv_consumer", {"mooncake_protocol": "tcp"})
    rng = random.Random(0)

    def prompts(n):
        return [{"prompt_token_ids": [rng.randrange(0, 692) for _ in range(args.prompt_len)]}
                for _ in range(n)]

    prefill_engine = {"remote_engine_id": ids["prefill"],
                      "remote_bootstrap_addr": f"http://127.0.0.1:{port}"}

    def pd_params(n, new_tokens):
        transfer_ids = [uuid.uuid4().hex for _ in range(n)]
        pre = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                              extra_args={KV_TRANSFER_PARAMS: prefill_request_params(t)})
               for t in transfer_ids]
        dec = [SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                              extra_args={KV_TRANSFER_PARAMS: decode_request_params(
                                  t, prefill_engine)})
               for t in transfer_ids]
        return pre, dec

    try:
        walls, writes, descs, latency_local, latency_pd = [], [], [], [], []
        for trial in range(args.trials + 1):  # trial 0 warms both engines up
            batch = prompts(args.requests)
            pre, dec = pd_params(len(batch), 1)
            outs = await _batch(prefill, batch, pre)
            assert all(o.outputs[0].finish_reason == "length" for o in outs)
            await _TransferStats.take()
            start = time.perf_counter()
            outs = await _batch(decode, batch, dec)
            wall = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
            stats = await _TransferStats.take(kv_bytes)
            one = prompts(1)
            start = time.perf_counter()
            await _batch(decode, one, [SamplingParams(temperature=0.0, max_tokens=16,
                                                      ignore_eos=True)])
            local_s = time.perf_counter() - start
            pre, dec = pd_params(1, 16)
            start = time.perf_counter()
            await _batch(prefill, one, pre)
            await _batch(decode, one, dec)
            pd_s = time.perf_counter() - start
            write_rate = stats.get("Throughput (MB/s)", 0) * 2**20
            desc_bytes = (stats.get("Avg MB per transfer", 0) * 2**20
                          / max(stats.get("Avg number of descriptors", 1), 1))
            print(f"trial {trial}: decode wall {kv_bytes / wall / 1e9:.2f} GB/s, connector "
                  f"writes {write_rate / 1e9:.2f} GB/s ({stats}); latency local "
                  f"{local_s * 1e3:.0f} ms, PD {pd_s * 1e3:.0f} ms", file=sys.stderr)
            if trial:
                walls.append(kv_bytes / wall)
                writes.append(write_rate)
                descs.append(desc_bytes)
                latency_local.append(local_s)
                latency_pd.append(pd_s)
        return {"bytes": kv_bytes, "wall": statistics.median(walls),
                "writes": statistics.median(writes),
                "desc_bytes": int(statistics.median(descs)),
                "latency_local": statistics.median(latency_local),
                "latency_pd": statistics.median(latency_pd)}
    finally:
        decode.shutdown()
        prefill.shutdown()


def _raw_target(conn, nbytes: int) -> None:
    import torch
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    assert engine.register_memory(buf.data_ptr(), nbytes) == 0
    conn.send((engine.get_rpc_port(), buf.data_ptr()))
    conn.recv()  # until the initiator is done
    conn.send(int(buf[::4096].to(torch.int64).sum()))


def bench_raw(nbytes: int, num_descs: int, trials: int) -> float:
    import torch
    from mooncake.engine import TransferEngine

    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_raw_target, args=(child, nbytes))
    proc.start()
    try:
        rpc_port, remote = parent.recv()
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = torch.ones(nbytes, dtype=torch.uint8)
        assert engine.register_memory(src.data_ptr(), nbytes) == 0
        size = nbytes // num_descs
        offsets = [i * size for i in range(num_descs)]
        session = f"127.0.0.1:{rpc_port}"
        rates = []
        for trial in range(trials + 1):
            start = time.perf_counter()
            for at in range(0, num_descs, MAX_DESCS):
                part = offsets[at:at + MAX_DESCS]
                status = engine.batch_transfer_sync_write(
                    session, [src.data_ptr() + o for o in part], [remote + o for o in part],
                    [size] * len(part))
                assert status == 0, status
            if trial:
                rates.append(size * num_descs / (time.perf_counter() - start))
        parent.send("done")
        assert parent.recv() == len(range(0, size * num_descs, 4096))  # the bytes landed
        return statistics.median(rates)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def bench_raw_beside_busy_loops(nbytes: int, num_descs: int, trials: int,
                                busy: int = 2) -> float:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,)) for _ in range(busy)]
    for proc in spinners:
        proc.start()
    try:
        return bench_raw(nbytes, num_descs, trials)
    finally:
        stop.set()
        for proc in spinners:
            proc.join(30)


def bench_copy(nbytes: int, trials: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(trials):
        start = time.perf_counter()
        dst.copy_(src)
        rates.append(nbytes / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--requests", type=int, default=140,
                        help="prompts per trial (140 x 480 tokens = 65.6 MiB of KV)")
    parser.add_argument("--prompt-len", type=int, default=480,
                        help="tokens per prompt (a multiple of the block size, below 512)")
    parser.add_argument("--block-size", type=int, default=32,
                        help="KV cache block size of both engines (a multiple of 32 on "
                        "vLLM's CPU build); larger blocks make larger transfer descriptors")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "qwen3-omni"
        make_checkpoint(ckpt)
        connector = asyncio.run(bench_connector(ckpt, args))
    nbytes = connector["bytes"]
    desc = connector["desc_bytes"]
    raw = bench_raw(nbytes, nbytes // desc, args.trials)
    raw_busy = bench_raw_beside_busy_loops(nbytes, nbytes // desc, args.trials)
    copy = bench_copy(nbytes, max(5, args.trials))
    print(f"\nKV moved per trial: {nbytes / 2**20:.1f} MiB ({args.requests} prompts x "
          f"{args.prompt_len} tokens), medians of {args.trials} trials; the connector's "
          f"writes averaged {desc / 1024:.1f} KiB per descriptor, raw Mooncake used the same")
    print(f"{'path':<34}{'GB/s':>8}{'vs raw Mooncake':>18}")
    for name, rate in (("connector writes (vLLM's stats)", connector["writes"]),
                       ("decode engine wall (lower bound)", connector["wall"]),
                       ("raw Mooncake TCP loopback", raw),
                       ("raw Mooncake beside 2 busy loops", raw_busy),
                       ("torch copy_ (host memory)", copy)):
        print(f"{name:<34}{rate / 1e9:>8.2f}{rate / raw:>17.2f}x")
    print(f"\nlatency, 1 request of {args.prompt_len} tokens + 16 new: local "
          f"{connector['latency_local'] * 1e3:.0f} ms, prefill+decode "
          f"{connector['latency_pd'] * 1e3:.0f} ms "
          f"({connector['latency_pd'] / connector['latency_local']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
