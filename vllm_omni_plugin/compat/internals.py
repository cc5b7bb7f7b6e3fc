"""The vLLM internals the plugin reads, indexed: one accessor each, and :data:`INTERNALS`.

vLLM's public interface (``EngineClient``'s methods and declared attributes, the config
dataclasses, ``SamplingParams``, ``RequestOutput``, the extension points of DESIGN.md §4)
is read directly. Everything else the plugin reads of vLLM (an instance attribute a vLLM
``__init__`` sets, a private name, the fields of vLLM's internal messages, the module tree
of a vLLM model, a behaviour a liveness check relies on) goes through a function of this
module, whose docstring names the vLLM path it reads, the releases it was read from and
what it does when the path is missing. Two kinds of use are listed without a wrapper:

* a plugin class that subclasses a vLLM class (``OmniMooncakeConnectorWorker``,
  ``OmniPlacedExecutor``, ``OmniPlacedUniProcExecutor``) overrides vLLM's methods and
  calls them on ``super()`` (kind :data:`OVERRIDE`), and reads the fields of the
  objects vLLM hands those methods (kinds :data:`FIELD`, :data:`ATTRIBUTE`);
* the patches and shims of the other ``compat/`` modules read what they patch; their
  reads are listed here with the shim as owner.

:data:`INTERNALS` lists every one of them (who reads it, the vLLM path, what kind of
thing it is, the releases it was read from). ``plugin_tests/unit/test_compat_internals.py``
walks it on every supported release (the CUDA-wheel row without engines too): each path
must still be there, by vLLM's source, read without importing it; the behaviour that
needs a running engine is checked in ``plugin_tests/engine/test_pipeline_engine.py``
(liveness canaries). When a canary fails, vLLM moved the thing: update the accessor here
(feature detection, no version check) and its entry.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

#: The vLLM releases every entry was read from (the supported range, DESIGN.md §5).
RELEASES = ("0.30", "0.31", "0.32", "0.33")

# kinds of entries (see Internal.kind)
#: an instance attribute assigned (``self.NAME = ...``) in a method of the class
ATTRIBUTE = "attribute"
#: a class-level annotated field (dataclass, msgspec ``Struct``, ``TypedDict`` key)
FIELD = "field"
#: a method (or property) of the class with these parameter names (``detail``)
METHOD = "method"
#: a method of the class with these parameter names (``detail``) that the plugin class
#: named by ``owner`` overrides with the same parameters (and the same ``async``-ness)
OVERRIDE = "override"
#: a module-level function with these parameter names (``detail``), or a module-level name
FUNCTION = "function"
#: source text (``detail``, each as ``ast.unparse`` writes it) inside the function or class
#: named by the path, or inside any module of the package named by a path without ``:``
SOURCE = "source"


class Internal(NamedTuple):
    """One vLLM internal the plugin reads.

    Attributes:
        owner: who reads it: a function of this module or of a shim
            (``module.function``), or the plugin's method that overrides it
            (``module:Class.method``).
        path: where vLLM defines it: ``vllm.module:Class.name`` (or ``vllm.module:name``;
            for :data:`SOURCE` a ``vllm.package`` is searched whole).
        kind: :data:`ATTRIBUTE`, :data:`FIELD`, :data:`METHOD`, :data:`OVERRIDE`,
            :data:`FUNCTION` or :data:`SOURCE`.
        detail: parameter names (methods, functions; None: not checked) or source texts
            (:data:`SOURCE`).
        releases: the vLLM releases it was read from.
    """

    owner: str
    path: str
    kind: str
    detail: tuple[str, ...] | None = None
    releases: tuple[str, ...] = RELEASES


def _missing(what: str) -> AttributeError:
    return AttributeError(f"vLLM has no {what} (read from vLLM {RELEASES[0]}-{RELEASES[-1]}); "
                          "vllm_omni_plugin/compat/internals.py needs updating")


# -- the engine client (AsyncLLM) ---------------------------------------------------------
def engine_processes(engine) -> list | None:
    """The ``multiprocessing`` processes of ``engine``'s EngineCores (an ``AsyncLLM``).

    Reads ``AsyncLLM.engine_core`` (the ``AsyncMPClient``) ``.resources``
    (``BackgroundResources``) ``.engine_manager`` (``CoreEngineProcManager``)
    ``.processes``, all set in vLLM 0.30-0.33's constructors.

    Returns:
        The processes, or None where there are none to see: an engine whose EngineCore
        runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: an ``InprocClient`` without
        ``resources``), an engine manager of Ray actors, or a vLLM that moved them (the
        canaries fail then).
    """
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    processes = getattr(getattr(resources, "engine_manager", None), "processes", None)
    return list(processes) if processes else None


def liveness_probe(engine) -> Awaitable[bool]:
    """A liveness probe of ``engine``'s EngineCore (an ``AsyncLLM``): ``engine.is_sleeping()``.

    ``AsyncLLM.is_sleeping`` awaits ``engine_core.is_sleeping_async()``, a utility call
    (``call_utility_async("is_sleeping")``) that the EngineCore process answers in its busy
    loop between two steps (``EngineCoreProc._handle_client_request``,
    ``EngineCoreRequestType.UTILITY``): vLLM 0.30-0.33. So an answer proves the loop turns,
    and a stopped or hung EngineCore leaves it unanswered.

    Returns:
        The awaitable (the engine's answer: whether it sleeps). Raises what the engine
        raises (``EngineDeadError`` for a dead one).
    """
    return engine.is_sleeping()


# -- requests ---------------------------------------------------------------------------
def prompt_token_ids_of(prompt) -> list[int] | None:
    """The token ids of a prompt as vLLM's API server passes it to ``AsyncLLM.generate``,
    or None when the prompt also carries multimodal data or embeddings, or has no token ids.

    Reads a mapping's ``prompt_token_ids`` and ``type`` (``"token"``) and the multimodal
    and embedding keys: the prompt types' ``multi_modal_data``, the engine inputs'
    (``vllm.inputs.engine``: ``TokensInput``, ``MultiModalInput``'s ``mm_kwargs`` /
    ``mm_placeholders``, ``EmbedsInput``'s ``prompt_embeds``); or an ``EngineCoreRequest``'s
    ``prompt_token_ids``, ``mm_features`` and ``prompt_embeds`` (vLLM 0.30-0.33). A prompt
    without them counts as having none (None when it has no token ids).
    """
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        other = prompt.get("type", "token") != "token" or any(
            prompt.get(k) for k in ("multi_modal_data", "mm_kwargs", "mm_placeholders",
                                    "prompt_embeds"))
    else:
        ids = getattr(prompt, "prompt_token_ids", None)
        other = bool(getattr(prompt, "mm_features", None)) or getattr(
            prompt, "prompt_embeds", None) is not None
    if other or not isinstance(ids, list) or not ids:
        return None
    return list(ids)


def cache_salt_of(prompt) -> str | None:
    """The ``cache_salt`` of a prompt in the shapes :func:`prompt_token_ids_of` reads: a
    mapping's ``cache_salt`` key (vLLM's prompt types and engine inputs) or an
    ``EngineCoreRequest``'s ``cache_salt`` (vLLM 0.30-0.33); None when it has none."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else getattr(
        prompt, "cache_salt", None)
    return salt if isinstance(salt, str) else None


def sampling_param_fields() -> tuple[str, ...]:
    """The field names of ``vllm.SamplingParams`` (imports vLLM), private ones included.

    Reads ``SamplingParams.__struct_fields__``: a ``msgspec.Struct`` in vLLM 0.30-0.33;
    a dataclass's fields where it is one.

    Raises:
        TypeError: ``SamplingParams`` is neither.
    """
    from vllm.sampling_params import SamplingParams

    names = getattr(SamplingParams, "__struct_fields__", None)
    if names is None:
        import dataclasses

        names = tuple(f.name for f in dataclasses.fields(SamplingParams))
    return tuple(names)


# -- configs ----------------------------------------------------------------------------
def text_model_config(vllm_config, text_config, architectures: list[str]):
    """``vllm_config`` for a decoder built from ``text_config`` (an HF text config) as
    ``architectures``: ``VllmConfig.with_hf_config`` and, as that leaves it, the copy's
    ``model_config.hf_text_config`` (which vLLM's decoders read) set to ``text_config``.

    Reads ``VllmConfig.with_hf_config(hf_config, architectures)`` and writes
    ``ModelConfig.hf_text_config`` (set in ``ModelConfig.__post_init__``): vLLM 0.30-0.33.
    ``vllm_config`` itself is not changed.

    Raises:
        AttributeError: this vLLM's ``VllmConfig`` has no ``with_hf_config``.
    """
    if not hasattr(vllm_config, "with_hf_config"):
        raise _missing("VllmConfig.with_hf_config")
    config = vllm_config.with_hf_config(text_config, architectures=list(architectures))
    config.model_config.hf_text_config = text_config
    return config


def served_vllm_config(app) -> Any:
    """The ``VllmConfig`` of the model vLLM's API server serves, from its ASGI ``app``
    (None for another app, or before vLLM set its state).

    Reads ``app.state.vllm_config``, which vLLM's ``init_app_state`` sets
    (``vllm/entrypoints/launchers/api_server/app_state.py``, vLLM 0.30-0.33; the canary
    searches all of ``vllm.entrypoints``, where the launchers have moved before).
    """
    return getattr(getattr(app, "state", None), "vllm_config", None)


def media_connector(model_config) -> Any:
    """vLLM's media connector as its chat parser builds one for ``model_config`` (a
    ``ModelConfig``, or None: vLLM's defaults): the connector ``VLLM_MEDIA_CONNECTOR``
    names in ``MEDIA_CONNECTOR_REGISTRY`` (``"http"``, vLLM's ``MediaConnector``, unless
    a user registered another), with the served model's ``--media-io-kwargs``,
    ``--allowed-local-media-path`` and ``--allowed-media-domains``.

    The caller awaits ``load_from_url_async(url, media_io, fetch_timeout=seconds)``,
    which loads a ``data:`` URL through ``media_io.load_base64(media_type, data)``, a
    ``file:`` URL under the allowed path through ``media_io.load_file(path)`` and an
    ``http(s):`` URL of an allowed domain through ``media_io.load_bytes(data)``, fetching
    at most ``media_io.get_max_bytes()`` bytes (``vllm/multimodal/media/connector.py``,
    the chat parser's ``_connector`` in ``chat_utils.py``, vLLM 0.30-0.33).
    """
    import vllm.envs as envs
    from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY

    return MEDIA_CONNECTOR_REGISTRY.load(
        envs.VLLM_MEDIA_CONNECTOR,
        media_io_kwargs=getattr(model_config, "media_io_kwargs", None),
        allowed_local_media_path=getattr(model_config, "allowed_local_media_path", "") or "",
        allowed_media_domains=getattr(model_config, "allowed_media_domains", None))


def chat_serving(app) -> Any:
    """vLLM's chat completion serving (``OpenAIServingChat``) of its API server's ASGI
    ``app``: the handler behind ``/v1/chat/completions``, whose
    ``create_chat_completion(request, raw_request=None)`` answers a
    ``ChatCompletionRequest`` with an async generator of SSE events (streamed), a
    response, or an ``ErrorResponse``, and whose ``create_error_response(exc)`` (a
    static method of vLLM's ``BaseServing``) makes what it raised the ``ErrorResponse``
    vLLM's route answers with. None for another app, or a model without chat.

    Reads ``app.state.openai_serving_chat``, which vLLM's ``init_app_state`` sets
    (``vllm/entrypoints/generate/api_router.py``, vLLM 0.30-0.33).
    """
    return getattr(getattr(app, "state", None), "openai_serving_chat", None)


def chat_completion_types() -> tuple[type, type]:
    """``(ChatCompletionRequest, ErrorResponse)``: vLLM's request model of
    ``/v1/chat/completions`` (``vllm.entrypoints.openai.chat_completion.protocol``) and
    its error answer (``vllm.entrypoints.serve.engine.protocol``, with ``error.code``,
    ``error.message`` and ``error.param``), vLLM 0.30-0.33."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    return ChatCompletionRequest, ErrorResponse


def websocket_metrics_middleware():
    """vLLM's ASGI middleware that counts WebSocket connections in ``/metrics``
    (``vllm:websocket_connections_active``, ``..._total``,
    ``vllm:websocket_connection_duration_seconds``), the one vLLM puts in front of its own
    realtime endpoint: ``vllm.entrypoints.speech_to_text.realtime.metrics:
    WebSocketMetricsMiddleware`` (vLLM 0.30-0.33), or None where vLLM has none."""
    try:
        from vllm.entrypoints.speech_to_text.realtime.metrics import (
            WebSocketMetricsMiddleware,
        )
    except ImportError:
        return None
    return WebSocketMetricsMiddleware


# -- workers and model runners ----------------------------------------------------------
def model_runner_of(worker):
    """The model runner of a vLLM worker (``Worker``, ``CPUWorker``): its ``model_runner``,
    set in ``init_device`` (vLLM 0.30-0.33).

    Raises:
        AttributeError: the worker has none (not initialised, or vLLM moved it).
    """
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise _missing(f"{type(worker).__name__}.model_runner")
    return runner


def flashinfer_available() -> bool:
    """Whether vLLM uses FlashInfer's kernels in this process's environment: vLLM's
    ``vllm.utils.flashinfer.has_flashinfer()`` (the ``flashinfer`` package installed, and
    either ``flashinfer-cubin`` installed or ``nvcc`` and ``ninja`` found, ``ninja`` on
    ``PATH``; vLLM 0.30-0.33). Engines started from this process inherit its ``PATH``, so
    they see the same answer. False where vLLM has no such function."""
    try:
        from vllm.utils.flashinfer import has_flashinfer
    except ImportError:
        return False
    return bool(has_flashinfer())


def profile_device_memory(worker, forward: Callable[[], None]) -> tuple[int, int] | None:
    """Run ``forward`` (a stage's memory profile) on ``worker``, measured as vLLM's GPU
    worker measures its own profiling forward: ``(peak, share)`` in bytes, ``peak`` the
    device memory taken since the worker's start-up snapshot plus the activations'
    transient high-water mark above what stays allocated (weights, activations,
    non-torch allocations: ``vllm.utils.mem_utils.memory_profiling(...)
    .non_kv_cache_memory`` from the worker's ``init_snapshot``, with the model runner's
    ``model_memory_usage`` as weights; like vLLM, it assumes that no other process
    changed its use of the device meanwhile) and ``share`` the device memory the engine
    may take (the worker's ``requested_memory``: ``gpu_memory_utilization`` of the
    device). Read from vLLM 0.30-0.33's ``Worker`` (V1 and V2 model runners).

    On vLLM's CPU platform (host memory, which vLLM does not profile) ``forward`` runs
    unmeasured and the result is None.

    Raises:
        AttributeError: a non-CPU worker without those attributes (vLLM moved them).
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        forward()
        return None
    snapshot = getattr(worker, "init_snapshot", None)
    share = getattr(worker, "requested_memory", None)
    weights = getattr(model_runner_of(worker), "model_memory_usage", None)
    if snapshot is None or share is None or weights is None:
        raise _missing("Worker.init_snapshot / requested_memory / "
                       "model_runner.model_memory_usage")
    from vllm.utils.mem_utils import memory_profiling

    with memory_profiling(snapshot, weights_memory=int(weights)) as result:
        forward()
    return int(result.non_kv_cache_memory), int(share)


# -- models -----------------------------------------------------------------------------
def bagel_attention_layers(model) -> list:
    """The ``Attention`` modules of vLLM's ``BagelForConditionalGeneration`` (``model``),
    one per decoder layer in order: ``model.language_model`` (a ``Qwen2ForCausalLM``)
    ``.model.layers[i].self_attn.attn`` (``Qwen2Model``, ``Qwen2DecoderLayer``,
    ``Qwen2Attention``; vLLM 0.30-0.33).

    Raises:
        AttributeError: one of those attributes is missing (vLLM changed the model).
    """
    try:
        return [layer.self_attn.attn for layer in model.language_model.model.layers]
    except AttributeError as exc:
        raise _missing(f"BagelForConditionalGeneration.language_model.model.layers[i]"
                       f".self_attn.attn ({exc})") from exc


def bagel_sincos_pos_embed(embed_dim: int, grid_size: int):
    """BAGEL's fixed 2-D sine-cosine position table of vLLM's BAGEL vision tower: a float
    ``numpy`` array ``[grid_size * grid_size, embed_dim]`` (the official code's
    ``get_2d_sincos_pos_embed``).

    Reads ``vllm.model_executor.models.bagel.PositionEmbedding._get_2d_sincos_pos_embed``
    (a private static method; vLLM 0.30-0.33).

    Raises:
        AttributeError: vLLM moved it.
    """
    from vllm.model_executor.models.bagel import PositionEmbedding

    table = getattr(PositionEmbedding, "_get_2d_sincos_pos_embed", None)
    if table is None:
        raise _missing("PositionEmbedding._get_2d_sincos_pos_embed")
    return table(embed_dim, grid_size)


class SiglipParts(NamedTuple):
    """The pieces of vLLM's ``SiglipVisionModel`` a caller runs one by one (BAGEL's
    editing ViT feeds its own patch positions): the patch embedding (a convolution), the
    position table (``nn.Embedding``), the encoder (called with ``inputs_embeds`` ``[B, n,
    hidden]`` and ``return_all_hidden_states=False``), the final LayerNorm, and the
    transformer whose ``load_weights`` takes HF's ``embeddings.*`` / ``encoder.*`` /
    ``post_layernorm.*`` names."""

    patch_embedding: Any
    position_embedding: Any
    encoder: Any
    post_layernorm: Any
    transformer: Any


def siglip_parts(model) -> SiglipParts:
    """:class:`SiglipParts` of vLLM's ``SiglipVisionModel`` (``model``):
    ``model.vision_model`` (``SiglipVisionTransformer``) ``.embeddings``
    (``SiglipVisionEmbeddings``: ``.patch_embedding``, ``.position_embedding``),
    ``.encoder``, ``.post_layernorm`` (built with ``require_post_norm=True``) (vLLM
    0.30-0.33).

    Raises:
        AttributeError: one of those attributes is missing (vLLM changed the model).
    """
    try:
        vision = model.vision_model
        embeddings = vision.embeddings
        return SiglipParts(embeddings.patch_embedding, embeddings.position_embedding,
                           vision.encoder, vision.post_layernorm, vision)
    except AttributeError as exc:
        raise _missing(f"SiglipVisionModel.vision_model.{{embeddings, encoder, "
                       f"post_layernorm}} ({exc})") from exc


def attention_kv_shape(module) -> tuple[int, int] | None:
    """``(num_kv_heads, head_size)`` of a vLLM ``Attention`` module (this rank's KV heads),
    or None for any other module.

    Reads ``Attention.num_kv_heads`` and ``Attention.head_size``, set in its constructor
    (``vllm/model_executor/layers/attention/attention.py``, vLLM 0.30-0.33).
    """
    if type(module).__name__ != "Attention" or not hasattr(module, "num_kv_heads"):
        return None
    return int(module.num_kv_heads), int(module.head_size)


def quant_method_name(module) -> str | None:
    """The class name of a vLLM layer's quantization method (``"UnquantizedLinearMethod"``,
    ``"Fp8OnlineLinearMethod"``...), or None for a module without one.

    Reads the ``quant_method`` that ``LinearBase`` and ``RoutedExperts`` (fused MoE) set in
    their constructors (vLLM 0.30-0.33).
    """
    method = getattr(module, "quant_method", None)
    return None if method is None else type(method).__name__


# -- vLLM's scheduler defaults ------------------------------------------------------------
class _PlannedGpu:
    """A stand-in for ``current_platform`` answering what ``EngineArgs.get_batch_defaults``
    asks of a GPU: its total memory (bytes), name and compute capability (a planned GPU is
    a data-centre one: never GB10's 12.1, which vLLM 0.33 keeps on the small tier).
    Anything else it is asked is recorded in :attr:`unknown` (vLLM catches the error and
    falls back to its small tier, which must not pass unnoticed)."""

    def __init__(self, memory_bytes: int, name: str):
        self.memory_bytes, self.name = memory_bytes, name
        self.unknown: list[str] = []

    def __getattr__(self, name: str):
        self.unknown.append(name)
        raise AttributeError(name)

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        return False

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self.memory_bytes

    def get_device_name(self, device_id: int = 0) -> str:
        return self.name

    def is_tpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False


def gpu_batch_defaults(memory_bytes: int, world_size: int = 1,
                       device_name: str = "") -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` vLLM's ``vllm serve`` gives an engine
    of ``world_size`` ranks on a GPU of ``memory_bytes`` named ``device_name`` (its
    ``OPENAI_API_SERVER`` defaults), from any platform, the CPU build included: vLLM's
    ``EngineArgs.get_batch_defaults(world_size)`` (vLLM 0.30-0.33; it reads
    ``current_platform`` of ``vllm.engine.arg_utils``, answered here for the planned GPU
    while it runs). In 0.30-0.33: 8,192 / 1,024 from 70 GiB (not an A100), 16,384 / 1,024
    from 160 GiB, 2,048 / 256 below.

    Raises:
        AttributeError: vLLM moved it, or it asks the platform something new.
    """
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    get = getattr(arg_utils.EngineArgs, "get_batch_defaults", None)
    if get is None or not hasattr(arg_utils, "current_platform"):
        raise _missing("EngineArgs.get_batch_defaults over arg_utils.current_platform")
    platform = arg_utils.current_platform
    planned = arg_utils.current_platform = _PlannedGpu(memory_bytes, device_name)
    try:
        tokens, seqs = get(world_size)
    finally:
        arg_utils.current_platform = platform
    if planned.unknown:
        raise AttributeError(
            "vLLM's EngineArgs.get_batch_defaults asks current_platform for "
            f"{', '.join(sorted(set(planned.unknown)))}, which _PlannedGpu in "
            "vllm_omni_plugin/compat/internals.py does not answer yet")
    context = UsageContext.OPENAI_API_SERVER
    return int(tokens[context]), int(seqs[context])


# -- vLLM's Mooncake connector (kv_transfer/mooncake.py subclasses it) ----------------------
_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


def mooncake_transfer_engine_available() -> bool:
    """Whether vLLM's Mooncake connector module imported Mooncake's ``TransferEngine``
    (its module-level ``TransferEngine`` is None where ``mooncake.engine`` does not import;
    vLLM 0.30-0.33)."""
    import importlib

    return getattr(importlib.import_module(_MOONCAKE), "TransferEngine", None) is not None


def mooncake_launches_bootstrap_server(vllm_config) -> bool:
    """Whether vLLM's Mooncake connector starts a bootstrap server in this engine's worker
    (the prefill side's serving rank). Reads the connector module's
    ``should_launch_bootstrap_server(vllm_config)`` (vLLM 0.30-0.33)."""
    import importlib

    return bool(importlib.import_module(_MOONCAKE).should_launch_bootstrap_server(vllm_config))


def mooncake_bootstrap_port(vllm_config) -> int:
    """The port vLLM's Mooncake connector binds its bootstrap server on. Reads the connector
    module's ``get_mooncake_bootstrap_addr(vllm_config)`` (``(host, port)``; vLLM 0.30-0.33;
    the port from ``VLLM_MOONCAKE_BOOTSTRAP_PORT``)."""
    import importlib

    return int(importlib.import_module(_MOONCAKE).get_mooncake_bootstrap_addr(vllm_config)[1])


def mooncake_release_bootstrap_waiters(worker, bootstrap_addr: str) -> None:
    """Wake and forget the waiters of ``worker``'s bootstrap query of ``bootstrap_addr``
    (after that query was cancelled: vLLM sets and drops its event only when its query
    returns). Reads ``MooncakeConnectorWorker._pending_bootstrap_queries`` (address ->
    ``asyncio.Event``, set in its constructor; vLLM 0.30-0.33).

    Raises:
        AttributeError: vLLM moved it.
    """
    try:
        pending = worker._pending_bootstrap_queries
    except AttributeError as exc:
        raise _missing("MooncakeConnectorWorker._pending_bootstrap_queries") from exc
    event = pending.pop(bootstrap_addr, None)
    if event is not None:
        event.set()


def mooncake_knows_engine(worker, remote_engine_id: str) -> bool:
    """Whether ``worker`` has bootstrapped the prefill engine ``remote_engine_id`` (knows
    its workers' addresses). Reads ``MooncakeConnectorWorker._remote_agents`` (engine id ->
    agents, set in its constructor; vLLM 0.30-0.33).

    Raises:
        AttributeError: vLLM moved it.
    """
    try:
        return remote_engine_id in worker._remote_agents
    except AttributeError as exc:
        raise _missing("MooncakeConnectorWorker._remote_agents") from exc


def mooncake_send_meta(worker, transfer_id: str):
    """The ``SendBlockMeta`` of a finished request ``worker`` (the prefill side) holds for
    ``transfer_id``, or None. Reads ``MooncakeConnectorWorker.reqs_need_send`` (transfer id
    -> ``SendBlockMeta``, set in its constructor; vLLM 0.30-0.33).

    Raises:
        AttributeError: vLLM moved it.
    """
    try:
        return worker.reqs_need_send.get(transfer_id)
    except AttributeError as exc:
        raise _missing("MooncakeConnectorWorker.reqs_need_send") from exc


def mooncake_fail_receives(worker, pull_metas: dict, req_ids: list[str], reason: str) -> None:
    """Report the pulls of ``req_ids`` (among ``pull_metas``) as failed loads, as vLLM's
    decode side does for its own failures: ``MooncakeConnectorWorker._handle_failed_recv(
    pull_metas, req_ids, reason)`` (vLLM 0.30-0.33).

    Raises:
        AttributeError: vLLM moved it.
    """
    handle = getattr(worker, "_handle_failed_recv", None)
    if handle is None:
        raise _missing("MooncakeConnectorWorker._handle_failed_recv")
    handle(pull_metas, req_ids, reason)


def cached_twins(kv_cache_manager, block) -> list:
    """The cached KV blocks of the scheduler's ``kv_cache_manager`` (a ``KVCacheManager``)
    holding the same tokens as ``block`` (its block hash), ``block`` included: vLLM keeps
    a block that fills with an already cached hash beside the first
    (``BlockHashToBlockMap``: no de-duplication), and its lookup returns the first.

    Reads ``KVCacheManager.block_pool``, ``BlockPool.cached_block_hash_to_block``,
    ``BlockHashToBlockMap._cache`` (a block, or a dict of them by block id, per key) and
    ``KVCacheBlock.block_hash`` (the key: the hash with its group id) (vLLM 0.30-0.33).
    """
    key = block.block_hash
    if key is None:
        return [block]
    found = kv_cache_manager.block_pool.cached_block_hash_to_block._cache.get(key)
    if found is None:
        return [block]
    return list(found.values()) if isinstance(found, dict) else [found]


# -- the index ----------------------------------------------------------------------------
_ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
_CORE_CLIENT = "vllm.v1.engine.core_client"
_MC = f"{_MOONCAKE}:MooncakeConnectorWorker"
_OMNI_MC = "vllm_omni_plugin.kv_transfer.mooncake:OmniMooncakeConnectorWorker"
_QWEN2 = "vllm.model_executor.models.qwen2"
_SIGLIP = "vllm.model_executor.models.siglip"
_CONNECTOR = "vllm.multimodal.media.connector"
_HERE = "vllm_omni_plugin.compat.internals"
_OMNI_WORKER = ("vllm_omni_plugin.worker.omni_worker:"
                "OmniWorkerMixin.compile_or_warm_up_model")

#: Every vLLM internal the plugin reads (see the module docstring), in the order above.
INTERNALS: tuple[Internal, ...] = (
    # engine_processes: the EngineCore processes the supervisor waits on and a stall kills
    Internal(f"{_HERE}.engine_processes", f"{_ASYNC_LLM}.engine_core", ATTRIBUTE),
    Internal(f"{_HERE}.engine_processes", f"{_CORE_CLIENT}:MPClient.resources", ATTRIBUTE),
    Internal(f"{_HERE}.engine_processes", f"{_CORE_CLIENT}:BackgroundResources.engine_manager",
             FIELD),
    Internal(f"{_HERE}.engine_processes", "vllm.v1.engine.utils:CoreEngineProcManager.processes",
             ATTRIBUTE),
    # liveness_probe: is_sleeping is a utility call the EngineCore's busy loop answers
    Internal(f"{_HERE}.liveness_probe", f"{_ASYNC_LLM}.is_sleeping", SOURCE,
             ("self.engine_core.is_sleeping_async()",)),
    Internal(f"{_HERE}.liveness_probe", f"{_CORE_CLIENT}:AsyncMPClient.is_sleeping_async",
             SOURCE, ("call_utility", "'is_sleeping'")),
    Internal(f"{_HERE}.liveness_probe", "vllm.v1.engine.core:EngineCore.is_sleeping", METHOD,
             ("self",)),
    Internal(f"{_HERE}.liveness_probe",
             "vllm.v1.engine.core:EngineCoreProc._handle_client_request", SOURCE,
             ("EngineCoreRequestType.UTILITY",)),
    # prompt_token_ids_of: what the API server hands AsyncLLM.generate
    *(Internal(f"{_HERE}.prompt_token_ids_of", f"vllm.v1.engine:EngineCoreRequest.{name}", FIELD)
      for name in ("prompt_token_ids", "mm_features", "prompt_embeds")),
    Internal(f"{_HERE}.prompt_token_ids_of", "vllm.inputs.engine:TokensInput.type", FIELD),
    Internal(f"{_HERE}.prompt_token_ids_of", "vllm.inputs.engine:TokensInput.prompt_token_ids",
             FIELD),
    Internal(f"{_HERE}.prompt_token_ids_of", "vllm.inputs.engine:MultiModalInput.mm_kwargs",
             FIELD),
    Internal(f"{_HERE}.prompt_token_ids_of",
             "vllm.inputs.engine:MultiModalInput.mm_placeholders", FIELD),
    Internal(f"{_HERE}.prompt_token_ids_of", "vllm.inputs.engine:EmbedsInput.prompt_embeds",
             FIELD),
    Internal(f"{_HERE}.cache_salt_of", "vllm.v1.engine:EngineCoreRequest.cache_salt", FIELD),
    Internal(f"{_HERE}.cache_salt_of", "vllm.inputs.engine:_InputOptions.cache_salt", FIELD),
    Internal(f"{_HERE}.sampling_param_fields", "vllm.sampling_params:SamplingParams", SOURCE,
             ("msgspec.Struct",)),
    # configs
    Internal(f"{_HERE}.text_model_config", "vllm.config.vllm:VllmConfig.with_hf_config", METHOD,
             ("self", "hf_config", "architectures")),
    Internal(f"{_HERE}.text_model_config", "vllm.config.model:ModelConfig.hf_text_config",
             ATTRIBUTE),
    # websocket_metrics_middleware: an ASGI middleware, built with the app it wraps
    *(Internal(f"{_HERE}.websocket_metrics_middleware",
               f"vllm.entrypoints.speech_to_text.realtime.metrics:WebSocketMetricsMiddleware."
               f"{name}", METHOD, params)
      for name, params in (("__init__", ("self", "app")),
                           ("__call__", ("self", "scope", "receive", "send")))),
    Internal(f"{_HERE}.served_vllm_config", "vllm.entrypoints", SOURCE,
             ("state.vllm_config = vllm_config",)),
    Internal(f"{_HERE}.chat_serving", "vllm.entrypoints", SOURCE,
             ("state.openai_serving_chat = ",)),
    Internal(f"{_HERE}.chat_serving",
             "vllm.entrypoints.openai.chat_completion.serving:"
             "OpenAIServingChat.create_chat_completion", METHOD,
             ("self", "request", "raw_request")),
    Internal(f"{_HERE}.chat_serving",
             "vllm.entrypoints.serve.engine.serving:BaseServing.create_error_response", METHOD,
             ("message", "err_type", "status_code", "param")),
    *(Internal(f"{_HERE}.chat_completion_types",
               f"vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest.{name}",
               FIELD) for name in ("messages", "stream")),
    *(Internal(f"{_HERE}.chat_completion_types",
               f"vllm.entrypoints.serve.engine.protocol:ErrorInfo.{name}", FIELD)
      for name in ("message", "param", "code")),
    Internal("vllm_omni_plugin.compat.api_auth.vllm_auth_middleware",
             "vllm.entrypoints.serve.middleware.register:init_entrypoints_middleware", SOURCE,
             ("app.add_middleware(AuthenticationMiddleware, tokens=tokens)",
              "for middleware in args.middleware:")),
    Internal("vllm_omni_plugin.compat.api_auth.vllm_auth_middleware",
             "vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware.__call__",
             METHOD, ("self", "scope", "receive", "send")),
    # workers and model runners
    Internal(f"{_HERE}.model_runner_of", "vllm.v1.worker.gpu_worker:Worker.model_runner",
             ATTRIBUTE),
    Internal(f"{_HERE}.model_runner_of", "vllm.v1.worker.cpu_worker:CPUWorker.model_runner",
             ATTRIBUTE),
    Internal(f"{_HERE}.flashinfer_available", "vllm.utils.flashinfer:has_flashinfer",
             FUNCTION, ()),
    Internal("vllm_omni_plugin.worker.placement:OmniPlacedExecutor._init_executor",
             "vllm.v1.executor.multiproc_executor:MultiprocExecutor._init_executor", OVERRIDE,
             ("self",)),
    Internal("vllm_omni_plugin.worker.placement:OmniPlacedUniProcExecutor._init_executor",
             "vllm.v1.executor.uniproc_executor:UniProcExecutor._init_executor", OVERRIDE,
             ("self",)),
    # the memory profile of a stage without a KV cache: vLLM's EngineCore calls the
    # workers' determine_available_memory only with a KV cache, compile_or_warm_up_model
    # always; the profile is measured as vLLM's GPU worker measures its own
    Internal(_OMNI_WORKER, "vllm.v1.engine.core:EngineCore._initialize_kv_caches", SOURCE,
             ("if has_kv_cache:", "self.model_executor.determine_available_memory()",
              "self.model_executor.compile_or_warm_up_model()")),
    Internal(_OMNI_WORKER, "vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model",
             OVERRIDE, ("self",)),
    Internal(_OMNI_WORKER, "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model",
             OVERRIDE, ("self",)),
    Internal(f"{_HERE}.profile_device_memory", "vllm.v1.worker.gpu_worker:Worker.init_snapshot",
             ATTRIBUTE),
    Internal(f"{_HERE}.profile_device_memory",
             "vllm.v1.worker.gpu_worker:Worker.requested_memory", ATTRIBUTE),
    Internal(f"{_HERE}.profile_device_memory",
             "vllm.v1.worker.gpu_model_runner:GPUModelRunner.model_memory_usage", ATTRIBUTE),
    Internal(f"{_HERE}.profile_device_memory",
             "vllm.v1.worker.gpu.model_runner:GPUModelRunner.model_memory_usage", ATTRIBUTE),
    Internal(f"{_HERE}.profile_device_memory", "vllm.utils.mem_utils:memory_profiling",
             FUNCTION, ("baseline_snapshot", "weights_memory")),
    Internal(f"{_HERE}.profile_device_memory",
             "vllm.utils.mem_utils:MemoryProfilingResult.non_kv_cache_memory", FIELD),
    Internal("vllm_omni_plugin.compat.model_runner.batch_req_ids",
             "vllm.v1.worker.gpu_model_runner:GPUModelRunner.input_batch", ATTRIBUTE),
    Internal("vllm_omni_plugin.compat.model_runner.batch_req_ids",
             "vllm.v1.worker.gpu_input_batch:InputBatch.req_ids", METHOD, ("self",)),
    Internal("vllm_omni_plugin.compat.model_runner.batch_req_ids",
             "vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model_state", ATTRIBUTE),
    Internal("vllm_omni_plugin.compat.model_runner.batch_req_ids",
             "vllm.v1.worker.gpu.model_runner:ExecuteModelState.input_batch", FIELD),
    Internal("vllm_omni_plugin.compat.model_runner.batch_req_ids",
             "vllm.v1.worker.gpu.input_batch:InputBatch.req_ids", FIELD),
    Internal("vllm_omni_plugin.compat.model_runner.watch_step",
             "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs", METHOD),
    Internal("vllm_omni_plugin.compat.streaming_max_tokens.apply",
             "vllm.v1.core.sched.scheduler:Scheduler._update_request_as_session", METHOD,
             ("self", "session", "update")),
    # media_connector: the connector vLLM's chat parser fetches media with
    Internal(f"{_HERE}.media_connector", f"{_CONNECTOR}:MEDIA_CONNECTOR_REGISTRY", FUNCTION),
    Internal(f"{_HERE}.media_connector", f"{_CONNECTOR}:MediaConnector.__init__", SOURCE,
             ("self.media_io_kwargs", "self.allowed_local_media_path",
              "self.allowed_media_domains")),
    Internal(f"{_HERE}.media_connector", f"{_CONNECTOR}:MediaConnector.load_from_url_async",
             METHOD, ("self", "url", "media_io", "fetch_timeout")),
    Internal(f"{_HERE}.media_connector", f"{_CONNECTOR}:MediaConnector.load_from_url_async",
             SOURCE, ("media_io.get_max_bytes()", "media_io.load_bytes",
                      "self._load_data_url", "self._load_file_url")),
    Internal(f"{_HERE}.media_connector", f"{_CONNECTOR}:MediaConnector._load_data_url",
             SOURCE, ("media_io.load_base64(media_type, data)",)),
    Internal(f"{_HERE}.media_connector", f"{_CONNECTOR}:MediaConnector._load_file_url",
             SOURCE, ("media_io.load_file(filepath)",)),
    # models
    Internal(f"{_HERE}.bagel_attention_layers",
             "vllm.model_executor.models.bagel:BagelForConditionalGeneration.language_model",
             ATTRIBUTE),
    Internal(f"{_HERE}.bagel_attention_layers", f"{_QWEN2}:Qwen2ForCausalLM.model", ATTRIBUTE),
    Internal(f"{_HERE}.bagel_attention_layers", f"{_QWEN2}:Qwen2Model.layers", ATTRIBUTE),
    Internal(f"{_HERE}.bagel_attention_layers", f"{_QWEN2}:Qwen2DecoderLayer.self_attn",
             ATTRIBUTE),
    Internal(f"{_HERE}.bagel_attention_layers", f"{_QWEN2}:Qwen2Attention.attn", ATTRIBUTE),
    Internal(f"{_HERE}.bagel_sincos_pos_embed",
             "vllm.model_executor.models.bagel:PositionEmbedding._get_2d_sincos_pos_embed",
             METHOD, ("embed_dim", "grid_size")),
    Internal(f"{_HERE}.siglip_parts", f"{_SIGLIP}:SiglipVisionModel.vision_model", ATTRIBUTE),
    Internal(f"{_HERE}.siglip_parts", f"{_SIGLIP}:SiglipVisionTransformer.embeddings",
             ATTRIBUTE),
    Internal(f"{_HERE}.siglip_parts", f"{_SIGLIP}:SiglipVisionTransformer.encoder", ATTRIBUTE),
    Internal(f"{_HERE}.siglip_parts", f"{_SIGLIP}:SiglipVisionTransformer.post_layernorm",
             ATTRIBUTE),
    Internal(f"{_HERE}.siglip_parts", f"{_SIGLIP}:SiglipVisionTransformer.load_weights",
             METHOD, ("self", "weights")),
    Internal(f"{_HERE}.siglip_parts", f"{_SIGLIP}:SiglipVisionEmbeddings.patch_embedding",
             ATTRIBUTE),
    Internal(f"{_HERE}.siglip_parts", f"{_SIGLIP}:SiglipVisionEmbeddings.position_embedding",
             ATTRIBUTE),
    Internal(f"{_HERE}.siglip_parts", f"{_SIGLIP}:SiglipEncoder.forward", METHOD,
             ("self", "inputs_embeds", "return_all_hidden_states")),
    Internal(f"{_HERE}.attention_kv_shape",
             "vllm.model_executor.layers.attention.attention:Attention.num_kv_heads", ATTRIBUTE),
    Internal(f"{_HERE}.attention_kv_shape",
             "vllm.model_executor.layers.attention.attention:Attention.head_size", ATTRIBUTE),
    Internal(f"{_HERE}.quant_method_name",
             "vllm.model_executor.layers.linear:LinearBase.quant_method", ATTRIBUTE),
    Internal(f"{_HERE}.quant_method_name",
             "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.quant_method",
             ATTRIBUTE),
    # vLLM's scheduler defaults for a GPU, read on any platform
    Internal(f"{_HERE}.gpu_batch_defaults",
             "vllm.engine.arg_utils:EngineArgs.get_batch_defaults", METHOD, ("cls", "world_size")),
    Internal(f"{_HERE}.gpu_batch_defaults", "vllm.engine.arg_utils:current_platform", FUNCTION),
    # the prefix cache's duplicate blocks, for the row cache's scheduler
    Internal(f"{_HERE}.cached_twins", "vllm.v1.core.kv_cache_manager:KVCacheManager.block_pool",
             ATTRIBUTE),
    Internal(f"{_HERE}.cached_twins",
             "vllm.v1.core.block_pool:BlockPool.cached_block_hash_to_block", ATTRIBUTE),
    Internal(f"{_HERE}.cached_twins", "vllm.v1.core.block_pool:BlockHashToBlockMap._cache",
             ATTRIBUTE),
    Internal(f"{_HERE}.cached_twins", "vllm.v1.core.kv_cache_utils:KVCacheBlock.block_hash",
             METHOD, ("self",)),
    # vLLM's Mooncake connector: read here, and overridden by the plugin's subclass
    Internal(f"{_HERE}.mooncake_transfer_engine_available", f"{_MOONCAKE}:TransferEngine",
             FUNCTION),
    Internal(f"{_HERE}.mooncake_launches_bootstrap_server",
             f"{_MOONCAKE}:should_launch_bootstrap_server", FUNCTION, ("vllm_config",)),
    Internal(f"{_HERE}.mooncake_bootstrap_port", f"{_MOONCAKE}:get_mooncake_bootstrap_addr",
             FUNCTION, ("vllm_config",)),
    Internal(f"{_HERE}.mooncake_release_bootstrap_waiters", f"{_MC}._pending_bootstrap_queries",
             ATTRIBUTE),
    Internal(f"{_HERE}.mooncake_knows_engine", f"{_MC}._remote_agents", ATTRIBUTE),
    Internal(f"{_HERE}.mooncake_send_meta", f"{_MC}.reqs_need_send", ATTRIBUTE),
    Internal(f"{_HERE}.mooncake_fail_receives", f"{_MC}._handle_failed_recv", METHOD,
             ("self", "pull_metas", "req_ids", "reason")),
    Internal(f"{_OMNI_MC}.record_send_reqs", f"{_MOONCAKE}:SendBlockMeta.expire_time", FIELD),
    Internal(f"{_OMNI_MC}.record_send_reqs",
             f"{_MOONCAKE}:MooncakeConnectorMetadata.reqs_to_send", ATTRIBUTE),
    Internal(f"{_OMNI_MC}.handle_new_engine_id", f"{_MOONCAKE}:PullReqMeta.remote_bootstrap_addr",
             FIELD),
    Internal(f"{_OMNI_MC}.__init__", f"{_MC}.__init__", OVERRIDE,
             ("self", "vllm_config", "engine_id", "kv_cache_config")),
    Internal("vllm_omni_plugin.kv_transfer.mooncake:OmniMooncakeConnector.__init__",
             f"{_MOONCAKE}:MooncakeConnector.__init__", OVERRIDE,
             ("self", "vllm_config", "role", "kv_cache_config")),
    Internal(f"{_OMNI_MC}._send_blocks", f"{_MC}._send_blocks", OVERRIDE,
             ("self", "remote_session", "src_ptrs", "dst_ptrs", "lengths")),
    Internal(f"{_OMNI_MC}._start_load_kv", f"{_MC}._start_load_kv", OVERRIDE,
             ("self", "reqs_to_recv")),
    Internal(f"{_OMNI_MC}.handle_new_engine_id", f"{_MC}.handle_new_engine_id", OVERRIDE,
             ("self", "remote_engine_id", "pull_metas")),
    Internal(f"{_OMNI_MC}.receive_kv_from_single_worker", f"{_MC}.receive_kv_from_single_worker",
             OVERRIDE, ("self", "worker_addr", "pull_metas")),
    Internal(f"{_OMNI_MC}.record_send_reqs", f"{_MC}.record_send_reqs", OVERRIDE,
             ("self", "metadata")),
    Internal(f"{_OMNI_MC}._build_transfer_params", f"{_MC}._build_transfer_params", OVERRIDE,
             ("self", "ready_reqs", "agent_meta", "local_regions", "remote_regions")),
    Internal("vllm_omni_plugin.compat.mooncake.use_bootstrap_port", "vllm.envs:enable_envs_cache",
             FUNCTION, ()),
    Internal("vllm_omni_plugin.compat.mooncake.use_bootstrap_port",
             "vllm.envs:disable_envs_cache", FUNCTION, ()),
)
