"""The "Omni" argument group of ``vllm serve`` and its hand-off to the engines.

``--stage-configs-path`` switches omni mode on. No flag is spelled exactly
``--omni``: vLLM >= 0.20 hands such a command line to the upstream
``vllm_omni`` package before any plugin loads.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from vllm_omni_plugin import envs
from vllm_omni_plugin.config.pipelines import AUTO, builtin_pipelines, resolve_stage_configs
from vllm_omni_plugin.config.placement import (
    GIB,
    PLACEMENT_MODES,
    Host,
    apply_cpu_kv_cache,
    place_engine,
    plan_head,
)
from vllm_omni_plugin.config.settings import ClusterSettings, OmniSettings, RealtimeSettings
from vllm_omni_plugin.logger import init_logger
from vllm_omni_plugin.wire.auth import TOKEN_RECIPE, is_loopback

logger = init_logger(__name__)

#: What the parsed arguments hold in place of a cluster token.
REDACTED = "***"

#: Entry-engine settings every downstream stage inherits unless its YAML sets them.
INHERITED_FIELDS = ("tokenizer", "dtype", "seed", "trust_remote_code", "revision",
                    "download_dir", "load_format")

#: The omni API's middleware (:mod:`vllm_omni_plugin.entrypoints.middleware`), named as
#: vLLM's ``--middleware`` takes it: by qualified name (config/ does not import the API)
MIDDLEWARE_QUALNAME = "vllm_omni_plugin.entrypoints.middleware.OmniApiMiddleware"

GROUP_TITLE = "Omni"
_CLUSTER = ClusterSettings()  # the defaults of the head's flags
_REALTIME = RealtimeSettings()
_SETTINGS_ROW_CACHE = OmniSettings.model_fields["row_cache_bytes"].default


def add_omni_args(parser: argparse.ArgumentParser) -> None:
    """Add the Omni group to ``parser`` (no-op when already present)."""
    if any(g.title == GROUP_TITLE for g in parser._action_groups):
        return
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="Multi-stage omni pipelines (vllm-omni-plugin). Omni mode is on when "
        "--stage-configs-path is given.",
    )
    group.add_argument(
        "--stage-configs-path",
        type=str,
        default=None,
        metavar="PIPELINE",
        help="Stage pipeline: a YAML file, the name of a built-in pipeline "
        f"({', '.join(builtin_pipelines())}), or '{AUTO}' (the built-in pipeline named "
        "after the checkpoint's config.json model_type; on GPUs, for a checkpoint it "
        "cannot hold, the shipped memory plan that fits them). Switches on omni mode: the served "
        "model becomes the pipeline's entry stage and the other stages start as their own "
        "vLLM engines. Validated before any engine starts.",
    )
    group.add_argument(
        "--stage-id", type=int, default=None, metavar="N",
        help="Stage this process serves. With --headless: start replicas of stage N that "
        "register with the head at --omni-master-address/--omni-master-port (no API "
        "server); replicas of the entry stage serve its part of requests that ask for no "
        "text (image generation), the head's engine serves text. Without --headless it "
        "may only name the entry stage.")
    group.add_argument(
        "--omni-master-address", "-oma", type=str, default=_CLUSTER.host, metavar="HOST",
        help="Head: the address its omni master and coordinator bind to (only this one; "
        "use a routable IP for headless replicas on other hosts). Headless: the head's "
        "address to register with.")
    group.add_argument(
        "--omni-master-port", "-omp", type=int, default=_CLUSTER.port, metavar="PORT",
        help="Port of the head's omni master. Head: 0 picks a free one (logged). "
        "Headless: required.")
    group.add_argument(
        "--omni-dp-size-local", type=int, default=1, metavar="N",
        help="Headless: number of replicas of --stage-id this process runs (one vLLM "
        "engine each). The head's own replicas per stage come from runtime.num_replicas "
        "in the stage config.")
    group.add_argument(
        "--omni-lb-policy", type=str, default=_CLUSTER.lb_policy,
        choices=[p.value for p in _policies()],
        help="Head: how each stage picks one of its replicas for a request.")
    group.add_argument(
        "--omni-heartbeat-timeout", type=float, default=_CLUSTER.heartbeat_timeout,
        metavar="SECONDS",
        help="Head: seconds without a heartbeat after which a replica is marked ERROR "
        "and its requests fail over. Headless replicas heartbeat at 1/6 of it.")
    group.add_argument(
        "--omni-replica-wait-timeout", type=float, default=_CLUSTER.replica_wait_timeout,
        metavar="SECONDS",
        help="Head: how long a request waits for a replica of a stage while none is up "
        "but one is starting (or a headless one may come back), before it fails with "
        "HTTP 503 'no replica available for stage N'; with none coming, the 503 is at "
        "once.")
    group.add_argument(
        "--omni-admission-timeout", type=float, default=_CLUSTER.admission_timeout,
        metavar="SECONDS",
        help="Head: how long a request for more than text waits when a downstream stage "
        "already has its bound of requests in flight (runtime.max_inflight in the stage "
        "config) before it fails with HTTP 429 and a Retry-After header.")
    group.add_argument(
        "--omni-stall-timeout", type=float, default=_CLUSTER.stall_timeout,
        metavar="SECONDS",
        help="Seconds a stage engine this process runs may leave a liveness probe (a "
        "utility call its EngineCore answers between two steps) unanswered before it "
        "counts as stalled: its processes are killed and it is restarted, its requests "
        "that produced nothing resubmitted and the others failed naming the stage and "
        "replica. Given, it applies to every stage (0 disables the probe); else each "
        "stage's runtime.stall_timeout, else 120 s, several times the longest engine "
        "step of the shipped pipelines on one GPU.")
    group.add_argument(
        "--omni-request-timeout", type=float, default=_CLUSTER.request_timeout,
        metavar="SECONDS",
        help="Head: seconds a request may run in total before it is stopped at every "
        "stage and fails with HTTP 504 naming the stage it was at (a streamed response "
        "ends with an error event). Default: no limit.")
    group.add_argument(
        "--omni-realtime-max-sessions", type=int, default=_REALTIME.max_sessions,
        metavar="N",
        help="Head: Realtime API (GET /v1/realtime, WebSocket) sessions open at once; one "
        "more gets an error event and is closed with code 1013 (try again later).")
    group.add_argument(
        "--omni-realtime-idle-timeout", type=float, default=_REALTIME.idle_timeout,
        metavar="SECONDS",
        help="Head: how long a Realtime API session may send no event while no response "
        "runs before the server closes it (an error event, then code 1000).")
    group.add_argument(
        "--omni-realtime-max-input-audio", type=float, default=_REALTIME.max_input_audio,
        metavar="SECONDS",
        help="Head: the most audio a Realtime API session's input audio buffer holds; an "
        "input_audio_buffer.append past it gets an error event and is dropped, the "
        "session goes on (commit or clear the buffer).")
    group.add_argument(
        "--omni-row-cache-gib", type=float, default=_SETTINGS_ROW_CACHE / GIB,
        metavar="GIB",
        help="Host memory each engine of a stage whose requests hand rows to the next "
        "stage (the Qwen3-Omni thinker) keeps for the rows of prefix-cached KV blocks, so "
        "that spoken answers read vLLM's prefix cache as text answers do (a conversation's "
        "later turns compute their new tokens only). 0: such requests compute every "
        "position.")
    group.add_argument(
        "--omni-replica-address", "-ora", type=str, default=None, metavar="HOST",
        help="Headless: the address its replicas bind to and the head connects to "
        "(default: this host's address on the route to the master).")
    group.add_argument(
        "--omni-cluster-token", type=_take_cluster_token, default=None, metavar="TOKEN",
        help="Shared secret of the head and its headless replicas: control-plane and task "
        "frames are signed with it (HMAC-SHA256) and unsigned ones dropped. Required when "
        "the head's omni master listens on a non-loopback address (see "
        "--omni-cluster-insecure). Prefer the "
        f"{envs.CLUSTER_TOKEN} environment variable: command lines are visible to other "
        f"users. Make one with: {TOKEN_RECIPE}")
    group.add_argument(
        "--omni-cluster-insecure", action="store_true",
        help="Head: let the omni master and coordinator listen on a non-loopback "
        "--omni-master-address without a cluster token. Any host that reaches the port "
        "can then register as a replica and receive users' requests: only on a network "
        "you trust. Logged as a warning and shown as vllm_omni:cluster_insecure 1 in "
        "/metrics.")
    group.add_argument(
        "--omni-placement", type=str, default="auto", choices=PLACEMENT_MODES,
        help="Head: where stages without runtime.devices run. auto: on several GPUs the "
        "entry stage on the first and the other stages spread over the rest; on vLLM's CPU "
        "build with 3 or more cores (and no VLLM_CPU_OMP_THREADS_BIND) the last core left to "
        "the API server and schedulers, the entry stage's workers on half the others and "
        "the other stages' on the rest. none: vLLM's own default (every engine on device "
        "0, or vLLM's CPU binding). Either way the head refuses to start when the stages' "
        "memory shares (engine_args.gpu_memory_utilization; runtime.cpu_kv_cache_gib on "
        "the CPU build) over-commit a device.")
    group.add_argument(
        "--replica-id", type=int, default=None, help=argparse.SUPPRESS)


def _policies():
    from vllm_omni_plugin.coordinator.load_balancer import LoadBalancingPolicy

    return list(LoadBalancingPolicy)


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


#: Defaults of the omni flags, for a namespace not built by vLLM's parser.
FLAG_DEFAULTS = {"stage_id": None, "omni_master_address": _CLUSTER.host,
                 "omni_master_port": _CLUSTER.port, "omni_dp_size_local": 1,
                 "omni_lb_policy": _CLUSTER.lb_policy,
                 "omni_heartbeat_timeout": _CLUSTER.heartbeat_timeout,
                 "omni_replica_wait_timeout": _CLUSTER.replica_wait_timeout,
                 "omni_admission_timeout": _CLUSTER.admission_timeout,
                 "omni_stall_timeout": _CLUSTER.stall_timeout,
                 "omni_request_timeout": _CLUSTER.request_timeout,
                 "omni_replica_address": None, "omni_cluster_token": None, "replica_id": None,
                 "omni_cluster_insecure": False,
                 "omni_placement": "auto",
                 "omni_realtime_max_sessions": _REALTIME.max_sessions,
                 "omni_realtime_idle_timeout": _REALTIME.idle_timeout,
                 "omni_realtime_max_input_audio": _REALTIME.max_input_audio,
                 "omni_row_cache_gib": _SETTINGS_ROW_CACHE / GIB}


def validate_omni_args(args: argparse.Namespace) -> None:
    """Check the omni flags that argparse cannot, and apply the cluster token.

    Missing attributes (a namespace built by hand) get :data:`FLAG_DEFAULTS`;
    ``stage_configs_path`` becomes the path of the YAML it names
    (:func:`~vllm_omni_plugin.config.pipelines.resolve_stage_configs`).

    Raises:
        ValueError: the message names the flag (a ``StageConfigError`` for
            ``--stage-configs-path``).
    """
    for name, value in FLAG_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    if getattr(args, "stage_configs_path", None):
        value, model = args.stage_configs_path, getattr(args, "model", None)
        args.stage_configs_path = resolve_stage_configs(value, model,
                                                        getattr(args, "revision", None))
        args.stage_configs_path = _for_devices(args, value == AUTO)
    if getattr(args, "replica_id", None) is not None:
        logger.warning("--replica-id is deprecated and ignored: the head's omni master "
                       "assigns replica ids")
    _positive("--omni-heartbeat-timeout", args.omni_heartbeat_timeout)
    _positive("--omni-replica-wait-timeout", args.omni_replica_wait_timeout)
    _positive("--omni-realtime-max-sessions", args.omni_realtime_max_sessions)
    _positive("--omni-realtime-idle-timeout", args.omni_realtime_idle_timeout)
    _positive("--omni-realtime-max-input-audio", args.omni_realtime_max_input_audio)
    if not args.omni_row_cache_gib >= 0:
        raise ValueError(f"--omni-row-cache-gib must be >= 0, got {args.omni_row_cache_gib!r}")
    if not args.omni_admission_timeout >= 0:
        raise ValueError("--omni-admission-timeout must be >= 0, got "
                         f"{args.omni_admission_timeout!r}")
    if args.omni_stall_timeout is not None and not args.omni_stall_timeout >= 0:
        raise ValueError(f"--omni-stall-timeout must be >= 0, got {args.omni_stall_timeout!r}")
    if args.omni_request_timeout is not None:
        _positive("--omni-request-timeout", args.omni_request_timeout)
    if args.omni_dp_size_local < 1:
        raise ValueError(f"--omni-dp-size-local must be >= 1, got {args.omni_dp_size_local}")
    if not 0 <= args.omni_master_port <= 65535:
        raise ValueError(f"--omni-master-port must be 0..65535, got {args.omni_master_port}")
    if is_omni_headless(args):
        if not args.omni_master_port:
            raise ValueError("--headless --stage-id needs --omni-master-port (the head's "
                             "omni master port, logged by the head at startup)")
        return
    if getattr(args, "headless", False):
        return  # vLLM's own data-parallel headless mode
    args.omni_cluster_insecure = exposed_without_token(args.omni_master_address,
                                                       args.omni_cluster_insecure)
    for flag, attr in (("--omni-replica-address", "omni_replica_address"),):
        if getattr(args, attr) is not None:
            raise ValueError(f"{flag} applies to headless replicas (--headless --stage-id N)")
    if args.omni_dp_size_local != 1:
        raise ValueError("--omni-dp-size-local applies to headless replicas (--headless "
                         "--stage-id N); the head's replicas per stage come from "
                         "runtime.num_replicas in the stage config, and the entry stage "
                         "scales with vLLM's --data-parallel-size (text) and headless "
                         "replicas (image requests)")


def _for_devices(args: argparse.Namespace, auto: bool, host: Host | None = None) -> str:
    """The pipeline YAML to serve for ``args.stage_configs_path`` (resolved) on this
    host's devices: a built-in pipeline with shipped memory plans, given as ``auto``,
    becomes the plan that fits the GPUs for a checkpoint it cannot hold
    (:func:`~vllm_omni_plugin.config.auto_plan.choose`); any other path is kept.

    Raises:
        StageConfigError: ``auto``, and no shipped plan fits (names the plan tool
            command for these devices).
    """
    from pathlib import Path

    from vllm_omni_plugin.config.auto_plan import choose, shipped_plans
    from vllm_omni_plugin.config.pipelines import BUILTIN_DIR

    path, model = args.stage_configs_path, getattr(args, "model", None)
    name = Path(path).stem
    if Path(path).parent != BUILTIN_DIR or not model or not shipped_plans(name):
        return path
    asked = getattr(args, "max_model_len", None)
    return choose(name, path, model, getattr(args, "revision", None),
                  host or Host.current(device_memory=True),
                  asked if isinstance(asked, int) and asked > 0 else None, auto)


def _take_cluster_token(value: str) -> str:
    """``--omni-cluster-token``'s type: the token goes into ``VLLM_OMNI_PLUGIN_CLUSTER_TOKEN``
    at once (the processes of this command inherit it from there), and the parsed
    arguments hold only :data:`REDACTED`: vLLM logs and copies them."""
    if value:
        os.environ[envs.CLUSTER_TOKEN] = value
    return REDACTED


def exposed_without_token(host: str, insecure: bool) -> bool:
    """Whether the head's omni master and coordinator, bound to ``host``
    (``--omni-master-address``), listen on a network address without a cluster token,
    allowed by ``insecure`` (``--omni-cluster-insecure``): then a warning is logged.

    Raises:
        ValueError: ``host`` is not a loopback address, no token is set and ``insecure``
            is False; the message names the address, the flags, the variable and how to
            make a token.
    """
    if envs.cluster_token() or is_loopback(host):
        return False
    if not insecure:
        raise ValueError(
            f"--omni-master-address {host} is not a loopback address and no cluster token "
            "is set: any host that reaches the omni master could register as a replica and "
            "receive users' requests. Set the same token on the head and on every headless "
            f"process, with {envs.CLUSTER_TOKEN}=TOKEN (or --omni-cluster-token TOKEN); make "
            f"one with: {TOKEN_RECIPE}. On a network you trust, --omni-cluster-insecure "
            "allows it")
    logger.warning("--omni-cluster-insecure: the omni master and coordinator listen on %s "
                   "without a cluster token; any host that reaches them can register as a "
                   "replica and receive users' requests", host)
    return True


def is_omni_headless(args: argparse.Namespace) -> bool:
    """``--headless`` with ``--stage-id`` in omni mode: start omni headless replicas."""
    return bool(getattr(args, "stage_configs_path", None) and getattr(args, "headless", False)
                and getattr(args, "stage_id", None) is not None)


@dataclass
class HeadlessPlan:
    """What ``--headless --stage-id N`` starts, built and validated by :func:`headless_plan`.

    Args:
        stage: The :class:`~vllm_omni_plugin.config.schema.StageConfig` of stage ``N``.
        settings: The plugin settings the replicas' engines start from (stage ``N``, not
            the entry stage, ``stage_configs_path`` absolute, ``--omni-stall-timeout``).
        base_args: The base ``EngineArgs`` fields of every replica's engine
            (:func:`base_args_from`; for a prefill stage the decode stage's model and this
            command line's KV layout fields).
        master_host: Host of the head's omni master (``--omni-master-address``).
        master_port: Port of the head's omni master (``--omni-master-port``).
        replica_host: The local address the replicas bind on and advertise
            (``--omni-replica-address``, else the route to the master).
        num_replicas: How many replicas of the stage to start here (``--omni-dp-size-local``).
    """
    stage: object  # StageConfig
    settings: OmniSettings
    base_args: dict
    master_host: str
    master_port: int
    replica_host: str
    num_replicas: int


def headless_plan(args: argparse.Namespace) -> HeadlessPlan:
    """Everything ``--headless --stage-id N`` needs, validated.

    Raises:
        StageConfigError: invalid YAML, or no stage ``N``.
        ValueError: bad flags (named).
        OSError: no route to the master's host.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_omni_plugin.config.loader import load_pipeline_config
    from vllm_omni_plugin.config.schema import StageConfigError
    from vllm_omni_plugin.master.client import route_probe_address

    validate_omni_args(args)
    path = args.stage_configs_path
    pipeline = load_pipeline_config(path)
    stage = next((s for s in pipeline.stages if s.stage_id == args.stage_id), None)
    if stage is None:
        raise StageConfigError(f"--stage-id {args.stage_id}: the pipeline has no such stage "
                               f"(stages: {[s.stage_id for s in pipeline.stages]})",
                               path=path, field="stage_id")
    if stage.stage_id == pipeline.entry_stage.stage_id and stage.pd is not None:
        raise ValueError(f"--stage-id {stage.stage_id} is the entry stage, a decode stage "
                         "(pd), which the head serves itself; scale it with vLLM's "
                         "--data-parallel-size")
    engine_args = AsyncEngineArgs.from_cli_args(args)
    base = base_args_from(engine_args)
    if stage.is_prefill:  # the decode stage's model; the KV layout from this command line
        base.update(pipeline.stage(stage.pd.decode_stage).engine_args)
        base.update({name: getattr(engine_args, name) for name in KV_LAYOUT_FIELDS
                     if getattr(engine_args, name, None) is not None})
    return HeadlessPlan(
        stage=stage,
        settings=OmniSettings(stage_configs_path=os.path.abspath(path),
                              stage_id=stage.stage_id, entry=False,
                              cluster=ClusterSettings(stall_timeout=args.omni_stall_timeout),
                              row_cache_bytes=int(args.omni_row_cache_gib * GIB)),
        base_args=base,
        master_host=args.omni_master_address,
        master_port=args.omni_master_port,
        replica_host=route_probe_address(args.omni_master_address, args.omni_master_port,
                                         override=args.omni_replica_address),
        num_replicas=args.omni_dp_size_local,
    )


def base_args_from(source) -> dict:
    """Model path and the inherited ``EngineArgs`` fields of ``source`` (a
    ``ModelConfig`` or ``EngineArgs``), the base of every stage replica's engine."""
    base = {"model": source.model}
    for name in INHERITED_FIELDS:
        value = getattr(source, name, None)
        if value is not None:
            base[name] = value if name != "dtype" else str(value).removeprefix("torch.")
    return base


#: ``EngineArgs`` fields of the KV cache layout -> where a resolved ``VllmConfig`` keeps
#: them; a prefill stage takes them from its decode engine.
KV_LAYOUT_FIELDS = {
    "block_size": ("cache_config", "block_size"),
    "kv_cache_dtype": ("cache_config", "cache_dtype"),
    "max_model_len": ("model_config", "max_model_len"),
    "quantization": ("model_config", "quantization"),
    "tensor_parallel_size": ("parallel_config", "tensor_parallel_size"),
    "pipeline_parallel_size": ("parallel_config", "pipeline_parallel_size"),
}


def prefill_base_args(base: dict, decode_stage, vllm_config) -> dict:
    """The base ``EngineArgs`` fields of a prefill stage's engines: ``base`` (the served
    model's), then the decode stage's YAML ``engine_args``, then the decode engine's KV
    cache layout from its resolved ``vllm_config``."""
    args = {**base, **decode_stage.engine_args}
    for name, (section, attr) in KV_LAYOUT_FIELDS.items():
        value = getattr(getattr(vllm_config, section), attr)
        if value is not None:
            args[name] = value
    return args


def apply_omni_args(args: argparse.Namespace, engine_args) -> None:
    """Configure the entry stage's ``engine_args`` from the omni flags (in place).

    Loads and validates the pipeline, applies the entry stage's ``engine_args``
    from the YAML over the command line's, records the plugin's settings in
    ``additional_config`` and installs the audio-output middleware.

    Raises:
        StageConfigError: the YAML is invalid (names file, stage and field).
    """
    path = getattr(args, "stage_configs_path", None)
    if not path or is_omni_headless(args):
        return  # headless replicas are configured by headless_plan
    from vllm_omni_plugin.config.loader import load_pipeline_config
    from vllm_omni_plugin.payload_store import default_run_dir

    validate_omni_args(args)
    path = args.stage_configs_path
    pipeline = load_pipeline_config(path)
    logger.info("omni mode: pipeline %s (stages %s)", path,
                ", ".join(f"{s.stage_id} {s.name}" for s in pipeline.stages))
    entry = pipeline.entry_stage
    if args.stage_id is not None and args.stage_id != entry.stage_id:
        raise ValueError(f"--stage-id {args.stage_id}: without --headless this process "
                         f"serves the entry stage ({entry.stage_id}); start other stages' "
                         "replicas with --headless --stage-id N")
    flags = {name: getattr(engine_args, name) for name in EXPLICIT_FLAGS_WIN}
    apply_stage_engine_args(engine_args, entry.engine_args)
    _keep_explicit_flags(engine_args, flags, entry)
    if entry.pd is not None:
        _set_decode_kv_transfer_config(engine_args, entry, path, args.omni_heartbeat_timeout,
                                       args.omni_master_address)
    host = Host.current()
    devices = plan_head(pipeline, engine_args, args.omni_placement, path, host)
    placement_env = place_engine(entry, engine_args, devices.get(entry.stage_id), host, path)
    apply_cpu_kv_cache(entry, engine_args, host)
    settings = OmniSettings(
        stage_configs_path=os.path.abspath(path), stage_id=entry.stage_id, entry=True,
        payload_dir=default_run_dir(), devices=devices, placement_env=placement_env,
        cluster=ClusterSettings(
            host=args.omni_master_address, port=args.omni_master_port,
            heartbeat_timeout=args.omni_heartbeat_timeout, lb_policy=args.omni_lb_policy,
            replica_wait_timeout=args.omni_replica_wait_timeout,
            admission_timeout=args.omni_admission_timeout,
            stall_timeout=args.omni_stall_timeout,
            request_timeout=args.omni_request_timeout, insecure=args.omni_cluster_insecure),
        realtime=RealtimeSettings(max_sessions=args.omni_realtime_max_sessions,
                                  idle_timeout=args.omni_realtime_idle_timeout,
                                  max_input_audio=args.omni_realtime_max_input_audio),
        row_cache_bytes=int(args.omni_row_cache_gib * GIB))
    engine_args.additional_config = settings.additional_config(
        engine_args.additional_config if isinstance(engine_args.additional_config, dict)
        else None)
    middleware = list(getattr(args, "middleware", None) or [])
    if MIDDLEWARE_QUALNAME not in middleware and hasattr(args, "middleware"):
        args.middleware = [*middleware, MIDDLEWARE_QUALNAME]


#: ``EngineArgs`` fields whose explicit command-line value wins over the entry stage's
#: YAML ``engine_args`` (the device share, the batch limits and the context length the
#: pipelines and plans set)
EXPLICIT_FLAGS_WIN = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                      "max_model_len")


def _keep_explicit_flags(engine_args, flags: dict, entry) -> None:
    """Each of ``flags`` (:data:`EXPLICIT_FLAGS_WIN` -> its value before the YAML's were
    applied) given on the command line (not vLLM's default) wins over the entry stage's
    ``engine_args`` in the YAML."""
    from vllm.engine.arg_utils import EngineArgs

    for name, value in flags.items():
        if value != getattr(EngineArgs, name) and getattr(engine_args, name) != value:
            logger.info("stage %d (%s): --%s %s over the pipeline's %s", entry.stage_id,
                        entry.name, name.replace("_", "-"), value, getattr(engine_args, name))
            setattr(engine_args, name, value)


def _set_decode_kv_transfer_config(engine_args, entry, path: str, heartbeat_timeout: float,
                                   host: str) -> None:
    """The decode engine's ``kv_transfer_config``; its KV transfers (and those of the
    head's own prefill replicas) advertise ``host``, the head's address."""
    from vllm.config import KVTransferConfig

    from vllm_omni_plugin.config.schema import StageConfigError
    from vllm_omni_plugin.kv_transfer import advertise_host, kv_transfer_config, new_engine_id

    if engine_args.kv_transfer_config is not None:
        raise StageConfigError(
            "--kv-transfer-config: the plugin sets the decode stage's KV transfer config "
            "from its 'pd' block; remove the flag", path=path, stage_id=entry.stage_id,
            stage_name=entry.name, field="pd")
    engine_args.kv_transfer_config = KVTransferConfig(
        **kv_transfer_config(entry.pd, new_engine_id(entry.name),
                             entry.pd.transfer_timeout(heartbeat_timeout)))
    advertise_host(host, entry.stage_id)


def apply_stage_engine_args(engine_args, overrides: dict) -> None:
    """Set each ``EngineArgs`` field in ``overrides``; ``hf_overrides`` dicts merge."""
    for key, value in overrides.items():
        if key == "hf_overrides" and isinstance(value, dict):
            merged = dict(engine_args.hf_overrides or {}) if isinstance(
                engine_args.hf_overrides, dict) else {}
            merged.update(value)
            value = merged
        setattr(engine_args, key, value)
