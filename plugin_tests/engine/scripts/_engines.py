"""The driver loop shared by the engine scripts (``*_generate.py`` in this directory), and
a probe of the memory profile an engine's start-up ran (:class:`StartupCalls`,
:func:`memory_profile_calls`)."""

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


class StartupCalls:
    """The input shapes of every module forward from now until :meth:`stop`, through
    torch's global forward hook: started before an engine whose EngineCore runs in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), it sees what vLLM's start-up path
    runs in the worker. ``calls``: ``[(id(module), shape), ...]``."""

    def __init__(self) -> None:
        import torch

        self.calls: list[tuple[int, list[int]]] = []
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._record)

    def _record(self, module, args, _output) -> None:
        if args and hasattr(args[0], "shape"):
            self.calls.append((id(module), list(args[0].shape)))

    def stop(self) -> None:
        """Stop recording (the engine has started)."""
        self._handle.remove()


def memory_profile_calls(worker, modules: Callable,
                         startup: list[tuple[int, list[int]]]) -> dict:
    """What a stage model computed in the memory profile vLLM's engine start-up ran, and
    what vLLM's profiling forward (the model runner's ``profile_run``) computes outside
    it: the input shapes of each call of the submodules ``modules(model)`` names
    (``{name: module}``), ``startup`` being :attr:`StartupCalls.calls` of that start-up.
    Nothing here calls the profile: vLLM's EngineCore did, or nothing did.

    Returns:
        ``{"startup": {name: [shape, ...]}, "outside": {...}, "after": the model's
        stage_profiling afterwards, "record": the worker's ``omni_memory_profile`` as a
        dict (None: none ran), "vllm_profiled": whether vLLM called the worker's
        determine_available_memory}``.
    """
    from vllm_omni_plugin.worker.omni_worker import _unwrapped

    worker = getattr(worker, "worker", worker)  # the worker under vLLM's WorkerWrapperBase
    model = _unwrapped(worker.model_runner.get_model())
    named = {id(module): name for name, module in modules(model).items()}
    at_startup: dict[str, list] = {}
    for module, shape in startup:
        if module in named:
            at_startup.setdefault(named[module], []).append(shape)
    calls: dict[str, list] = {}
    hooks = [module.register_forward_hook(
        lambda _m, args, _out, name=name: calls.setdefault(name, []).append(
            list(args[0].shape))) for name, module in modules(model).items()]
    try:
        worker.model_runner.profile_run()
    finally:
        for hook in hooks:
            hook.remove()
    record = getattr(worker, "omni_memory_profile", None)
    return {"startup": at_startup, "outside": calls, "after": model.stage_profiling,
            "record": None if record is None else record._asdict(),
            "vllm_profiled": getattr(worker, "omni_vllm_profiled", None)}
