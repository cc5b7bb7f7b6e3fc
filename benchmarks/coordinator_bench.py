#!/usr/bin/env python
"""OmniCoordinator benchmarks: this plugin vs upstream vllm-omni 0.30.0, side by side.

Run from the repository root with the project venv (upstream is loaded from a
side directory, see ``benchmarks/_upstream.py`` and ``benchmarks/README.md``):

    .venv/bin/python benchmarks/coordinator_bench.py [--upstream /tmp/vllm-omni-0.30.0]

Three measurements, each repeated with the two implementations interleaved
(order alternating per repetition), medians reported with the ratio
upstream/ours:

1. routing: microseconds per ``LoadBalancer.select(task, replicas)``;
2. throughput: replica events per second the coordinator applies with 1,000
   registered replicas, fed raw pre-encoded frames (each side's own wire
   format) from a sender subprocess;
3. visibility latency: queue-length change sent by a real stage client until a
   real hub client's cached list shows it, with 1,000 replicas registered.

Everything binds 127.0.0.1 with kernel-chosen ports. Every wait is bounded;
sockets, threads and the sender subprocesses are closed on every path.
"""

from __future__ import annotations

import os
import select
import struct
import sys
import time

# --------------------------------------------------------------------------
# Sender subprocess (``--sender``): pure zmq, no project or upstream imports.
# --------------------------------------------------------------------------

_REC = struct.Struct(">BI")  # socket index, payload length
_PHASE_MARK = 255


def _write_frames(path: str, phases: list[list[tuple[int, bytes]]]) -> None:
    with open(path, "wb") as f:
        for n, phase in enumerate(phases):
            if n:
                f.write(_REC.pack(_PHASE_MARK, 0))
            for sock, payload in phase:
                f.write(_REC.pack(sock, len(payload)))
                f.write(payload)


def _read_frames(path: str) -> list[list[tuple[int, bytes]]]:
    with open(path, "rb") as f:
        data = f.read()
    phases: list[list[tuple[int, bytes]]] = [[]]
    pos, size = 0, _REC.size
    while pos < len(data):
        sock, length = _REC.unpack_from(data, pos)
        pos += size
        if sock == _PHASE_MARK:
            phases.append([])
            continue
        phases[-1].append((sock, data[pos:pos + length]))
        pos += length
    return phases


class _Lines:
    """Line reader on a raw fd, usable with ``select`` (no hidden buffering)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.eof = False

    def readline(self, timeout: float | None) -> str | None:
        """One line (without newline); ``None`` on timeout; ``"quit"`` on EOF."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            if self.eof:
                return "quit"
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.fd], [], [], wait)
            if not ready:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                self.eof = True
                continue
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode().strip()


def _sender_main(argv: list[str]) -> int:
    """``--sender ADDR FRAMEFILE NSOCK MAX_SECONDS``.

    Connects NSOCK DEALERs to ADDR and sends phase 0 of FRAMEFILE (registration),
    then prints ``registered``. Commands on stdin, one per line:
    ``burst`` sends phase 1 once, as fast as the sockets take it (blocking
    sends, libzmq's default HWM 1000 per socket), then prints ``sent SECONDS``;
    ``pace RATE`` cycles through phase 1 at RATE frames/s until a ``stop`` line,
    then prints ``paced COUNT DROPPED``; ``quit`` (or EOF) exits. The process
    exits by itself after MAX_SECONDS.
    """
    import zmq

    addr, path, nsock, max_s = argv[0], argv[1], int(argv[2]), float(argv[3])
    deadline = time.monotonic() + max_s
    phases = _read_frames(path)
    ctx = zmq.Context()
    socks = []
    out = sys.stdout

    def say(msg: str) -> None:
        out.write(msg + "\n")
        out.flush()

    try:
        for _ in range(nsock):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, 30_000)  # a dead coordinator cannot hang us
            s.connect(addr)
            socks.append(s)
        for i, payload in phases[0]:
            socks[i].send(payload)
        say("registered")
        lines = _Lines(sys.stdin.fileno())
        while time.monotonic() < deadline:
            line = lines.readline(max(0.0, deadline - time.monotonic()))
            if line is None or line == "quit":
                break
            cmd = line.split()
            if cmd[0] == "burst":
                t0 = time.perf_counter()
                for i, payload in phases[1]:
                    socks[i].send(payload)
                say(f"sent {time.perf_counter() - t0:.6f}")
            elif cmd[0] == "pace":
                rate = float(cmd[1])
                frames = phases[1]
                n, sent, dropped = len(frames), 0, 0
                t0 = time.monotonic()
                while time.monotonic() < deadline:
                    if lines.readline(0.005) is not None:  # "stop" (or EOF)
                        break
                    due = int((time.monotonic() - t0) * rate) - sent
                    for _ in range(due):
                        i, payload = frames[sent % n]
                        try:
                            socks[i].send(payload, zmq.NOBLOCK)
                        except zmq.Again:
                            dropped += 1
                        sent += 1
                say(f"paced {sent} {dropped}")
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--sender"]:
    sys.exit(_sender_main(sys.argv[2:]))

# --------------------------------------------------------------------------
# Benchmark process
# --------------------------------------------------------------------------

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import timeit  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(HERE), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _upstream  # noqa: E402
import zmq  # noqa: E402
from _common import table  # noqa: E402

SEED = 20240607
N_STAGES = 3  # replicas spread over a 3-stage pipeline (Qwen3-Omni)


def _addr(i: int, port_base: int) -> str:
    return f"tcp://10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:{port_base + i % 20000}"


def replica_ids(n: int, tag: str = "") -> list[tuple[str, str, int]]:
    """(input_addr, output_addr, stage_id) of ``n`` realistic replicas."""
    return [
        (_addr(i, 40000) + tag, _addr(i, 60000) + tag, i % N_STAGES) for i in range(n)
    ]


# --------------------------------------------------------------------------
# The two implementations behind one interface
# --------------------------------------------------------------------------


class Side:
    """What the benchmarks need from one implementation."""

    name: str
    policies: tuple[str, ...] = ("random", "round-robin", "least-queue-length")

    def replica_info(self, ia, oa, sid, q, ts): ...
    def balancer(self, policy: str): ...
    def event_frame(self, ia, oa, sid, q, heartbeat: bool) -> bytes: ...
    def coordinator(self): ...
    def queue_length(self, coord, addr: str) -> int | None: ...
    def stage_client(self, router: str, ia: str, oa: str, sid: int): ...
    def hub_client(self, pub: str): ...
    def event_count(self, coord) -> tuple[int, int] | None: return None
    def publish_count(self, coord) -> int | None: return None

    def close(self, obj) -> None:
        if obj is None:
            return
        try:
            obj.close()
        except RuntimeError:  # upstream raises on a second close
            pass


class Ours(Side):
    name = "ours"

    def __init__(self) -> None:
        from vllm_omni_plugin import coordinator as oc
        from vllm_omni_plugin.wire.codec import encode

        self.m = oc
        self.encode = encode

    def replica_info(self, ia, oa, sid, q, ts):
        m = self.m
        return m.ReplicaInfo(ia, oa, sid, m.ReplicaStatus.UP, q, ts, ts - 60.0)

    def balancer(self, policy):
        m = self.m
        return {
            "random": lambda: m.RandomBalancer(seed=SEED),
            "round-robin": m.RoundRobinBalancer,
            "least-queue-length": lambda: m.LeastQueueLengthBalancer(seed=SEED),
        }[policy]()

    def event_frame(self, ia, oa, sid, q, heartbeat):
        m = self.m
        # Exactly what OmniCoordClientForStage._send_locked puts on the wire.
        return self.encode(m.ReplicaEvent(
            input_addr=ia, output_addr=oa, stage_id=sid, status=m.ReplicaStatus.UP,
            queue_length=q,
            event_type=m.EventType.HEARTBEAT if heartbeat else m.EventType.UPDATE,
        ))

    def coordinator(self):
        # Defaults (publish_min_interval 0.1 s, republish 1 s); no token.
        return self.m.OmniCoordinator(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_timeout=30.0, cluster_token=""
        )

    def queue_length(self, coord, addr):
        rec = coord._replicas.get(addr)  # private, read-only: a dict lookup, no lock
        return None if rec is None else rec.info.queue_length

    def n_up(self, coord) -> int:
        return len(coord.get_active_replicas().replicas)

    def publish_count(self, coord) -> int:
        return coord.stats["publishes"]

    def event_count(self, coord):
        """(events accepted, frames rejected) from the coordinator's stats."""
        s = coord.stats
        return s["events_accepted"], sum(v for k, v in s.items() if k.startswith("rejected."))

    def stage_client(self, router, ia, oa, sid):
        return self.m.OmniCoordClientForStage(
            router, ia, oa, sid, heartbeat_interval=5.0, cluster_token=""
        )

    def hub_client(self, pub):
        return self.m.OmniCoordClientForHub(pub, cluster_token="")


class Up(Side):
    name = "upstream"

    def __init__(self, up: _upstream.Upstream) -> None:
        self.up = up
        self.msg = up.messages
        self.lb = up.load_balancer

    def replica_info(self, ia, oa, sid, q, ts):
        return self.msg.ReplicaInfo(ia, oa, sid, self.msg.ReplicaStatus.UP, q, ts, ts - 60.0)

    def balancer(self, policy):
        lb = self.lb
        return {
            "random": lb.RandomBalancer,
            "round-robin": lb.RoundRobinBalancer,
            "least-queue-length": lb.LeastQueueLengthBalancer,
        }[policy]()

    def event_frame(self, ia, oa, sid, q, heartbeat):
        m = self.msg
        # Exactly what upstream's OmniCoordClientForStage._send_event sends.
        ev = m.ReplicaEvent(
            input_addr=ia, output_addr=oa, stage_id=sid,
            event_type="heartbeat" if heartbeat else "update",
            status=m.ReplicaStatus.UP, queue_length=q,
        )
        return json.dumps(asdict(ev)).encode("utf-8")

    def coordinator(self):
        return self.up.omni_coordinator.OmniCoordinator(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_timeout=30.0
        )

    def queue_length(self, coord, addr):
        info = coord._replicas.get(addr)  # private, read-only: a dict lookup, no lock
        return None if info is None else info.queue_length

    def n_up(self, coord) -> int:
        return len(coord.get_active_replicas().replicas)

    def stage_client(self, router, ia, oa, sid):
        return self.up.client_for_stage.OmniCoordClientForStage(router, ia, oa, sid)

    def hub_client(self, pub):
        return self.up.client_for_hub.OmniCoordClientForHub(pub)


def _pct(values: list[float], p: float) -> float:
    """Percentile ``p`` (0-100) with linear interpolation."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _orders(sides: list[Side], reps: int) -> list[list[Side]]:
    return [sides if r % 2 == 0 else sides[::-1] for r in range(reps)]


def _wait(pred, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


# --------------------------------------------------------------------------
# 1. Routing cost
# --------------------------------------------------------------------------


def bench_routing(sides: list[Side], sizes: list[int], reps: int, target_s: float,
                  wall: bool = False) -> str:
    rng = random.Random(SEED)
    clock = time.perf_counter if wall else time.thread_time
    task = {"request_id": "chatcmpl-3f9c2a7e41d04b0c9a4c6f1e2d3b5a79"}
    now = time.time()
    rows = []
    raw: dict = {}
    for n in sizes:
        ids = replica_ids(n)
        # Mixed load: queue lengths 0..16 (a busy pool; few ties at the minimum
        # for small n, ~n/17 for large n). "all idle": every queue 0 (all tie).
        loads = {
            "mixed": [rng.randint(0, 16) for _ in range(n)],
            "idle": [0] * n,
        }
        cells = [(p, "mixed") for p in Side.policies] + [("least-queue-length", "idle")]
        for policy, load in cells:
            lists, timers = {}, {}
            for side in sides:
                reps_list = [
                    side.replica_info(ia, oa, sid, q, now)
                    for (ia, oa, sid), q in zip(ids, loads[load], strict=True)
                ]
                sel = side.balancer(policy).select
                # sanity: valid index; least-queue-length picks a minimum
                for _ in range(50):
                    idx = sel(task, reps_list)
                    assert 0 <= idx < n
                    if policy == "least-queue-length":
                        assert reps_list[idx].queue_length == min(loads[load])
                lists[side.name] = reps_list
                # CPU time of this thread, not wall time: on a shared machine a
                # run preempted by another process is not charged for the wait.
                timers[side.name] = timeit.Timer(
                    "sel(task, replicas)", timer=clock,
                    globals={"sel": sel, "task": task, "replicas": reps_list},
                )
            # one loop count for both sides: the slower side's ~target_s
            number = 1
            while True:
                t = max(timers[s.name].timeit(number) for s in sides)
                if t >= target_s / 4 or number >= 10**7:
                    break
                number *= 4
            number = max(1, int(number * target_s / max(t, 1e-9)))
            per: dict[str, list[float]] = {s.name: [] for s in sides}
            for order in _orders(sides, reps):
                for side in order:
                    per[side.name].append(timers[side.name].timeit(number) / number * 1e6)
            med = {k: statistics.median(v) for k, v in per.items()}
            ratio = med["upstream"] / med["ours"]
            label = policy if load == "mixed" else f"{policy} (all idle: ties)"
            raw[(label, n)] = per
            mins = {k: min(v) for k, v in per.items()}
            rows.append([
                label, str(n), f"{med['ours']:.3f}", f"{med['upstream']:.3f}", f"{ratio:.2f}",
                f"{med['ours'] / med['upstream']:.2f}", f"{mins['ours'] / mins['upstream']:.2f}",
                "yes" if med["ours"] <= 0.5 * med["upstream"] else "NO",
            ])
    order = [*Side.policies, "least-queue-length (all idle: ties)"]
    rows.sort(key=lambda r: (order.index(r[0]), int(r[1])))
    return table(
        ["policy", "replicas", "ours µs", "upstream µs", "up/ours", "ours/up", "ours/up (min)",
         "ours ≤ 0.5× up"],
        rows,
        title=(f"1. Routing cost, µs per select(task, replicas) "
               f"(median of {reps} interleaved timeit runs, each ~{target_s * 1e3:.0f} ms "
               f"of {'wall' if wall else 'thread CPU'} time)"),
    )


# --------------------------------------------------------------------------
# Sender subprocess handle
# --------------------------------------------------------------------------


class Sender:
    """A ``--sender`` subprocess (we started it; we stop it by its pid)."""

    def __init__(self, addr: str, frame_file: str, nsock: int, max_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--sender", addr, frame_file,
             str(nsock), str(max_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise TimeoutError(f"sender: no {prefix!r} within {timeout}s")
        line = self.proc.stdout.readline().strip()
        if not line.startswith(prefix):
            raise RuntimeError(f"sender said {line!r}, expected {prefix!r}")
        return line

    def cmd(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("quit")
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


# --------------------------------------------------------------------------
# 2. Event throughput
# --------------------------------------------------------------------------

N_REPLICAS = 1000
SENTINEL_Q = 900_000


def _tp_frames(side: Side, n: int, rounds: int, nsock: int) -> tuple[list, dict]:
    """Phase 0: one UP ``update`` per replica. Phase 1: ``rounds`` heartbeats per
    replica (queue length changes every time), then one sentinel heartbeat per
    socket. Replica i always goes through socket ``i % nsock`` (FIFO per replica).
    Returns the phases and the expected final queue length per replica."""
    ids = replica_ids(n)
    reg = [(i % nsock, side.event_frame(ia, oa, sid, 0, False))
           for i, (ia, oa, sid) in enumerate(ids)]
    burst = []
    final = {}
    for k in range(rounds):
        for i, (ia, oa, sid) in enumerate(ids):
            q = (k * 7 + i) % 31
            burst.append((i % nsock, side.event_frame(ia, oa, sid, q, True)))
            final[ia] = q
    for d in range(nsock):
        ia, oa, sid = ids[d]
        burst.append((d, side.event_frame(ia, oa, sid, SENTINEL_Q + d, True)))
        final[ia] = SENTINEL_Q + d
    return [reg, burst], final


class _BareRouter:
    """Ceiling reference: a ROUTER thread that only receives and counts frames."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.bind("tcp://127.0.0.1:*")
        self.router_zmq_addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.count = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        recv = self.sock.recv_multipart
        while not self._stop:
            try:
                recv()
            except zmq.Again:
                continue
            self.count += 1

    def close(self) -> None:
        self._stop = True
        self.thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()


def _tp_trial(side, frame_file: str, final: dict, nsock: int, n_burst: int,
              timeout: float) -> dict:
    bare = side == "bare"
    coord = _BareRouter() if bare else side.coordinator()
    sender = None
    try:
        sender = Sender(coord.router_zmq_addr, frame_file, nsock, max_s=timeout + 60)
        sender.expect("registered")
        if bare:
            ok = _wait(lambda: coord.count >= N_REPLICAS, 30)
        else:
            ok = _wait(lambda: side.n_up(coord) == N_REPLICAS, 30, 0.02)
        if not ok:
            raise RuntimeError("replicas did not register within 30 s")
        before = coord.count if bare else side.event_count(coord)
        sentinels = [ia for ia, _, _ in replica_ids(nsock)]
        if bare:
            target = N_REPLICAS + n_burst
            done = lambda: coord.count >= target  # noqa: E731
        else:
            ql = side.queue_length
            done = lambda: all(  # noqa: E731
                ql(coord, a) == SENTINEL_Q + d for d, a in enumerate(sentinels)
            )
        gc.collect()
        c0 = time.process_time()  # this process: coordinator threads + its zmq I/O thread
        t0 = time.perf_counter()
        sender.cmd("burst")
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                who = getattr(side, "name", side)
                raise TimeoutError(f"{who}: burst not applied in {timeout}s")
            time.sleep(0.002)
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        send_s = float(sender.expect("sent", 30).split()[1])
        res = {"rate": n_burst / elapsed, "elapsed": elapsed, "send_s": send_s,
               "cpu_us": cpu / n_burst * 1e6}
        if not bare:
            bad = sum(1 for a, q in final.items() if side.queue_length(coord, a) != q)
            res["wrong_final"] = bad
            after = side.event_count(coord)
            if after is not None and before is not None:
                res["counted"] = after[0] - before[0]
                res["rejected"] = after[1] - before[1]
        return res
    finally:
        if sender is not None:
            sender.stop()
        coord.close() if bare else side.close(coord)


def bench_throughput(sides: list[Side], rounds: int, reps: int, nsock: int,
                     tmp: Path, with_bare: bool) -> str:
    files, finals = {}, {}
    for side in sides:
        phases, finals[side.name] = _tp_frames(side, N_REPLICAS, rounds, nsock)
        files[side.name] = str(tmp / f"tp-{side.name}.frames")
        _write_frames(files[side.name], phases)
        sizes = [len(p) for _, p in phases[1]]
        print(f"   {side.name}: event frame {statistics.median(sizes):.0f} B "
              f"(median), {len(phases[1])} frames per burst", flush=True)
    n_burst = rounds * N_REPLICAS + nsock
    entries: list = list(sides) + (["bare"] if with_bare else [])
    res: dict[str, list[dict]] = {(e if e == "bare" else e.name): [] for e in entries}
    for r, order in enumerate(_orders(entries, reps)):
        for e in order:
            key = e if e == "bare" else e.name
            ff = files["ours"] if e == "bare" else files[key]
            out = _tp_trial(e, ff, finals.get(key, {}), nsock, n_burst, timeout=120)
            res[key].append(out)
            extra = ""
            if "wrong_final" in out:
                extra = f", final state wrong for {out['wrong_final']} replicas"
            if "counted" in out:
                extra += f", stats: +{out['counted']} accepted, +{out['rejected']} rejected"
            print(f"   rep {r + 1} {key:9s} {out['rate']:9.0f} ev/s  "
                  f"{out['cpu_us']:5.2f} CPU-µs/ev "
                  f"({out['elapsed']:.2f} s; sender done after {out['send_s']:.2f} s{extra})",
                  flush=True)
    med = {k: statistics.median(o["rate"] for o in v) for k, v in res.items()}
    cpu = {k: statistics.median(o["cpu_us"] for o in v) for k, v in res.items()}
    rows = []
    for k in ["ours", "upstream"] + (["bare"] if with_bare else []):
        rates = [o["rate"] for o in res[k]]
        label = {"bare": "ceiling: bare ROUTER recv loop"}.get(k, k)
        rows.append([
            label, f"{med[k]:,.0f}", f"{min(rates):,.0f}", f"{max(rates):,.0f}",
            f"{statistics.median(o['elapsed'] for o in res[k]):.2f}", f"{cpu[k]:.2f}",
            f"{1e6 / cpu[k]:,.0f}",
        ])
    ratio = med["upstream"] / med["ours"]
    t = table(
        ["coordinator", "events/s (median)", "min", "max", "s per burst", "CPU-µs/event",
         "events/CPU-s"],
        rows,
        title=(f"2. Event throughput, {N_REPLICAS} registered replicas, burst of "
               f"{n_burst:,} heartbeats (queue length changes every event) over "
               f"{nsock} DEALERs, {reps} interleaved reps"),
    )
    verdict = "yes" if med["ours"] >= 2 * med["upstream"] else "NO"
    wrong = {k: sum(o.get("wrong_final", 0) for o in v) for k, v in res.items() if k != "bare"}
    cratio = cpu["ours"] / cpu["upstream"]
    return (t + f"\nwall events/s: up/ours = {ratio:.2f} (ours/up = {1 / ratio:.2f}); "
            f"target ours ≥ 2× upstream: {verdict}"
            f"\nCPU per event: up/ours = {1 / cratio:.2f} (process CPU time of the coordinator "
            f"process during the burst: coordinator threads, zmq I/O thread, 2 ms poll loop)"
            f"\nfinal registry state checked after every rep: wrong replicas "
            + ", ".join(f"{k} {v}" for k, v in wrong.items()))


# --------------------------------------------------------------------------
# 3. Heartbeat-to-hub visibility latency
# --------------------------------------------------------------------------

PROBE = ("tcp://10.255.0.1:41000", "tcp://10.255.0.1:61000", 0)


def _lat_frames(side: Side, n_other: int, rounds: int) -> list:
    ids = replica_ids(n_other, tag="")
    reg = [(i % 4, side.event_frame(ia, oa, sid, 0, False)) for i, (ia, oa, sid) in enumerate(ids)]
    bg = [
        (i % 4, side.event_frame(ia, oa, sid, (k * 7 + i) % 31, True))
        for k in range(rounds) for i, (ia, oa, sid) in enumerate(ids)
    ]
    return [reg, bg]


def _find_q(replicas, addr: str) -> int | None:
    if replicas and replicas[0].input_addr == addr:
        return replicas[0].queue_length
    for r in replicas:
        if r.input_addr == addr:
            return r.queue_length
    return None


def _lat_trial(side: Side, frame_file: str, loads: list[tuple[str, float]], samples: int,
               rng: random.Random, q_base: int, gap: tuple[float, float]) -> dict[str, dict]:
    coord = hub = probe = sender = None
    out: dict[str, dict] = {}
    try:
        coord = side.coordinator()
        hub = side.hub_client(coord.pub_zmq_addr)
        probe = side.stage_client(coord.router_zmq_addr, *PROBE)
        if not _wait(lambda: side.queue_length(coord, PROBE[0]) is not None, 10):
            raise RuntimeError("probe did not register")
        sender = Sender(coord.router_zmq_addr, frame_file, 4, max_s=600)
        sender.expect("registered")

        def hub_sees(n):
            return len(hub.get_replica_list().replicas) == n

        if not _wait(lambda: hub_sees(N_REPLICAS), 20, 0.02):
            raise RuntimeError("hub did not see all replicas within 20 s")
        q = q_base
        for load, rate in loads:
            if rate:
                sender.cmd(f"pace {rate}")
                time.sleep(0.5)  # let the background settle into its rhythm
            lat, misses = [], 0
            published, phase_start = side.publish_count(coord), time.perf_counter()
            for _ in range(samples):
                # Random gap (> publish_min_interval): isolated changes, de-phased
                # from both coordinators' 0.1 s publish cadence.
                time.sleep(rng.uniform(*gap))
                q += 1
                t0 = time.perf_counter()
                probe.update_info(queue_length=q)
                deadline = t0 + 2.0
                while True:
                    if _find_q(hub.get_replica_list().replicas, PROBE[0]) == q:
                        lat.append((time.perf_counter() - t0) * 1e3)
                        break
                    if time.perf_counter() > deadline:
                        misses += 1
                        break
                    time.sleep(0.0005)
            extra = {}
            if published is not None:
                # intervals between broadcasts per second (n broadcasts span n - 1)
                extra["broadcasts_per_s"] = (max(0, side.publish_count(coord) - published - 1)
                                             / (time.perf_counter() - phase_start))
            if rate:
                sender.cmd("stop")
                _, sent, dropped = sender.expect("paced", 30).split()
                elapsed_rate = int(sent)
                extra.update(bg_sent=elapsed_rate, bg_dropped=int(dropped))
            out[load] = {"lat": lat, "misses": misses, **extra}
        return out
    finally:
        if sender is not None:
            sender.stop()
        side.close(probe)
        side.close(hub)
        side.close(coord)


def bench_latency(sides: list[Side], reps: int, samples: int, bg_rate: float, tmp: Path,
                  gap: tuple[float, float]) -> str:
    files = {}
    for side in sides:
        files[side.name] = str(tmp / f"lat-{side.name}.frames")
        _write_frames(files[side.name], _lat_frames(side, N_REPLICAS - 1, rounds=10))
    loads = [("idle", 0.0), (f"{bg_rate:g} ev/s background", bg_rate)]
    acc: dict[tuple[str, str], dict] = {}
    rng = random.Random(SEED)
    for r, order in enumerate(_orders(sides, reps)):
        for side in order:
            res = _lat_trial(side, files[side.name], loads, samples, rng,
                             q_base=1000 + r * 10_000, gap=gap)
            for load, v in res.items():
                a = acc.setdefault((side.name, load), {"lat": [], "misses": 0, "bg_dropped": 0,
                                                       "rates": []})
                a["lat"] += v["lat"]
                if "broadcasts_per_s" in v:
                    a["rates"].append(v["broadcasts_per_s"])
                a["misses"] += v["misses"]
                a["bg_dropped"] += v.get("bg_dropped", 0)
                worst = max(v["lat"], default=float("nan"))
                print(f"   rep {r + 1} {side.name:8s} {load:22s} p50 {_pct(v['lat'], 50):6.1f} ms  "
                      f"p99 {_pct(v['lat'], 99):6.1f} ms  max {worst:6.1f} ms"
                      f"  misses {v['misses']}", flush=True)
    rows = []
    for load, _ in loads:
        p = {}
        for name in ("ours", "upstream"):
            a = acc[(name, load)]
            lat = a["lat"]
            p[name] = (_pct(lat, 50), _pct(lat, 99))
            met, rate = "-", ""
            if name == "ours":
                # idle: a single change is published at once (leading edge);
                # background: bursts are coalesced, at most 10 broadcasts/s
                limit = 20 if load == "idle" else 150
                rate_s = max(a["rates"], default=float("nan"))
                ok = p[name][1] <= limit and not a["misses"] and (load == "idle" or rate_s <= 10)
                met = f"{'yes' if ok else 'NO'} (p99 ≤ {limit})"
                rate = f"{rate_s:.1f}"
            rows.append([
                load, name, str(len(lat)), f"{_pct(lat, 50):.1f}", f"{_pct(lat, 90):.1f}",
                f"{_pct(lat, 99):.1f}", f"{max(lat, default=float('nan')):.1f}", str(a["misses"]),
                rate, met,
            ])
        rows.append([load, "up/ours", "", f"{p['upstream'][0] / p['ours'][0]:.2f}", "",
                     f"{p['upstream'][1] / p['ours'][1]:.2f}", "", "", "", ""])
    return table(
        ["background", "side", "n", "p50 ms", "p90 ms", "p99 ms", "max ms", "misses",
         "bcast/s max", "target"],
        rows, left=2,
        title=(f"3. Visibility latency: stage client update_info(queue_length) → hub client's "
               f"cached list, {N_REPLICAS} replicas, {reps} interleaved reps × {samples} samples, "
               f"gap {gap[0] * 1e3:.0f}-{gap[1] * 1e3:.0f} ms"),
    )


# --------------------------------------------------------------------------


def _env_line(up: _upstream.Upstream) -> str:
    import msgspec

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    la = os.getloadavg()
    return (
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} | {platform.node()} | {cpu}, "
        f"{os.cpu_count()} CPUs, loadavg {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}\n"
        f"Python {platform.python_version()}, pyzmq {zmq.__version__} "
        f"(libzmq {zmq.zmq_version()}), msgspec {msgspec.__version__}\n"
        f"upstream vllm-omni {up.version or '?'} from {up.source} (loaded: {up.mode})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", default=None,
                    help=f"dir with vllm_omni/, dir with the wheel, or the .whl "
                         f"(default ${_upstream.ENV} or {_upstream.DEFAULT_LOCATION})")
    ap.add_argument("--upstream-import", choices=("files", "package"), default="files",
                    help="how to load upstream (see benchmarks/_upstream.py)")
    ap.add_argument("--only", default="routing,throughput,latency",
                    help="comma-separated subset of routing,throughput,latency")
    ap.add_argument("--routing-reps", type=int, default=15)
    ap.add_argument("--routing-target-ms", type=float, default=10.0)
    ap.add_argument("--routing-wall", action="store_true",
                    help="time routing in wall time instead of thread CPU time")
    ap.add_argument("--tp-reps", type=int, default=7)
    ap.add_argument("--tp-rounds", type=int, default=100,
                    help="heartbeats per replica per burst (burst = rounds × 1000 + senders)")
    ap.add_argument("--tp-senders", type=int, default=8, help="DEALER sockets in the sender")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the bare-ROUTER reference row")
    ap.add_argument("--lat-reps", type=int, default=4)
    ap.add_argument("--lat-samples", type=int, default=50, help="per rep and background load")
    ap.add_argument("--bg-rate", type=float, default=200.0,
                    help="background heartbeats/s from the other 999 replicas "
                         "(1000 replicas × 1 per 5 s = 200)")
    ap.add_argument("--lat-gap-ms", default="100,300",
                    help="random gap between latency samples, uniform in [MIN,MAX] ms")
    ap.add_argument("--quick", action="store_true", help="tiny run for a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.routing_reps, args.routing_target_ms = 3, 5.0
        args.tp_reps, args.tp_rounds = 1, 10
        args.lat_reps, args.lat_samples = 1, 5
    only = set(args.only.split(","))

    try:
        up = _upstream.load(args.upstream, args.upstream_import)
    except _upstream.UpstreamMissing as e:
        print(f"coordinator_bench: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # --upstream-import package without upstream's dependencies
        print(f"coordinator_bench: importing upstream as a package failed: {e!r}\n"
              f"use the default --upstream-import files (see benchmarks/_upstream.py)",
              file=sys.stderr)
        return 2
    sides: list[Side] = [Ours(), Up(up)]
    heavy = [m for m in ("vllm", "torch", "vllm_omni") if m in sys.modules]
    t_start = time.monotonic()
    print(_env_line(up))
    print(f"heavy modules imported in this process: {heavy or 'none'}")
    if up.version != _upstream.EXPECTED_VERSION:
        print(f"WARNING: upstream version {up.version}, expected {_upstream.EXPECTED_VERSION}")
    print()
    threads_before = set(threading.enumerate())
    with tempfile.TemporaryDirectory(prefix="coord-bench-") as tmpd:
        tmp = Path(tmpd)
        if "routing" in only:
            print(bench_routing(sides, [8, 64, 512], args.routing_reps,
                                args.routing_target_ms / 1e3, wall=args.routing_wall), flush=True)
            print(flush=True)
        if "throughput" in only:
            print("2. Event throughput (per rep):", flush=True)
            print(bench_throughput(sides, args.tp_rounds, args.tp_reps, args.tp_senders, tmp,
                                   with_bare=not args.no_ceiling), flush=True)
            print(flush=True)
        if "latency" in only:
            print("3. Visibility latency (per rep):", flush=True)
            gap = tuple(float(x) / 1e3 for x in args.lat_gap_ms.split(","))
            print(bench_latency(sides, args.lat_reps, args.lat_samples, args.bg_rate, tmp, gap),
                  flush=True)
            print(flush=True)
    leftover = [t.name for t in threading.enumerate() if t not in threads_before]
    la = os.getloadavg()
    print(f"total {time.monotonic() - t_start:.0f} s; loadavg at end {la[0]:.2f} {la[1]:.2f} "
          f"{la[2]:.2f}; threads left running: {leftover or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
