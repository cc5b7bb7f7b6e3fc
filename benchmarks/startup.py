"""Startup time of the three-stage Qwen3-Omni pipeline under ``vllm serve``.

For each run it launches

    vllm serve CKPT --stage-configs-path YAML --port P --max-model-len 2048 --dtype float32

in its own process group and measures, from launch:

* ``/health``   first ``GET /health`` == 200;
* ``1st chat``  the first successful ``POST /v1/chat/completions`` with
  ``"modalities": ["text", "audio"]``, ``max_tokens`` 8, ``temperature`` 0
  (sent right after /health; the response must carry WAV audio);

and, from the server log (each line stamped on arrival, see ``_common.Server``),
a per-stage breakdown: model load (vLLM's ``Initializing model took`` + ``Loading weights
took`` of the worker that logged ``stage N: OmniWorker``), vLLM's EngineCore
``init engine (...) took X s``, the plugin's ``stage N (name) engine ready in X s``,
and when each stage became ready on the launch timeline.

Side by side (interleaved with the pipeline runs, order alternating per run)
it times the thinker alone, served by plain ``vllm serve`` with the plugin off
(``VLLM_PLUGINS=none``: vLLM's own Qwen3-Omni thinker, same checkpoint and flags),
to /health and to a first text-only chat (``max_tokens`` 8), and prints the
pipeline / single-stage ratios.

On vLLM's CPU build every server gets ``--gpu-memory-utilization 0.3`` and
``VLLM_CPU_KVCACHE_SPACE=1`` (unless set).

The talker's codec-frame budget comes from the YAML (2048 in
``stage_configs/qwen3_omni_moe.yaml``; on CPU that makes the first request
take minutes), so by default the script serves a temporary copy of the YAML
with stage 1 ``default_sampling_params.max_tokens`` set to
``--talker-max-tokens`` (16).

Usage (from the repository root)::

    .venv/bin/python benchmarks/startup.py       # 2 runs, tiny checkpoint made in a temp dir
    .venv/bin/python benchmarks/startup.py --runs 3 --checkpoint /tmp/tiny-qwen3-omni
    .venv/bin/python benchmarks/startup.py --no-baseline --talker-max-tokens 0   # YAML as is

Every server is killed (SIGTERM, then SIGKILL, to the whole process group) when
its run ends, on error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Server,
    engine_core_pid,
    fmt,
    free_port,
    install_sigterm_as_interrupt,
    make_checkpoint,
    median,
    post_json,
    table,
    venv_bin,
    wait_health,
    wav_seconds,
    write_short_talker_yaml,
)

from vllm_omni_plugin.config.pipelines import builtin_pipeline  # noqa: E402

DEFAULT_YAML = Path(builtin_pipeline("qwen3_omni_moe"))

RE_ENGINE_READY = re.compile(r"stage (\d+) \(([^)]*)\) engine ready in ([\d.]+) s")
RE_OMNI_WORKER = re.compile(r"\((?:EngineCore\S*|\w+) pid=(\d+)\).*stage (\d+): OmniWorker \(")
RE_VLLM_LOAD = re.compile(
    r"\((?:EngineCore\S*|\w+) pid=(\d+)\).*(?:Initializing model|Loading weights) took ([\d.]+) s")
RE_INIT_ENGINE = re.compile(r"\(EngineCore\S* pid=(\d+)\).*init engine \(.*\) took ([\d.]+) s")
RE_LISTENING = re.compile(r"Starting vLLM (?:API )?server on")


# --------------------------------------------------------------------------- setup


def stage_names(yaml_path: Path) -> dict[int, str]:
    import yaml

    data = yaml.safe_load(yaml_path.read_text())
    return {int(s["stage_id"]): str(s.get("name", s["stage_id"])) for s in data["stages"]}


# --------------------------------------------------------------------------- runs


def serve_argv(ckpt: Path, port: int, args, yaml_path: Path | None) -> list[str]:
    argv = [venv_bin("vllm"), "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    if yaml_path is not None:
        argv += ["--stage-configs-path", str(yaml_path)]
    return argv + ["--gpu-memory-utilization", "0.3"]


def first_chat(port: int, ckpt: Path, audio: bool, timeout: float) -> dict:
    body = {
        "model": str(ckpt),
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    if audio:
        body["modalities"] = ["text", "audio"]
    start = time.perf_counter()
    status, resp = post_json(f"http://127.0.0.1:{port}/v1/chat/completions", body, timeout)
    latency = time.perf_counter() - start
    if status != 200 or not isinstance(resp, dict):
        raise RuntimeError(f"chat request failed: HTTP {status}: {str(resp)[:500]}")
    msg = resp["choices"][0]["message"]
    out = {"latency": latency, "text": msg.get("content"), "audio_s": None}
    if audio:
        data = (msg.get("audio") or {}).get("data")
        if not data:
            raise RuntimeError(f"audio requested but the response has none: {str(resp)[:500]}")
        out["audio_s"] = wav_seconds(data)
    return out


def parse_log(lines: list[tuple[float, str]], single: bool = False) -> dict:
    """Per-stage numbers from the stamped server log (call while the server runs).
    ``single``: plain vLLM serving one engine, stage "0"."""
    stages: dict[str, dict] = {}
    pid_stage: dict[str, str] = {}
    init_by_pid: dict[str, tuple[float, float]] = {}
    vllm_load: dict[str, tuple[float, float]] = {}  # pid -> (t, seconds)
    listening = None
    for t, line in lines:
        m = RE_OMNI_WORKER.search(line)
        if m:
            pid_stage[m.group(1)] = m.group(2)
            stages.setdefault(m.group(2), {})["arch"] = "vLLM's thinker"
            continue
        m = RE_VLLM_LOAD.search(line)
        if m:
            t0, secs = vllm_load.get(m.group(1), (t, 0.0))
            vllm_load[m.group(1)] = (t, secs + float(m.group(2)))
            if single:
                pid_stage[m.group(1)] = "0"
                stages.setdefault("0", {})["arch"] = "vLLM's thinker"
            continue
        m = RE_INIT_ENGINE.search(line)
        if m:
            init_by_pid[m.group(1)] = (t, float(m.group(2)))
            continue
        m = RE_ENGINE_READY.search(line)
        if m:
            st = stages.setdefault(m.group(1), {})
            st.update(name=m.group(2), ready=float(m.group(3)), t_ready=t,
                      t_start=t - float(m.group(3)))
            continue
        if listening is None and RE_LISTENING.search(line):
            listening = t
    for pid, (t, secs) in vllm_load.items():
        if pid in pid_stage:
            stages[pid_stage[pid]].update(load=secs, t_loaded=t)
    import psutil

    for pid, sid in list(pid_stage.items()):
        try:
            pid_stage.setdefault(str(engine_core_pid(int(pid))), sid)
        except psutil.Error:  # gone already: its lines stay matched by its own pid
            pass
    for pid, (t, secs) in init_by_pid.items():
        sid = pid_stage.get(pid)
        if sid is not None:
            st = stages[sid]
            st.update(init=secs, t_init=t)
            st.setdefault("t_ready", t)  # entry stage: vLLM's own engine, no plugin line
    return {"stages": stages, "listening": listening}


def one_run(kind: str, ckpt: Path, args, yaml_path: Path | None, log_dir: Path, idx: int) -> dict:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if kind == "single":
        env["VLLM_PLUGINS"] = "none"
        argv = serve_argv(ckpt, port, args, None)
    else:
        argv = serve_argv(ckpt, port, args, yaml_path)
    log_path = log_dir / f"run{idx}-{kind}.log"
    print(f"[run {idx}] {kind}: launching on port {port} (log {log_path})", flush=True)
    result = {"kind": kind, "run": idx, "log": str(log_path)}
    with Server(argv, env, log_path) as server:
        result["health"] = wait_health(server, f"http://127.0.0.1:{port}/health", args.timeout)
        chat = first_chat(port, ckpt, audio=(kind == "pipeline"), timeout=args.timeout)
        result["first_chat"] = server.elapsed()
        result["chat_latency"] = chat["latency"]
        result["audio_s"] = chat["audio_s"]
        result["text"] = chat["text"]
        result.update(parse_log(server.snapshot(), single=kind == "single"))
    print(f"[run {idx}] {kind}: /health {result['health']:.1f} s, first chat "
          f"{result['first_chat']:.1f} s (latency {result['chat_latency']:.2f} s"
          + (f", {result['audio_s']:.2f} s of audio" if result["audio_s"] is not None else "")
          + ")", flush=True)
    return result


# --------------------------------------------------------------------------- report


def report(results: list[dict], names: dict[int, str], args) -> str:
    out = []
    pipe = [r for r in results if r["kind"] == "pipeline"]
    single = [r for r in results if r["kind"] == "single"]

    rows = []
    for r in sorted(results, key=lambda r: (r["kind"] != "pipeline", r["run"])):
        label = "pipeline (3 stages)" if r["kind"] == "pipeline" else "thinker only"
        rows.append([f"run {r['run']}", label, fmt(r.get("listening")), fmt(r["health"]),
                     fmt(r["first_chat"]), fmt(r["chat_latency"], ".2f"),
                     fmt(r.get("audio_s"), ".2f")])
    for group, label in ((pipe, "pipeline (3 stages)"), (single, "thinker only")):
        if group:
            rows.append(["median", label, fmt(median([r.get("listening") for r in group])),
                         fmt(median([r["health"] for r in group])),
                         fmt(median([r["first_chat"] for r in group])),
                         fmt(median([r["chat_latency"] for r in group]), ".2f"),
                         fmt(median([r.get("audio_s") for r in group]), ".2f")])
    out.append(table(
        ["run", "server", "listening s", "/health s", "1st chat s", "chat latency s", "audio s"],
        rows, left=2,
        title="Startup, seconds since launch (1st chat: pipeline = text+audio, "
              "thinker only = text; max_tokens 8)",
    ))

    # per-stage breakdown, median over pipeline runs
    if pipe:
        sids = sorted({sid for r in pipe for sid in r["stages"]}, key=lambda s: int(s))
        rows = []
        for sid in sids:
            def med(key, sid=sid):
                return median([r["stages"].get(sid, {}).get(key) for r in pipe])

            name = names.get(int(sid)) or next(
                (r["stages"][sid]["name"] for r in pipe if r["stages"].get(sid, {}).get("name")),
                "?")
            load, init, ready = med("load"), med("init"), med("ready")
            other = ready - (load or 0) - (init or 0) if ready is not None else None
            started = med("t_start")
            rows.append([f"{sid} {name}", fmt(started), fmt(load, ".2f"), fmt(init, ".2f"),
                         fmt(other), fmt(ready), fmt(med("t_ready"))])
        out.append("")
        out.append(table(
            ["stage", "start at t+", "model load s", "EngineCore init s", "other s",
             "engine ready s", "ready at t+"],
            rows,
            title=f"Pipeline per-stage breakdown (median of {len(pipe)} runs). "
                  "t+ = s since launch;\n"
                  "engine ready = plugin's AsyncLLM start time for a downstream stage (the entry "
                  "stage is vLLM's\nown engine: its 'ready at' is its EngineCore init line); "
                  "other = engine ready - load - init\n(EngineCore process spawn, imports, config, "
                  "handshake)",
        ))
        if single:
            s_rows = []
            for r in single:
                st = r["stages"].get("0", {})
                s_rows.append([f"run {r['run']}", fmt(st.get("load"), ".2f"),
                               fmt(st.get("init"), ".2f"), fmt(st.get("t_loaded")),
                               fmt(st.get("t_ready"))])
            out.append("")
            out.append(table(["thinker only", "model load s", "EngineCore init s", "loaded at t+",
                              "ready at t+"], s_rows))

    if pipe and single:
        ph, sh = median([r["health"] for r in pipe]), median([r["health"] for r in single])
        pc, sc = median([r["first_chat"] for r in pipe]), median([r["first_chat"] for r in single])
        out.append("")
        out.append(table(
            ["metric (median)", "pipeline s", "thinker only s", "diff s", "ratio"],
            [["launch -> /health", fmt(ph), fmt(sh), fmt(ph - sh), f"{ph / sh:.2f}x"],
             ["launch -> 1st chat", fmt(pc), fmt(sc), fmt(pc - sc), f"{pc / sc:.2f}x"]],
            title="Pipeline vs single-stage (thinker) vllm serve",
        ))
        per_run = [f"run {p['run']}: {p['health'] / s['health']:.2f}x"
                   for p in pipe for s in single if s["run"] == p["run"]]
        if per_run:
            out.append("per-run /health ratio (same run, back to back): " + ", ".join(per_run))
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="reuse this tiny checkpoint (made there if it has no config.json); "
                         "default: a temp dir, deleted at the end")
    ap.add_argument("--stage-configs-path", type=Path, default=DEFAULT_YAML)
    ap.add_argument("--talker-max-tokens", type=int, default=16,
                    help="stage 1 default_sampling_params.max_tokens in a temp copy of the YAML; "
                         "0 serves the YAML unchanged")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the thinker-only vllm serve baseline")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds per wait (launch -> /health, and the first chat request)")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="where server logs go (default: a temp dir, kept)")
    args = ap.parse_args()
    install_sigterm_as_interrupt()

    work = Path(tempfile.mkdtemp(prefix="omni-startup-bench-"))
    log_dir = args.log_dir or work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    made_ckpt = None
    try:
        ckpt = args.checkpoint or work / "tiny-qwen3-omni"
        if not (ckpt / "config.json").exists():
            secs = make_checkpoint(ckpt)
            print(f"tiny checkpoint written to {ckpt} in {secs:.1f} s", flush=True)
            if args.checkpoint is None:
                made_ckpt = ckpt
        else:
            print(f"reusing checkpoint {ckpt}", flush=True)

        yaml_path = args.stage_configs_path.resolve()
        if args.talker_max_tokens > 0:
            yaml_path = write_short_talker_yaml(yaml_path, work / "stage_configs.yaml",
                                                args.talker_max_tokens)
        names = stage_names(yaml_path)
        print(f"stage config: {yaml_path} (talker max_tokens "
              f"{args.talker_max_tokens or 'from YAML'})", flush=True)

        results = []
        for i in range(1, args.runs + 1):
            kinds = ["pipeline"] if args.no_baseline else (
                ["pipeline", "single"] if i % 2 else ["single", "pipeline"])
            for kind in kinds:
                results.append(one_run(kind, ckpt, args, yaml_path, log_dir, i))

        print()
        print(f"# benchmarks/startup.py  {time.strftime('%Y-%m-%d %H:%M %Z')}  "
              f"cpus={os.cpu_count()}  runs={args.runs}  talker max_tokens="
              f"{args.talker_max_tokens or 'YAML'}  logs={log_dir}")
        print(report(results, names, args))
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        if made_ckpt is not None:
            shutil.rmtree(made_ckpt, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
