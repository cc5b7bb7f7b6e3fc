"""What the plugin adds to ``vllm --help`` and ``vllm serve --help``.

Part 1, whole command: runs each command K times (default 5), interleaving

* plugin on:  ``VLLM_PLUGINS`` unset (vLLM loads every entry point, so the
  plugin's general plugin ``omni`` -> ``register()`` runs), and
* plugin off: ``VLLM_PLUGINS=none`` (vLLM's own filter: no plugin is loaded),

alternating which variant goes first in each round, and prints median / min
wall time per variant, the difference in ms and the on/off ratio.

Both variants set ``VLLM_TARGET_DEVICE=cpu``: vLLM's PyPI wheel resolves a
platform even for ``--help`` (the ``serve`` parser builds ``EngineArgs``
defaults, which need ``current_platform``), and on a machine without a GPU,
with no platform selected, it fails with ``RuntimeError: Failed to infer
device type``. ``VLLM_TARGET_DEVICE=cpu`` selects vLLM's built-in CPU platform
for both variants.

Part 2, the same commands in-process: vLLM's CLI ``main()`` run by
``python -c`` exactly as the console script runs it, with a timer around
vLLM's ``load_general_plugins()`` (where the plugin's entry point is imported
and ``register()`` runs) and the
``sys.modules`` count. This is far less noisy than whole-process wall time on a
loaded machine. It also checks that the plugin registered (on) / was not
imported (off).

Part 3, ``register()`` alone: in K fresh processes where vLLM is already
imported, times ``import vllm_omni_plugin; vllm_omni_plugin.register()`` with
``time.perf_counter`` inside the process, in two contexts:

* ``import vllm``                      only the top-level package is loaded,
  so register() also pays for importing the vLLM modules it patches;
* arg_utils + async_llm loaded         ``vllm.engine.arg_utils`` and
  ``vllm.v1.engine.async_llm`` (which every ``vllm serve`` imports anyway)
  are imported first: the plugin's own marginal cost.

Usage (from the repository root)::

    .venv/bin/python benchmarks/cli_overhead.py            # K=5
    .venv/bin/python benchmarks/cli_overhead.py -k 9 --skip-register
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, fmt, median, table, venv_bin  # noqa: E402

COMMANDS = (["--help"], ["serve", "--help"])
VARIANTS = ("plugin on", "plugin off")

REGISTER_SNIPPET = r"""
import json, sys, time
t0 = time.perf_counter()
import vllm
{preimport}
t1 = time.perf_counter()
before = set(sys.modules)
t2 = time.perf_counter()
import vllm_omni_plugin
t3 = time.perf_counter()
vllm_omni_plugin.register()
t4 = time.perf_counter()
vllm_omni_plugin.register()
t5 = time.perf_counter()
new = set(sys.modules) - before
print(json.dumps({{
    "vllm_import_s": t1 - t0,
    "import_s": t3 - t2,
    "register_s": t4 - t3,
    "total_s": t4 - t2,
    "again_s": t5 - t4,
    "registered": vllm_omni_plugin._registered,
    "new_modules": len(new),
    "new_vllm_modules": sum(1 for m in new if m.startswith("vllm.")),
    "new_plugin_modules": sum(1 for m in new if m.startswith("vllm_omni_plugin")),
}}))
"""

# `vllm ARGS` exactly as the console script runs it (``from vllm.entrypoints.cli.main
# import main; sys.exit(main())``), plus in-process timers: the time spent in vLLM's
# ``load_general_plugins()`` (which is where the plugin's entry point is imported and
# register() runs) and the modules loaded.
CLI_PROBE = r"""
import contextlib, io, json, sys, time
t0 = time.perf_counter()
import vllm.plugins as _plugins
_orig, _spent = _plugins.load_general_plugins, [0.0]
def _timed():
    s = time.perf_counter()
    try:
        return _orig()
    finally:
        _spent[0] += time.perf_counter() - s
_plugins.load_general_plugins = _timed  # before arg_utils binds the name
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *{args!r}]
buf, code = io.StringIO(), 0
t1 = time.perf_counter()
try:
    with contextlib.redirect_stdout(buf):
        main()
except SystemExit as e:
    code = e.code or 0
t2 = time.perf_counter()
mod = sys.modules.get("vllm_omni_plugin")
sys.__stdout__.write("\n" + json.dumps({{
    "code": code, "total_s": t2 - t0, "main_s": t2 - t1, "plugins_s": _spent[0],
    "modules": len(sys.modules), "plugin_imported": mod is not None,
    "registered": bool(getattr(mod, "_registered", False)),
    "omni_flag_in_help": "--stage-configs-path" in buf.getvalue(),
    "help_chars": len(buf.getvalue()),
}}) + "\n")
"""

CONTEXTS = (
    ("after `import vllm`", ""),
    ("after arg_utils + async_llm", "import vllm.engine.arg_utils, vllm.v1.engine.async_llm"),
)


def base_env() -> dict:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    env.pop("VLLM_PLUGINS", None)
    return env


def variant_env(variant: str) -> dict:
    env = base_env()
    if variant == "plugin off":
        env["VLLM_PLUGINS"] = "none"
    return env


def time_command(argv: list[str], env: dict, timeout: float) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)
    elapsed = time.perf_counter() - start
    out = proc.stdout.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{out[-2000:]}")
    return elapsed, out


def probe_command(cmd: list[str], env: dict, timeout: float) -> dict:
    code = CLI_PROBE.format(args=list(cmd))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(REPO),
                          capture_output=True, timeout=timeout)
    lines = proc.stdout.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"probe of vllm {' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stderr.decode(errors='replace')[-2000:]}")
    sample = json.loads(lines[-1])
    if sample["code"] != 0:
        raise RuntimeError(f"vllm {' '.join(cmd)} exited {sample['code']} in the probe")
    return sample


def bench_commands(k: int, timeout: float) -> tuple[str, str]:
    """Wall time of the real `vllm` console script, and in-process probe numbers."""
    vllm = venv_bin("vllm")
    times = {(tuple(c), v): [] for c in COMMANDS for v in VARIANTS}
    probes = {(tuple(c), v): [] for c in COMMANDS for v in VARIANTS}
    for r in range(k):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for cmd in COMMANDS:
            for variant in order:
                secs, _ = time_command([vllm, *cmd], variant_env(variant), timeout)
                times[(tuple(cmd), variant)].append(secs)
            for variant in order[::-1]:
                sample = probe_command(cmd, variant_env(variant), timeout)
                expect = variant == "plugin on"
                if sample["registered"] != expect or sample["plugin_imported"] != expect:
                    raise RuntimeError(f"{variant}: plugin imported={sample['plugin_imported']} "
                                       f"registered={sample['registered']} (expected {expect})")
                probes[(tuple(cmd), variant)].append(sample)
            on, off = times[(tuple(cmd), "plugin on")][-1], times[(tuple(cmd), "plugin off")][-1]
            pon = probes[(tuple(cmd), "plugin on")][-1]["plugins_s"]
            poff = probes[(tuple(cmd), "plugin off")][-1]["plugins_s"]
            print(f"[round {r + 1}/{k}] vllm {' '.join(cmd)}: wall on {on * 1e3:.0f} ms, "
                  f"off {off * 1e3:.0f} ms; load_general_plugins on {pon * 1e3:.0f} ms, "
                  f"off {poff * 1e3:.1f} ms", flush=True)

    rows = []
    for cmd in COMMANDS:
        on = times[(tuple(cmd), "plugin on")]
        off = times[(tuple(cmd), "plugin off")]
        med_on, med_off = median(on), median(off)
        paired = median([a - b for a, b in zip(on, off, strict=True)])
        for variant, xs in (("plugin on", on), ("plugin off", off)):
            rows.append([f"vllm {' '.join(cmd)}", variant, fmt(median(xs) * 1e3, ".0f"),
                         fmt(min(xs) * 1e3, ".0f"), fmt(max(xs) * 1e3, ".0f"), "", ""])
        rows.append([f"vllm {' '.join(cmd)}", "on - off",
                     fmt((med_on - med_off) * 1e3, "+.0f"),
                     fmt((min(on) - min(off)) * 1e3, "+.0f"),
                     f"paired {paired * 1e3:+.0f}",
                     f"{med_on / med_off:.3f}x", f"{min(on) / min(off):.3f}x"])
    cli = table(
        ["command", "variant", "median ms", "min ms", "max ms", "ratio (median)", "ratio (min)"],
        rows, left=2,
        title=f"CLI wall time of the `vllm` console script, K={k} interleaved runs per variant\n"
              "(VLLM_TARGET_DEVICE=cpu; plugin off = VLLM_PLUGINS=none; "
              "paired = median of per-round on - off)",
    )

    rows = []
    for cmd in COMMANDS:
        for variant in VARIANTS:
            xs = probes[(tuple(cmd), variant)]
            rows.append([f"vllm {' '.join(cmd)}", variant,
                         fmt(median([x["total_s"] for x in xs]) * 1e3, ".0f"),
                         fmt(median([x["plugins_s"] for x in xs]) * 1e3, ".1f"),
                         fmt(min(x["plugins_s"] for x in xs) * 1e3, ".1f"),
                         f"{median([x['modules'] for x in xs]):.0f}",
                         "yes" if all(x["registered"] for x in xs) else "no"])
        pon = [x["plugins_s"] for x in probes[(tuple(cmd), "plugin on")]]
        poff = [x["plugins_s"] for x in probes[(tuple(cmd), "plugin off")]]
        mon = [x["modules"] for x in probes[(tuple(cmd), "plugin on")]]
        moff = [x["modules"] for x in probes[(tuple(cmd), "plugin off")]]
        rows.append([f"vllm {' '.join(cmd)}", "on - off", "",
                     fmt((median(pon) - median(poff)) * 1e3, "+.1f"),
                     fmt((min(pon) - min(poff)) * 1e3, "+.1f"),
                     f"{median(mon) - median(moff):+.0f}", ""])
    probe = table(
        ["command", "variant", "in-process total ms", "load_general_plugins ms", "min ms",
         "modules", "plugin registered"],
        rows, left=2,
        title=f"Same commands in-process (vLLM's CLI main() in `python -c`, K={k}): time inside "
              "vLLM's load_general_plugins()\n(entry-point import + register(), incl. the vLLM "
              "modules register() imports) and sys.modules count",
    )
    return cli, probe


def bench_register(k: int, timeout: float) -> str:
    env = base_env()
    env["VLLM_PLUGINS"] = "none"  # vLLM must not call register() itself before we time it
    rows = []
    for label, preimport in CONTEXTS:
        samples = []
        code = REGISTER_SNIPPET.format(preimport=preimport)
        for _ in range(k):
            proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(REPO),
                                  capture_output=True, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"register() probe failed:\n{proc.stderr.decode()[-2000:]}")
            sample = json.loads(proc.stdout.decode().strip().splitlines()[-1])
            if not sample["registered"]:
                raise RuntimeError(f"register() did not register: {proc.stderr.decode()[-2000:]}")
            samples.append(sample)

        def med(key, scale=1e3, spec=".1f", samples=samples):
            return fmt(median([s[key] for s in samples]) * scale, spec)

        rows.append([label, med("vllm_import_s", 1, ".2f"), med("import_s"), med("register_s"),
                     med("total_s"), fmt(min(s["total_s"] for s in samples) * 1e3, ".1f"),
                     med("again_s", 1e6, ".1f"),
                     f"{median([s['new_vllm_modules'] for s in samples]):.0f}/"
                     f"{median([s['new_plugin_modules'] for s in samples]):.0f}"])
    return table(
        ["context", "vllm imports s", "import ms", "register() ms", "total ms", "total min ms",
         "2nd register() us", "new modules vllm/plugin"],
        rows,
        title=f"import vllm_omni_plugin; register() in a process with vLLM already imported "
              f"(median of K={k} fresh processes, time.perf_counter in-process)",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", "--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    ap.add_argument("--skip-register", action="store_true")
    ap.add_argument("--skip-cli", action="store_true")
    args = ap.parse_args()

    try:
        cli, probe = (None, None) if args.skip_cli else bench_commands(args.repeats, args.timeout)
        reg = bench_register(args.repeats, args.timeout) if not args.skip_register else None
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130

    print()
    print(f"# benchmarks/cli_overhead.py  {time.strftime('%Y-%m-%d %H:%M %Z')}  "
          f"cpus={os.cpu_count()}  K={args.repeats}")
    if cli:
        print(cli)
        print()
        print(probe)
    if reg:
        print()
        print(reg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
