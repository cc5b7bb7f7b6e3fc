"""The driver loop shared by the engine scripts (``*_generate.py`` in this directory), and
a probe of a stage model's memory profile (:func:`memory_profile_calls`)."""

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


def memory_profile_calls(worker, modules: Callable) -> dict:
    """What a stage model computes in vLLM's memory profile, run by the engine's worker (its
    ``determine_available_memory``), and in vLLM's profiling forward (the model runner's
    ``profile_run``) outside it: the input shapes of each call of the submodules
    ``modules(model)`` names (``{name: module}``).

    vLLM's CPU build profiles only to warm up a compiled model; here the worker profiles
    as vLLM's GPU worker does (``profile_run`` inside ``determine_available_memory``).

    Returns:
        ``{"outside": {name: [shape, ...]}, "profile": {...}, "after": the model's
        stage_profiling afterwards}``.
    """
    from vllm_omni_plugin.worker.omni_worker import _unwrapped

    worker = getattr(worker, "worker", worker)  # the worker under vLLM's WorkerWrapperBase
    model = _unwrapped(worker.model_runner.get_model())
    calls: dict[str, list] = {}
    hooks = [module.register_forward_hook(
        lambda _m, args, _out, name=name: calls.setdefault(name, []).append(
            list(args[0].shape))) for name, module in modules(model).items()]
    try:
        worker.model_runner.profile_run()
        outside = dict(calls)
        calls.clear()
        worker._should_warm_up_model = lambda: True
        worker.model_runner.warming_up_model = worker.model_runner.profile_run
        worker.determine_available_memory()
    finally:
        for hook in hooks:
            hook.remove()
    return {"outside": outside, "profile": calls, "after": model.stage_profiling}
