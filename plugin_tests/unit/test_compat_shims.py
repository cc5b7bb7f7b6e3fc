"""Every compat shim exists because of a gap in vLLM (or in what it installs).

These tests assert, against the installed vLLM, that each gap is still there.
CI runs them on every supported release, the lowest included. When one fails,
upstream has closed that gap in the vLLM under test: use the new hook there
(feature detection in the shim), and remove the shim once the lowest supported
vLLM has it. Also checked: each patch module says why it exists and when to
remove it, and the seams the patches wrap are the ones vLLM still calls.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from vllm_omni_plugin.compat import MARKER, PATCH_MODULES


def _vllm_plugin_groups() -> set[str]:
    """vLLM's own entry-point groups (``vllm.plugins.*_PLUGINS_GROUP``)."""
    import vllm.plugins

    groups = {v for k, v in vars(vllm.plugins).items() if k.endswith("_PLUGINS_GROUP")}
    assert "vllm.general_plugins" in groups  # the detection itself still works
    return groups


def _unpatched(cls, name: str):
    """The function vLLM defines for ``cls.name`` (static or class method), with
    the plugin's wrapper, if any, peeled off."""
    return inspect.unwrap(cls.__dict__[name].__func__)


# -- serve_args: no plugin hook for `vllm serve` flags or extra engine config ----------
def test_shim_needed_serve_args_no_cli_plugin_group():
    groups = _vllm_plugin_groups()
    assert not [g for g in groups if re.search(r"cli|arg|pars|config", g)], groups


def test_shim_needed_serve_args_endpoint_plugins_add_no_flags():
    """Endpoint plugins (the nearest hook) add routes and state, no CLI flags."""
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

    members = [m for m in dir(EndpointPlugin) if not m.startswith("_")]
    assert "attach_router" in members
    assert not [m for m in members if re.search(r"cli|arg|pars", m)], members


def test_shim_needed_serve_args_add_cli_args_loads_no_plugins():
    from vllm.engine.arg_utils import EngineArgs

    original = _unpatched(EngineArgs, "add_cli_args")
    assert list(inspect.signature(original).parameters) == ["parser"]
    source = inspect.getsource(original)
    assert "entry_points" not in source and "load_plugins" not in source


def test_shim_needed_serve_args_from_cli_args_drops_unknown_flags():
    """vLLM's from_cli_args maps its own dataclass fields only: a plugin's parsed
    flag never reaches the engine config without the wrapper."""
    from vllm.engine.arg_utils import EngineArgs

    original = _unpatched(EngineArgs, "from_cli_args")
    engine_args = original(EngineArgs, Namespace(model="m", omni_probe_flag="omni-probe-value"))
    assert "omni-probe-value" not in repr(vars(engine_args))


# -- engine_client: no way to choose the API server's engine client class ----------
def _entry_module():
    """Where vLLM builds the API server's engine client (0.30-0.32 location)."""
    return importlib.import_module("vllm.entrypoints.launchers.api_server.entry")


def test_shim_needed_engine_client_no_client_class_option():
    from vllm.engine.arg_utils import AsyncEngineArgs

    entry = _entry_module()
    for fn in (entry.build_async_engine_client,
               entry.build_async_engine_client_from_engine_args):
        params = list(inspect.signature(fn).parameters)
        assert not [p for p in params if re.search(r"cls|class|factory", p)], (fn, params)
    fields = [f.name for f in dataclasses.fields(AsyncEngineArgs)]
    assert not [f for f in fields if re.search(r"(engine|client|llm).*(cls|class)", f)], fields
    assert not [g for g in _vllm_plugin_groups() if re.search(r"engine|client", g)]


def test_engine_client_seam_is_what_vllm_calls():
    """The patch wraps AsyncLLM.from_vllm_config because the API server builds its
    client there; if vLLM moves that call, the patch silently stops working."""
    source = inspect.getsource(_entry_module().build_async_engine_client_from_engine_args)
    assert "AsyncLLM.from_vllm_config(" in source


# -- compile_cache_key: every additional_config entry enters the compile-cache key ---
def _config(run_dir: str | None = None, **user):
    """A ``VllmConfig`` whose ``additional_config`` holds ``user``'s entries and, with
    ``run_dir``, the plugin's settings naming that payload directory."""
    from vllm.config import VllmConfig

    from vllm_omni_plugin.config.settings import OmniSettings

    if run_dir:
        settings = OmniSettings(stage_configs_path="/p.yaml", payload_dir=run_dir)
        return VllmConfig(additional_config=settings.additional_config(user))
    return VllmConfig(additional_config=user)


def test_shim_needed_compile_cache_key_hashes_all_additional_config():
    """vLLM's own compute_hash: two configs that differ only in the plugin's settings
    (a per-run payload directory) get different compile-cache keys."""
    from vllm.config import VllmConfig

    original = inspect.unwrap(VllmConfig.compute_hash)
    assert original(_config("/dev/shm/run-1")) != original(_config("/dev/shm/run-2"))


def test_compile_cache_key_ignores_the_plugins_settings_only():
    import vllm_omni_plugin
    from vllm_omni_plugin.config.settings import OmniSettings

    vllm_omni_plugin.register()
    first, second = _config("/dev/shm/run-1", user_key=1), _config("/dev/shm/run-2", user_key=1)
    assert first.compute_hash() == second.compute_hash() == _config(user_key=1).compute_hash()
    assert _config(user_key=1).compute_hash() != _config(user_key=2).compute_hash()
    assert OmniSettings.from_vllm_config(first).payload_dir == "/dev/shm/run-1"  # untouched


# -- serve_headless: no hook for what a headless `vllm serve` runs -----------------
def _vllm_source(module: str) -> ast.Module:
    """Parsed source of a vLLM module, read without importing it (importing the CLI's
    serve module in this process would let serve_headless apply late)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    return ast.parse(Path(spec.origin).read_text())


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, name
    return found[0]


def test_shim_needed_serve_headless_no_runner_hook():
    """vLLM's CLI has a fixed list of subcommand modules (no entry points), and
    ``run_headless`` takes the parsed args only: nothing to plug a runner into."""
    main = ast.unparse(_vllm_source("vllm.entrypoints.cli.main"))
    assert "CMD_MODULES" in main and "entry_points" not in main
    run_headless = _function(_vllm_source("vllm.entrypoints.cli.serve"), "run_headless")
    assert [a.arg for a in run_headless.args.args] == ["args"]


def test_serve_headless_seam_is_what_vllm_calls():
    """ServeSubcommand.cmd calls the module-level run_headless by name, so
    replacing the module attribute reaches it."""
    cmd = _function(_vllm_source("vllm.entrypoints.cli.serve"), "cmd")
    calls = [n.func.id for n in ast.walk(cmd)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert "run_headless" in calls


# -- model_runner: which request owns which rows of a forward -----------------------
def _class_fields(module: str, cls: str) -> list[str]:
    tree = _vllm_source(module)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return [n.target.id for n in node.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def test_shim_needed_model_runner_no_row_mapping_api():
    """Neither runner offers a public row -> request mapping the worker could call."""
    for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
        names = {n.name for n in ast.walk(_vllm_source(module))
                 if isinstance(n, ast.FunctionDef)}
        assert not [n for n in names if re.search(r"row.*req|req.*rows?_|token_owner", n)]


def test_model_runner_layouts_are_what_the_shim_reads():
    """V1 keeps ``input_batch.req_ids`` (its ExecuteModelState has no input batch);
    V2 keeps the step's batch, with ``req_ids`` in row order, in its ExecuteModelState."""
    assert "input_batch" not in _class_fields("vllm.v1.worker.gpu_model_runner",
                                              "ExecuteModelState")
    init = _function(next(n for n in ast.walk(_vllm_source("vllm.v1.worker.gpu_model_runner"))
                          if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner"),
                     "__init__")
    assert "self.input_batch = InputBatch(" in ast.unparse(init)
    v1_batch = next(n for n in ast.walk(_vllm_source("vllm.v1.worker.gpu_input_batch"))
                    if isinstance(n, ast.ClassDef) and n.name == "InputBatch")
    assert _function(v1_batch, "req_ids").decorator_list  # a property
    assert "input_batch" in _class_fields("vllm.v1.worker.gpu.model_runner",
                                          "ExecuteModelState")
    assert "req_ids" in _class_fields("vllm.v1.worker.gpu.input_batch", "InputBatch")


def test_v2_keeps_the_step_batch_from_prepare_inputs_and_stores_it_after_the_forward():
    """What ``watch_step`` relies on: V2's ``execute_model`` gets the step's batch from
    ``self.prepare_inputs(...)`` before the forward (eager or graph replay) and assigns
    ``self.execute_model_state`` only after it; the runner has no ``input_batch``
    attribute. When V2 stores the batch before the forward, the shim can read that."""
    tree = _vllm_source("vllm.v1.worker.gpu.model_runner")
    runner = next(n for n in ast.walk(tree)
                  if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner")
    execute = ast.unparse(_function(runner, "execute_model"))
    prepare = execute.index("input_batch = self.prepare_inputs(")
    forward = min(execute.index(call) for call in ("self.model(", "run_fullgraph("))
    state = execute.index("self.execute_model_state = ")
    assert prepare < forward < state
    assert "self.input_batch" not in ast.unparse(runner)


# -- streaming_max_tokens: a resumable request's later chunks keep the first max_tokens -
@pytest.mark.parametrize("omni", [True, False], ids=["omni", "plain"])
def test_a_resumable_requests_next_chunk_brings_its_own_max_tokens(omni):
    """vLLM's own ``Scheduler._update_request_as_session`` (patched where it needs it)
    on a real ``Request``: in omni mode, after a chunk of 2 tokens, the next chunk's 5 is
    the session's limit; in plain mode the session keeps what vLLM's own method gives it
    (the first chunk's 2 on 0.30). Only the scheduler is a stand-in: the method reads
    three of its counters, the patch its ``vllm_config``."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request, RequestStatus, StreamingUpdate

    from vllm_omni_plugin.compat import streaming_max_tokens
    from vllm_omni_plugin.config.settings import ADDITIONAL_CONFIG_KEY

    streaming_max_tokens.apply()
    method = Scheduler._update_request_as_session
    needed = streaming_max_tokens.needed(inspect.unwrap(method))
    assert getattr(method, MARKER, False) is needed

    def request(prompt, max_tokens):
        return Request("r", prompt, SamplingParams(max_tokens=max_tokens), None,
                       resumable=True)

    session = request([1, 2, 3], 2)
    session.append_output_token_ids([7, 8])
    session.num_computed_tokens = 4  # the last sampled token (8) was not fed
    session.status = RequestStatus.WAITING_FOR_STREAMING_REQ
    config = SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: {}} if omni else {})
    scheduler = SimpleNamespace(hash_block_size=16, num_waiting_for_streaming_input=1,
                                log_stats=False, vllm_config=config)
    Scheduler._update_request_as_session(scheduler, session,
                                         StreamingUpdate.from_request(request([8], 5)))
    assert session.prompt_token_ids == [1, 2, 3, 7, 8]
    assert session.max_tokens == (5 if omni or not needed else 2)


# -- exit_gc: CPython collects a vLLM process's whole heap again at exit --------------
def test_shim_needed_exit_gc_engine_core_freezes_its_heap_on_rocm_only():
    """``run_engine_core`` freezes the surviving heap before exit only under
    ``current_platform.is_rocm()``; vLLM's worker process never does."""
    run = ast.unparse(_function(_vllm_source("vllm.v1.engine.core"), "run_engine_core"))
    freeze = run.index("gc.freeze()")
    assert "is_rocm()" in run[:freeze] and run.count("gc.freeze()") == 1
    worker_main = ast.unparse(_function(_vllm_source("vllm.v1.executor.multiproc_executor"),
                                        "worker_main"))
    assert "gc.freeze" not in worker_main


_CYCLE_AT_EXIT = """
import sys
{install}
class Cycle:
    def __del__(self):
        sys.stdout.write("collected at exit")
garbage = Cycle()
garbage.self = garbage
del garbage
"""


@pytest.mark.parametrize("install", [False, True])
def test_exit_gc_leaves_the_heap_to_the_operating_system(install):
    """A cyclic object still uncollected at exit: CPython's exit-time collection
    finalizes it; after ``exit_gc.install()`` (twice: it registers once) that
    collection skips the frozen heap, so its finalizer never runs."""
    import subprocess

    hook = ("from vllm_omni_plugin.compat import exit_gc\n"
            "import gc\ngc.disable()\nexit_gc.install()\nexit_gc.install()")
    code = _CYCLE_AT_EXIT.format(install=hook if install else "import gc\ngc.disable()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert ("collected at exit" in out) is not install


# -- every patch documents itself and reports whether it is on ----------------------
@pytest.mark.parametrize("module", [*PATCH_MODULES, "vllm_omni_plugin.compat.model_runner",
                                    "vllm_omni_plugin.compat.mooncake",
                                    "vllm_omni_plugin.compat.exit_gc",
                                    "vllm_omni_plugin.compat.gloo_device"])
def test_shim_documents_why_and_when_to_remove(module):
    doc = importlib.import_module(module).__doc__ or ""
    assert "Why:" in doc and "Remove when:" in doc, module
    if module in PATCH_MODULES:
        assert "Upstream reason:" in doc, module


def test_patch_status_after_register():
    """compat.status sees the markers register() leaves on every declared target."""
    import vllm_omni_plugin
    from vllm_omni_plugin.compat.status import patch_status

    vllm_omni_plugin.register()
    status = {p.name: p for p in patch_status()}
    assert list(status) == [m.rsplit(".", 1)[1] for m in PATCH_MODULES]
    for name in ("serve_args", "engine_client", "compile_cache_key"):
        assert status[name].targets and status[name].active is True, status[name]
    for p in status.values():
        for target in p.targets:  # every declared target names a real attribute
            module, _, path = target.partition(":")
            if module not in sys.modules:  # importing it here could let a patch apply late
                assert importlib.util.find_spec(module) is not None, target
                continue
            obj = sys.modules[module]
            for attr in path.split("."):
                obj = getattr(obj, attr)
            assert callable(obj), target
            if p.active:
                assert getattr(obj, MARKER, False), target


# -- mooncake: vLLM's Mooncake connector on vLLM's CPU platform -----------------------
_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


def _mooncake_class(name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(_vllm_source(_MOONCAKE))
                if isinstance(n, ast.ClassDef) and n.name == name)


def test_shim_needed_mooncake_device_index():
    """The connector worker asks torch for the accelerator's device index inline in its
    constructor, with no CPU branch (it raises where there is no accelerator)."""
    init = ast.unparse(_function(_mooncake_class("MooncakeConnectorWorker"), "__init__"))
    assert "torch.accelerator.current_device_index()" in init
    assert "is_cpu" not in init


def test_shim_needed_mooncake_bootstrap_port_from_env_only():
    """vLLM's prefill side takes its bootstrap port from VLLM_MOONCAKE_BOOTSTRAP_PORT only
    (0.32 adds an external-server address, which starts no server)."""
    addr = ast.unparse(_function(_vllm_source(_MOONCAKE), "get_mooncake_bootstrap_addr"))
    assert "envs.VLLM_MOONCAKE_BOOTSTRAP_PORT" in addr
    # compat.mooncake.use_bootstrap_port rebuilds vLLM's environment cache with these,
    # and detects the cache by functools.cache's cache_clear
    enable = ast.unparse(_function(_vllm_source("vllm.envs"), "enable_envs_cache"))
    assert "functools.cache(__getattr__)" in enable
    _function(_vllm_source("vllm.envs"), "disable_envs_cache")


def _self_attrs_assigned(fn: ast.FunctionDef) -> set[str]:
    return {t.attr for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


def _calls(fn: ast.FunctionDef) -> set[str]:
    return {ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)}


def test_mooncake_connector_init_is_what_the_subclass_repeats():
    """OmniMooncakeConnector.__init__ repeats vLLM's role dispatch (vLLM looks its worker
    class up by module-global name): the same attributes, the same constructor calls,
    with the plugin's worker class. Fails when vLLM changes its constructor."""
    from vllm_omni_plugin.kv_transfer import mooncake as omni_mooncake

    theirs = _function(_mooncake_class("MooncakeConnector"), "__init__")
    ours = _function(ast.parse(inspect.getsource(omni_mooncake.OmniMooncakeConnector)),
                     "__init__")
    assert _self_attrs_assigned(theirs) == _self_attrs_assigned(ours)
    assert "super().__init__(vllm_config, role, kv_cache_config)" in _calls(theirs)
    want = {"MooncakeConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)",
            "MooncakeConnectorWorker(vllm_config, self.engine_id, kv_cache_config)"}
    assert want <= _calls(theirs)
    ours_calls = {c.removeprefix("vllm_mooncake.").replace("OmniMooncake", "Mooncake")
                  for c in _calls(ours)}
    assert want <= ours_calls


def test_mooncake_methods_the_subclass_overrides():
    """Names and signatures the plugin's worker overrides or calls, and the call sites
    that reach its ``_send_blocks`` override."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as m

    worker = m.MooncakeConnectorWorker
    assert list(inspect.signature(worker.__init__).parameters) == [
        "self", "vllm_config", "engine_id", "kv_cache_config"]
    assert list(inspect.signature(worker._send_blocks).parameters) == [
        "self", "remote_session", "src_ptrs", "dst_ptrs", "lengths"]
    assert "self._send_blocks" in inspect.getsource(worker)
    # the transfer timeout: the coroutines it wraps, the state it reads and what it calls
    for name, params in (
            ("_start_load_kv", ["self", "reqs_to_recv"]),
            ("handle_new_engine_id", ["self", "remote_engine_id", "pull_metas"]),
            ("receive_kv_from_single_worker", ["self", "worker_addr", "pull_metas"]),
            ("record_send_reqs", ["self", "metadata"]),
            ("_build_transfer_params", ["self", "ready_reqs", "agent_meta", "local_regions",
                                        "remote_regions"])):
        fn = getattr(worker, name)
        assert inspect.iscoroutinefunction(fn), name
        assert list(inspect.signature(fn).parameters) == params, name
    assert list(inspect.signature(worker._handle_failed_recv).parameters) == [
        "self", "pull_metas", "req_ids", "reason"]
    source = inspect.getsource(worker)
    for attr in ("self._pending_bootstrap_queries[remote_bootstrap_addr].set()",
                 "self._remote_agents[remote_engine_id]", "send_meta.expire_time",
                 "self.reqs_need_send[transfer_id]"):
        assert attr in source, attr
    assert "expire_time" in {f.name for f in dataclasses.fields(m.SendBlockMeta)}
    for fn in (m.should_launch_bootstrap_server, m.get_mooncake_bootstrap_addr):
        assert list(inspect.signature(fn).parameters) == ["vllm_config"]
    assert hasattr(m, "TransferEngine")  # None where Mooncake does not import


# -- gloo_device: one gloo device for a single-rank worker's process groups ------------
_GLOO_GROUPS = """
import json, os, time, torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from vllm_omni_plugin.compat.gloo_device import shared_gloo_device

TASKS = f"/proc/{os.getpid()}/task"

def names():
    return {t: open(f"{TASKS}/{t}/comm").read().strip() for t in os.listdir(TASKS)}

def loops():
    # a new thread has the process's name until it names itself: wait until every thread
    # that was not there at the start has renamed itself (gloo's and torch's all do)
    deadline = time.monotonic() + 30
    while True:
        now = names()
        if all(name != NAME for t, name in now.items() if t not in BEFORE):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(now)
        time.sleep(0.01)
    return sum(name == "gloo_tcp_loop" for name in now.values())

NAME = open(f"/proc/{os.getpid()}/comm").read().strip()
BEFORE = names()
original = c10d.ProcessGroupGloo
with shared_gloo_device(ENABLED):
    dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    groups = [dist.new_group([0], backend="gloo") for _ in range(6)]
    options = original._Options()
    options._devices = [original.create_default_device()]
    explicit = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, options)
seen = {"loops": loops(), "restored": c10d.ProcessGroupGloo is original,
         "explicit_devices": len(explicit.options._devices)}
tensor = torch.ones(3)
for group in groups:
    dist.all_reduce(tensor, group=group)
    dist.barrier(group=group)
seen["sum"] = tensor.tolist()
for group in groups:
    dist.destroy_process_group(group)
dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_shim_needed_gloo_device_one_device_per_group():
    """torch builds each gloo group with ``ProcessGroupGloo(store, rank, size, timeout=...)``,
    which makes a device (and its loop thread) of its own."""
    from vllm_omni_plugin.compat.gloo_device import needed

    assert needed()


@pytest.mark.parametrize("enabled", [False, True])
def test_gloo_groups_of_one_rank_share_a_device(enabled):
    """Seven gloo groups of one rank (the world and six more): seven loop threads, plus the
    one of a device made outside the groups; inside ``shared_gloo_device`` they hold one,
    plus that one. All-reduce, barrier and destroy work on every group; a call
    with options of its own is torch's; the name is torch's again after the block."""
    import json
    import subprocess

    code = _GLOO_GROUPS.replace("ENABLED", str(enabled))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["loops"] == (2 if enabled else 8), seen
    assert seen["restored"] and seen["explicit_devices"] == 1, seen
    assert seen["sum"] == [1.0, 1.0, 1.0], seen


# -- the row cache's scheduler: what OmniScheduler and RowBlockIndex read of vLLM --------
def _class(module: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(_vllm_source(module))
                if isinstance(n, ast.ClassDef) and n.name == name)


def _assigned_in_init(module: str, cls: str) -> set[str]:
    init = _function(_class(module, cls), "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute)}


def test_what_the_row_cache_scheduler_reads_is_where_vllm_keeps_it():
    """``worker/scheduler.py`` and ``worker/row_cache.py`` (no accessor: a subclass and
    the index it feeds) read, on every release row: the scheduler's ``kv_cache_manager``,
    ``kv_cache_config`` and ``connector``; ``KVCacheManager.get_computed_blocks``
    (called through the instance attribute the subclass wraps, with the request first,
    returning the blocks and the hit's tokens first), ``create_kv_cache_blocks`` and
    ``empty_kv_cache_blocks``; ``KVCacheBlocks.blocks`` of ``KVCacheBlock.block_id``s;
    ``Request``'s
    ``skip_reading_prefix_cache``; and the ``SchedulerOutput`` fields the index is fed."""
    sched = "vllm.v1.core.sched.scheduler"
    assert {"kv_cache_manager", "kv_cache_config", "connector"} <= _assigned_in_init(
        sched, "Scheduler")
    calls = ast.unparse(_class(sched, "Scheduler"))
    assert "self.kv_cache_manager.get_computed_blocks(request" in calls  # 0.33: and a limit
    for method in ("schedule", "add_request"):
        _function(_class(sched, "Scheduler"), method)
    manager = _class("vllm.v1.core.kv_cache_manager", "KVCacheManager")
    lookup = _function(manager, "get_computed_blocks")
    assert ast.unparse(lookup.returns).startswith("tuple[KVCacheBlocks, int")
    _function(manager, "create_kv_cache_blocks")
    assert "empty_kv_cache_blocks" in _assigned_in_init("vllm.v1.core.kv_cache_manager",
                                                        "KVCacheManager")
    assert "blocks" in _class_fields("vllm.v1.core.kv_cache_manager", "KVCacheBlocks")
    assert "block_id" in _class_fields("vllm.v1.core.kv_cache_utils", "KVCacheBlock")
    assert "skip_reading_prefix_cache" in _assigned_in_init("vllm.v1.request", "Request")
    output = "vllm.v1.core.sched.output"
    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
            "finished_req_ids", "preempted_req_ids"} <= set(_class_fields(output,
                                                                          "SchedulerOutput"))
    assert {"req_id", "sampling_params", "block_ids", "num_computed_tokens"} <= set(
        _class_fields(output, "NewRequestData"))
    assert {"req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"} <= set(
        _class_fields(output, "CachedRequestData"))
