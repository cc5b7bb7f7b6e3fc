"""Text chat throughput: the plugin's pipeline vs plain ``vllm serve``, one server at a time.

Both servers serve the same tiny Qwen3-Omni checkpoint on the same vLLM build:

* **plain**: ``vllm serve CKPT`` with the plugin switched off (``VLLM_PLUGINS=none``):
  vLLM's own ``Qwen3OmniMoeThinkerForConditionalGeneration`` on vLLM's worker;
* **plugin**: ``vllm serve CKPT --stage-configs-path qwen3_omni_moe``:
  the thinker stage (vLLM's class, extended, on the plugin's ``OmniWorker``) answering
  text, with the talker and code2wav engines started and idle.

How it measures, and why. On a 2-core host two servers side by side, or a head whose
processes float over both cores, swing up to 8x between trials (15.7-119.4 req/s for
plain vLLM alone), far more than the difference sought. So each server runs alone (the
other stopped), in alternating phases (``--phases``: plain, plugin, plain, plugin, ...),
and on a host with 2 cores the server runs under ``taskset -c 1`` (``--pin``): its API
server, EngineCores and workers (vLLM's CPU worker binds its OpenMP threads within the
cores it may use) share core 1, and the load generator has core 0. Each phase starts
its server, warms it up with four waves of chats, then runs ``--trials`` trials of
``--requests`` chats (``max_tokens`` ``--max-tokens``, ``ignore_eos``, greedy, so every
chat generates the same number of tokens) with
``--concurrency`` in flight, and prints every trial: requests/s and the CPU time per
request (user + system, ms; medians in the summary) of the API server, the entry stage's
EngineCore, its worker, and all the server's processes together. CPU time per request
holds still where requests/s swings with the host, and on the one core the rate follows
the CPU time of all the server's processes together. The summary compares the plugin's median with
plain vLLM's, and its lowest trial with plain vLLM's median (targets: 0.97x and
0.92x). ``--system-prompt-tokens N`` puts a system message of N tokens, the same for
every chat, before each: the shared-prefix workload, which vLLM's prefix caching serves
from cache in both servers (the thinker's cache is on in the plugin's pipeline; before,
the plugin prefilled every chat whole). ``--spoken N`` ends each plugin phase with N
text + audio chats and prints the API server's CPU time per spoken request.
``--profile PY_SPY`` adds a longer trial per phase (``--profile-requests``) sampled by
py-spy (not a dependency: give its path) in the API server and the entry stage's
EngineCore and worker, and prints where each spends its samples: the share of samples
in the plugin's code and its top functions, and the top
functions overall (the stacks are kept in the log folder).

Common flags of both servers: ``--max-model-len 2048 --dtype float32
--gpu-memory-utilization 0.3`` and ``VLLM_CPU_KVCACHE_SPACE=1`` (vLLM's CPU build); the
test suite's ``VLLM_CPU_CI_ENV`` is removed from their environment (with it vLLM's CPU
build runs the model without inductor and each forward costs about 25 times as much).

Usage (from the repository root)::

    .venv/bin/python benchmarks/text_bench.py
    .venv/bin/python benchmarks/text_bench.py --phases 6 --trials 5 --spoken 32
    .venv/bin/python benchmarks/text_bench.py --system-prompt-tokens 1500
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Server,
    audio_chat_load,
    chat_load,
    fmt,
    free_port,
    install_sigterm_as_interrupt,
    make_checkpoint,
    median,
    system_prompt,
    table,
    venv_bin,
    wait_health,
)

from vllm_omni_plugin.config.pipelines import builtin_pipeline  # noqa: E402

YAML = Path(builtin_pipeline("qwen3_omni_moe"))
COMMON = ["--max-model-len", "2048", "--dtype", "float32", "--gpu-memory-utilization", "0.3"]
#: the issue's targets: the plugin's median, and its lowest trial, over plain vLLM's median
TARGET_MEDIAN, TARGET_LOWEST = 0.97, 0.92


def _load(url: str, model: str, requests: int, concurrency: int, max_tokens: int,
          system: str = "") -> float:
    """Requests/s for ``requests`` chats with ``concurrency`` in flight, each after the
    system message ``system`` (none when empty)."""
    shared = [{"role": "system", "content": system}] if system else []

    def body(i):
        return {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [*shared, {"role": "user",
                                       "content": f"request {i}: tell me about the weather"}]}

    def check(i, answer, _latency):
        if answer["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"chat {i}: {answer['usage']} != {max_tokens} tokens")

    return chat_load(url, body, requests, concurrency, check)


#: the processes whose CPU time each trial reports (:func:`_cpu_ms`)
PROCESSES = ("API server", "EngineCore", "worker", "all")


def _entry_processes(pid: int) -> dict[str, int]:
    """The pids of API server ``pid``'s processes that serve text: itself, the entry
    stage's EngineCore (its first; the other stages' engines start after it) and that
    EngineCore's worker."""
    core = _first_child(pid, "VLLM::EngineCore")
    return {"API server": pid, "EngineCore": core, "worker": _first_child(core, "VLLM::Worker")}


def _cpu_ms(pid: int) -> dict[str, float]:
    """User + system CPU time, in ms, of each of API server ``pid``'s text processes
    (:func:`_entry_processes`, each alone, not its children) and of ``all`` its
    processes together (the idle stage engines of the plugin included)."""
    import psutil  # a vLLM requirement

    def ms(process) -> float:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return 1000.0 * (times.user + times.system)

    root = psutil.Process(pid)
    out = {what: ms(psutil.Process(p)) for what, p in _entry_processes(pid).items()}
    out["all"] = sum(ms(p) for p in [root, *root.children(recursive=True)])
    return out


def _per_request(before: dict[str, float], after: dict[str, float], n: int) -> dict:
    return {what: (after[what] - before[what]) / n for what in PROCESSES}


def _first_child(pid: int, title: str) -> int:
    """The pid of process ``pid``'s oldest child whose process title (vLLM sets them)
    starts with ``title``."""
    import psutil

    children = [p for p in psutil.Process(pid).children()
                if p.cmdline()[:1] and p.cmdline()[0].startswith(title)]
    return min(children, key=lambda p: p.create_time()).pid


def _frame(frame: str) -> str:
    """``function (file.py:line)`` of py-spy's raw format, without the line."""
    return re.sub(r":\d+\)$", ")", frame)


def profile_summary(path: Path, top: int = 12) -> list[str]:
    """Where a py-spy ``raw`` profile (``frame;frame;... count`` lines, outermost first)
    spends its samples: the share with a frame of the plugin's code, the plugin's
    functions by inclusive samples, and every function by its own (innermost) samples."""
    total, plugin = 0, 0
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = [_frame(f) for f in stack.split(";")], int(count)
        total += n
        own[frames[-1]] += n
        ours = {f for f in frames if "vllm_omni_plugin" in f}
        plugin += n if ours else 0
        for f in ours:
            inclusive[f] += n
    if not total:
        return ["  no samples"]
    lines = [f"  {total} samples, {100 * plugin / total:.1f}% with the plugin's code on the "
             "stack; the plugin's functions (inclusive):"]
    lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    lines.append("  every function (own samples):")
    lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    return lines


def _profiled_trial(server: Server, url: str, model: str, args, out: Path) -> None:
    """One trial of ``args.profile_requests`` chats with py-spy sampling the API server,
    the entry stage's EngineCore (the API server's first, the stages' engines start after
    it) and its worker; prints :func:`profile_summary` of each."""
    targets = _entry_processes(server.proc.pid)
    spies = {}
    for what, pid in targets.items():
        path = out.with_name(f"{out.name}-{what.replace(' ', '-')}.txt")
        spies[what] = (path, subprocess.Popen(
            [args.profile, "record", "-p", str(pid), "-f", "raw", "-r", "200",
             "--nonblocking", "-o", str(path)], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
    try:
        rate = _load(url, model, args.profile_requests, args.concurrency, args.max_tokens,
                     args.system)
    finally:
        for _, spy in spies.values():
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
    print(f"{out.name} profiled trial: {rate:.1f} req/s", flush=True)
    for what, (path, _) in spies.items():
        print(f" {what} ({path}):", *profile_summary(path), sep="\n", flush=True)


def start(name: str, ckpt: Path, args, logdir: Path, phase: int) -> tuple[Server, str]:
    """``name``'s server (``plain`` or ``plugin``), up and healthy; under ``taskset -c 1``
    with ``args.pin``."""
    port = free_port()
    argv = [venv_bin("vllm"), "serve", str(ckpt), *COMMON, "--host", "127.0.0.1",
            "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    # the test suite's setting makes vLLM's CPU build trace the model eagerly (no
    # inductor) and costs every forward some 25x: a user's server runs without it
    env.pop("VLLM_CPU_CI_ENV", None)
    if name == "plugin":
        argv += ["--stage-configs-path", str(YAML)]
    else:
        env["VLLM_PLUGINS"] = "none"
    if args.pin:
        argv = ["taskset", "-c", "1", *argv]
    log = logdir / f"{name}-{phase}.log"
    server = Server(argv, env, log)
    server.start()
    url = f"http://127.0.0.1:{port}"
    ready = wait_health(server, f"{url}/health", timeout=args.timeout)
    print(f"phase {phase} {name}: ready in {ready:.1f} s (log {log})", flush=True)
    return server, url


def run_phase(name: str, phase: int, ckpt: Path, args, logdir: Path) -> dict:
    """One phase: ``name``'s server alone, warmed up, ``args.trials`` trials (and
    ``args.spoken`` spoken chats for the plugin); returns its rates and CPU times."""
    model = str(ckpt)
    server, url = start(name, ckpt, args, logdir, phase)
    result = {"rates": [], "cpu_ms": [], "spoken_cpu_ms": None}
    try:
        _load(url, model, 4 * args.concurrency, args.concurrency, args.max_tokens,
              args.system)  # warm-up
        for trial in range(args.trials):
            before = _cpu_ms(server.proc.pid)
            rate = _load(url, model, args.requests, args.concurrency, args.max_tokens,
                         args.system)
            cpu = _per_request(before, _cpu_ms(server.proc.pid), args.requests)
            result["rates"].append(rate)
            result["cpu_ms"].append(cpu)
            print(f"phase {phase} {name} trial {trial + 1}: {rate:.1f} req/s; CPU ms/request: "
                  + ", ".join(f"{what} {cpu[what]:.2f}" for what in PROCESSES), flush=True)
        if args.profile:
            _profiled_trial(server, url, model, args, logdir / f"profile-{name}-{phase}")
        if name == "plugin" and args.spoken:
            audio_chat_load(url, model, 2, 2, args.spoken_tokens)  # warm-up
            before = _cpu_ms(server.proc.pid)["API server"]
            audio_chat_load(url, model, args.spoken, min(args.spoken, 8), args.spoken_tokens)
            result["spoken_cpu_ms"] = \
                (_cpu_ms(server.proc.pid)["API server"] - before) / args.spoken
            print(f"phase {phase} plugin spoken: API server {result['spoken_cpu_ms']:.2f} ms "
                  "CPU/request", flush=True)
    finally:
        server.stop()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="tiny checkpoint dir (made if missing)")
    parser.add_argument("--phases", type=int, default=4,
                        help="server phases, alternating plain and plugin (even)")
    parser.add_argument("--trials", type=int, default=3, help="trials per phase")
    parser.add_argument("--requests", type=int, default=256, help="chats per trial")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--spoken", type=int, default=0,
                        help="text + audio chats at the end of each plugin phase (0: none)")
    parser.add_argument("--spoken-tokens", type=int, default=16,
                        help="thinker tokens of each spoken chat")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction,
                        default=os.cpu_count() == 2 and shutil.which("taskset") is not None,
                        help="run each server under `taskset -c 1` (default: on a 2-core host)")
    parser.add_argument("--profile", metavar="PY_SPY",
                        help="path of py-spy: profile one more trial per phase")
    parser.add_argument("--profile-requests", type=int, default=1024,
                        help="chats of the profiled trial")
    parser.add_argument("--system-prompt-tokens", type=int, default=0,
                        help="a system message of this many tokens shared by every chat, "
                             "which vLLM's prefix caching serves from cache (0: none)")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.phases < 2 or args.phases % 2:
        parser.error("--phases: an even number, at least 2")
    install_sigterm_as_interrupt()
    tmp = Path(tempfile.mkdtemp(prefix="text-bench-"))
    ckpt = args.checkpoint or tmp / "ckpt"
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt)
    args.system = system_prompt(ckpt, args.system_prompt_tokens)
    results: dict[str, list[dict]] = {"plain": [], "plugin": []}
    for phase in range(args.phases):
        name = ("plain", "plugin")[phase % 2]
        results[name].append(run_phase(name, phase + 1, ckpt, args, tmp))
    rates = {n: [r for phase in results[n] for r in phase["rates"]] for n in results}
    cpu = {n: [c for phase in results[n] for c in phase["cpu_ms"]] for n in results}
    plain = median(rates["plain"])
    ratio, lowest = median(rates["plugin"]) / plain, min(rates["plugin"]) / plain
    after = f" after a {args.system_prompt_tokens}-token system prompt" if args.system else ""
    rows = [[n, " ".join(f"{r:.1f}" for r in rates[n]), fmt(median(rates[n])),
             *(fmt(median([c[what] for c in cpu[n]]), ".2f") for what in PROCESSES)]
            for n in ("plain", "plugin")]
    print(table(["server", "requests/s per trial", "median",
                 *(f"{what} CPU ms/request" for what in PROCESSES)],
                rows, title=f"text chat, {args.requests} chats x {args.max_tokens} tokens"
                            f"{after} at concurrency {args.concurrency}, {args.phases} phases x "
                            f"{args.trials} trials, server "
                            f"{'on core 1' if args.pin else 'unpinned'} (logs: {tmp})"))
    print(f"plugin / plain: median {ratio:.2f}x (target {TARGET_MEDIAN}x), lowest trial "
          f"{lowest:.2f}x (target {TARGET_LOWEST}x)")
    spoken = [p["spoken_cpu_ms"] for p in results["plugin"] if p["spoken_cpu_ms"] is not None]
    if spoken:
        print(f"plugin, spoken chats ({args.spoken_tokens} thinker tokens): API server "
              f"{fmt(median(spoken), '.2f')} ms CPU/request (median of {len(spoken)} phases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
