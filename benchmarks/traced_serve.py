"""``vllm serve`` in this process, with a thread that writes what the API server's memory
holds every ``--interval`` seconds: a benchmark-only probe for memory growth (nothing of
it is in the package).

    .venv/bin/python benchmarks/traced_serve.py --out DIR [--start-after S] \\
        [--start-file PATH] [--idle-file PATH] [--interval 60] [--trim] \\
        -- serve CKPT [vllm serve args]

``soak_bench.py --trace DIR`` runs its server this way. Once ``--start-after`` seconds
passed and ``--start-file`` exists (start-up and a warm-up done), the thread unfreezes
the start-up heap vLLM's API server froze (``gc.freeze()`` hides it from
``gc.get_objects()``: the orchestrator, pools, ``AsyncLLM`` and their collections;
``--keep-frozen`` leaves it frozen), starts ``tracemalloc``, takes a baseline and writes
``DIR/baseline.done``. Then, each interval, it appends a line to ``DIR/samples.jsonl``
and writes ``DIR/sample-NNN.txt``, and once ``--idle-file`` exists, one more sample,
``DIR/sample-idle.txt``, then ``DIR/idle.done`` (``soak_bench.py`` creates the start
and idle files while no request is in flight, so that those two compare like with
like). Each sample, against the baseline:

* the RSS (anonymous, file-backed), glibc's heap in use and free in its arenas
  (``mallinfo2``: free but not given back is fragmentation), the traced Python heap,
  the number of objects the collector tracks;
* the source lines whose allocations grew most (``tracemalloc``), and where the blocks
  of the top five come from;
* object counts by type that grew most;
* the sizes of dicts, sets, lists and deques held as attributes by vLLM's and the
  plugin's objects that were there at the baseline (the orchestrator's ``_runs``, the
  pools' affinity, vLLM's request states...) that grew. The probe keeps those objects
  alive, so that a new object cannot take the id of one of them.

``--trim`` calls glibc's ``malloc_trim(0)`` before each sample and records the RSS
before and after: a growth that trimming takes back is free memory glibc kept, not
live objects. A sample takes seconds to tens of seconds with the GIL held (some 800,000
objects), and tracing slows the server several times. Forked children (vLLM's
EngineCores, when forked) stop tracing at once.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import linecache
import os
import sys
import threading
import time
import traceback
import tracemalloc
from collections import Counter, deque
from pathlib import Path

#: modules whose objects' container attributes are measured
OWN_MODULES = ("vllm", "vllm_omni_plugin")
TOP = 25


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def rss_mb() -> dict:
    """This process's ``VmRSS`` and its parts ``RssAnon`` and ``RssFile``, MB."""
    wanted = {"VmRSS:": "rss_mb", "RssAnon:": "anon_mb", "RssFile:": "file_mb"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(maxsplit=1)[0]
            if key in wanted:
                out[wanted[key]] = int(line.split()[1]) / 1024
    return out


def mallinfo_mb(libc) -> dict:
    """glibc's heap (every arena): ``in_use``, ``free`` (kept in arenas), ``mmapped``."""
    if libc is None:
        return {}
    info = libc.mallinfo2()
    return {"in_use": info.uordblks / 2**20, "free": info.fordblks / 2**20,
            "mmapped": info.hblkhd / 2**20}


def census(baseline: dict[int, object] | None = None
           ) -> tuple[int, Counter, dict[str, int], dict[int, object]]:
    """One pass over ``gc.get_objects()``: how many objects, their counts by type, and
    ``module.Class@id.attr`` -> len for every dict/set/list/deque attribute of the objects
    of :data:`OWN_MODULES`' classes, and those objects by id. With ``baseline`` (the
    latter of an earlier census, which keeps them alive so that no new object takes an
    id of theirs) only the objects in it are measured."""
    objects = gc.get_objects()
    counts: Counter = Counter()
    sizes = {}
    own = {}
    for obj in objects:
        t = type(obj)
        module = t.__dict__.get("__module__")  # (a class attribute, not a descriptor)
        if not isinstance(module, str):
            module = t.__module__ if isinstance(t.__module__, str) else "?"
        counts[f"{module}.{t.__qualname__}"] += 1
        if not module.startswith(OWN_MODULES) or isinstance(obj, type):
            continue
        if baseline is not None and baseline.get(id(obj)) is not obj:
            continue
        try:
            attrs = list(vars(obj).items())
        except TypeError:
            continue
        own[id(obj)] = obj
        for name, value in attrs:
            if isinstance(value, (dict, set, list, deque)):
                try:
                    sizes[f"{module}.{t.__qualname__}@{id(obj):x}.{name}"] = len(value)
                except Exception:  # noqa: BLE001 - changed while read
                    pass
    total = len(objects)
    del objects
    return total, counts, sizes, own


#: files whose allocations the listings leave out (the probe's own, tracemalloc's)
_SKIPPED = (__file__, linecache.__file__, tracemalloc.__file__, "<frozen importlib._bootstrap>",
            "<frozen importlib._bootstrap_external>", "<unknown>")


def _own(stat) -> bool:
    """Whether a tracemalloc statistic is the probe's (or tracemalloc's) own allocation."""
    return any(frame.filename in _SKIPPED for frame in stat.traceback)


class Probe(threading.Thread):
    def __init__(self, out: Path, start_after: float, start_file: Path | None,
                 idle_file: Path | None, interval: float, trim: bool, frames: int,
                 unfreeze: bool) -> None:
        super().__init__(name="memory-probe", daemon=True)
        self.out, self.start_after, self.interval = out, start_after, interval
        self.start_file, self.idle_file, self.unfreeze = start_file, idle_file, unfreeze
        self.trim, self.frames = trim, frames
        self.libc = _libc()

    def run(self) -> None:
        try:
            self._run()
        except BaseException:
            # a probe that failed must not leave the server traced (and slowed)
            tracemalloc.stop()
            (self.out / "probe.error").write_text(traceback.format_exc())
            raise

    def _run(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        time.sleep(self.start_after)
        while self.start_file is not None and not self.start_file.exists():
            time.sleep(0.5)
        if self.unfreeze:
            # vLLM's API server freezes its start-up heap (gc.freeze()), which hides it
            # from gc.get_objects(): the orchestrator, pools, AsyncLLM and their
            # collections with it
            gc.unfreeze()
        tracemalloc.start(self.frames)
        base_snap = tracemalloc.take_snapshot()
        base_census = census()
        base = self._measure(t0, 0, None, base_census[0])
        self._write_jsonl(base)
        (self.out / "baseline.done").touch()
        n, idle_done = 0, False
        due = time.monotonic() + self.interval
        while True:
            time.sleep(0.5)
            name = None
            if not idle_done and self.idle_file is not None and self.idle_file.exists():
                name, idle_done = "idle", True
            elif time.monotonic() >= due:
                n += 1
                name = f"{n:03d}"
            if name is None:
                continue
            try:
                self._sample(t0, name, base, base_snap, base_census)
            except Exception as exc:  # noqa: BLE001 - a probe must not stop the server
                (self.out / f"sample-{name}.error").write_text(repr(exc))
            if name == "idle":
                (self.out / "idle.done").touch()
            else:
                due = time.monotonic() + self.interval

    def _measure(self, t0: float, n, trimmed: tuple | None, objects: int) -> dict:
        traced, _ = tracemalloc.get_traced_memory()
        record = {"sample": n, "seconds": round(time.monotonic() - t0, 1),
                  **rss_mb(), "traced_mb": traced / 2**20, "gc_objects": objects,
                  **mallinfo_mb(self.libc)}
        if trimmed is not None:
            record["rss_before_trim_mb"], record["rss_after_trim_mb"] = trimmed
        return record

    def _write_jsonl(self, record: dict) -> None:
        with open(self.out / "samples.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _sample(self, t0, n, base, base_snap, base_census) -> None:
        trimmed = None
        if self.trim and self.libc is not None:
            before = rss_mb()["rss_mb"]
            self.libc.malloc_trim(0)
            trimmed = (before, rss_mb()["rss_mb"])
        objects, types, sizes, _ = census(base_census[3])
        record = self._measure(t0, n, trimmed, objects)
        self._write_jsonl(record)
        lines = [f"sample {n} at {record['seconds']:.0f} s since start (baseline at "
                 f"{base['seconds']:.0f} s)"]
        for key in ("rss_mb", "anon_mb", "file_mb", "in_use", "free", "mmapped",
                    "traced_mb", "gc_objects"):
            if key in record:
                lines.append(f"  {key:12s} {record[key]:14.1f}  ({record[key] - base[key]:+.1f})")
        if trimmed:
            lines.append(f"  malloc_trim: RSS {trimmed[0]:.1f} -> {trimmed[1]:.1f} MB")
        snap = tracemalloc.take_snapshot()
        lines.append("\ntracemalloc, top lines by growth since the baseline:")
        stats = [st for st in snap.compare_to(base_snap, "lineno") if not _own(st)][:TOP]
        lines += [f"  {st}" for st in stats]
        lines.append("\ntracemalloc, where the top 5 lines' blocks come from now:")
        # (a traceback's frames run from the oldest to the most recent)
        top = {(st.traceback[-1].filename, st.traceback[-1].lineno) for st in stats[:5]}
        for st in snap.statistics("traceback"):
            if (st.traceback[-1].filename, st.traceback[-1].lineno) in top and not _own(st):
                lines.append(f"  {st.size / 1024:.1f} KiB in {st.count} blocks:")
                lines += [f"      {f}" for f in st.traceback.format(limit=self.frames)]
        del snap, stats
        base_types, base_sizes = base_census[1], base_census[2]
        grown = sorted(((types[k] - base_types.get(k, 0), k) for k in types), reverse=True)
        lines.append("\nobjects by type, growth since the baseline (now):")
        lines += [f"  {d:+8d}  {k} ({types[k]})" for d, k in grown[:TOP] if d > 0]
        # objects made since the baseline are mostly requests in flight: only those that
        # were there at the baseline (kept alive by base_census)
        changed = sorted(((v - base_sizes.get(k, 0), k) for k, v in sizes.items()),
                         reverse=True)
        lines.append("\ncontainer attributes of vLLM / plugin objects that were there at the "
                     "baseline, growth since (now):")
        lines += [f"  {d:+8d}  {k} ({sizes[k]})" for d, k in changed[:TOP] if d > 0]
        (self.out / f"sample-{n}.txt").write_text("\n".join(lines) + "\n")


def _stop_tracing_in_child() -> None:
    if tracemalloc.is_tracing():
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--start-after", type=float, default=0)
    parser.add_argument("--start-file", type=Path, help="wait for this file to exist")
    parser.add_argument("--idle-file", type=Path,
                        help="once this file exists, take one more sample (sample-idle.txt)")
    parser.add_argument("--interval", type=float, default=60)
    parser.add_argument("--frames", type=int, default=8, help="tracemalloc frames")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) before samples")
    parser.add_argument("--keep-frozen", action="store_true",
                        help="leave vLLM's frozen start-up heap frozen (object counts and "
                             "collection sizes then see only objects made after it)")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    rest = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    os.register_at_fork(after_in_child=_stop_tracing_in_child)
    Probe(args.out, args.start_after, args.start_file, args.idle_file, args.interval,
          args.trim, args.frames, not args.keep_frozen).start()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *rest]
    vllm_main()


if __name__ == "__main__":
    main()
