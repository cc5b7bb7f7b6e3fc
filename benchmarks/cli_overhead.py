"""What the plugin adds to ``vllm --help`` and ``vllm serve --help``.

Part 1, whole command: runs each command K times (default 5), interleaving

* plugin on:  ``VLLM_PLUGINS`` unset (vLLM loads every entry point, so the
  plugin's general plugin ``omni`` -> ``register()`` and platform plugin
  ``omni`` -> ``reference.platform.activate`` run), and
* plugin off: ``VLLM_PLUGINS=none`` (vLLM's own filter: no plugin is loaded),

alternating which variant goes first in each round, and prints median / min
wall time per variant, the difference in ms and the on/off ratio.

Both variants set ``VLLM_TARGET_DEVICE=cpu``: vLLM's PyPI wheel resolves a
platform even for ``--help`` (the ``serve`` parser builds ``EngineArgs``
defaults, which need ``current_platform``), and on a machine without a GPU,
with no platform selected, it fails with ``RuntimeError: Failed to infer
device type``. ``VLLM_TARGET_DEVICE=cpu`` selects vLLM's built-in CPU platform
for both variants (the plugin's own platform only activates in omni mode, i.e.
with ``--stage-configs-path``, or with ``VLLM_OMNI_PLUGIN_BACKEND=reference``).

Part 2, ``register()`` alone: in K fresh processes where vLLM is already
imported, times ``import vllm_omni_plugin; vllm_omni_plugin.register()`` with
``time.perf_counter`` inside the process, in two contexts:

* ``import vllm``                      only the top-level package is loaded,
  so register() also pays for importing the vLLM modules it patches;
* ``vllm serve`` modules loaded        ``vllm.engine.arg_utils`` and
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

CONTEXTS = (
    ("after `import vllm`", ""),
    ("after vllm serve's modules", "import vllm.engine.arg_utils, vllm.v1.engine.async_llm"),
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


def sanity_check(vllm: str, timeout: float) -> list[str]:
    """The plugin's Omni group is in `vllm serve --help=Omni` only when it is on."""
    notes = []
    for variant in VARIANTS:
        proc = subprocess.run([vllm, "serve", "--help=Omni"], env=variant_env(variant),
                              cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout)
        has = b"--stage-configs-path" in proc.stdout
        notes.append(f"{variant}: `vllm serve --help=Omni` lists --stage-configs-path: {has}")
        if has != (variant == "plugin on"):
            raise RuntimeError("sanity check failed: " + notes[-1])
    return notes


def bench_commands(k: int, timeout: float) -> str:
    vllm = venv_bin("vllm")
    times = {(tuple(c), v): [] for c in COMMANDS for v in VARIANTS}
    for r in range(k):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for cmd in COMMANDS:
            for variant in order:
                secs, _ = time_command([vllm, *cmd], variant_env(variant), timeout)
                times[(tuple(cmd), variant)].append(secs)
            on, off = times[(tuple(cmd), "plugin on")][-1], times[(tuple(cmd), "plugin off")][-1]
            print(f"[round {r + 1}/{k}] vllm {' '.join(cmd)}: on {on * 1e3:.0f} ms, "
                  f"off {off * 1e3:.0f} ms", flush=True)

    rows = []
    for cmd in COMMANDS:
        on = times[(tuple(cmd), "plugin on")]
        off = times[(tuple(cmd), "plugin off")]
        med_on, med_off = median(on), median(off)
        for variant, xs in (("plugin on", on), ("plugin off", off)):
            rows.append([f"vllm {' '.join(cmd)}", variant, fmt(median(xs) * 1e3, ".0f"),
                         fmt(min(xs) * 1e3, ".0f"), fmt(max(xs) * 1e3, ".0f"), "", ""])
        rows.append([f"vllm {' '.join(cmd)}", "on - off", fmt((med_on - med_off) * 1e3, "+.0f"),
                     fmt((min(on) - min(off)) * 1e3, "+.0f"), "",
                     f"{med_on / med_off:.3f}x", f"{min(on) / min(off):.3f}x"])
    return table(
        ["command", "variant", "median ms", "min ms", "max ms", "ratio (median)", "ratio (min)"],
        rows,
        title=f"CLI wall time, K={k} interleaved runs per variant "
              "(VLLM_TARGET_DEVICE=cpu; plugin off = VLLM_PLUGINS=none)",
    )


def bench_register(k: int, timeout: float) -> str:
    env = base_env()
    env["VLLM_PLUGINS"] = "none"  # vLLM must not call register() itself before we time it
    rows = []
    for label, preimport in CONTEXTS:
        samples = []
        code = REGISTER_SNIPPET.format(preimport=preimport)
        for _ in range(k):
            proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(REPO),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"register() probe failed:\n{proc.stderr.decode()[-2000:]}")
            sample = json.loads(proc.stdout.decode().strip().splitlines()[-1])
            if not sample["registered"]:
                raise RuntimeError(f"register() did not register: {proc.stderr.decode()[-2000:]}")
            samples.append(sample)

        def med(key, scale=1e3, spec=".1f"):
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
        notes = sanity_check(venv_bin("vllm"), args.timeout) if not args.skip_cli else []
        cli = bench_commands(args.repeats, args.timeout) if not args.skip_cli else None
        reg = bench_register(args.repeats, args.timeout) if not args.skip_register else None
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130

    print()
    print(f"# benchmarks/cli_overhead.py  {time.strftime('%Y-%m-%d %H:%M %Z')}  "
          f"cpus={os.cpu_count()}  K={args.repeats}")
    for note in notes:
        print(note)
    if cli:
        print(cli)
    if reg:
        print()
        print(reg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
