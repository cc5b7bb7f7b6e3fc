"""The driver loop shared by the engine scripts (``*_generate.py`` in this directory)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable


def run_engines(argv: list[str], run_one: Callable[[dict, dict], dict],
                in_process: Callable[[], None] | None = None) -> int:
    """Run every engine of the JSON spec in ``argv[1]`` (or stdin) one after another.

    ``run_one(spec, engine)`` returns that engine's result; an engine that raises is
    reported as ``{"error": traceback}`` and the others still run. ``in_process()`` is
    called first when the engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The last stdout line is
    ``{"engines": {name: result}}``.
    """
    spec = json.loads(argv[1] if len(argv) > 1 else sys.stdin.read())
    if in_process is not None and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        in_process()
    results = {}
    for engine in spec["engines"]:
        try:
            results[engine["name"]] = run_one(spec, engine)
        except Exception:  # report it, run the other engines
            traceback.print_exc()
            results[engine["name"]] = {"error": traceback.format_exc()[-6000:]}
        print(f"engine {engine['name']!r} done", file=sys.stderr, flush=True)
    sys.stdout.flush()
    print(json.dumps({"engines": results}), flush=True)
    return 0
