"""The plugin's settings: the one contract the CLI hands the engine side.

:class:`OmniSettings` is built from the omni flags by
:func:`vllm_omni_plugin.config.cli.apply_omni_args` (head) or
:func:`~vllm_omni_plugin.config.cli.headless_plan` (headless) and travels to
every vLLM process of a stage (API server, engine core, workers) in
``vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]``: vLLM copies
``additional_config`` into each of them. Every default lives here; the flags'
defaults are read from these fields.

The cluster token is not part of it: ``additional_config`` is logged and
hashed by vLLM, a secret must not be. It stays in
``VLLM_OMNI_PLUGIN_CLUSTER_TOKEN`` (see :mod:`vllm_omni_plugin.envs`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ADDITIONAL_CONFIG_KEY = "omni_plugin"


class ClusterSettings(BaseModel):
    """The head's control plane and request admission (head only).

    Attributes:
        host: address the omni master and coordinator bind to.
        port: the omni master's port (0: kernel-chosen).
        heartbeat_timeout: seconds without a heartbeat before a replica is ERROR.
        lb_policy: ``random``, ``round-robin`` or ``least-queue-length``.
        replica_wait_timeout: seconds a request waits for a replica of a stage
            while one may come back, before HTTP 503.
        admission_timeout: seconds a request for more than text waits for
            room at the downstream stages, before HTTP 429.
        stall_timeout: seconds a local stage engine (the head's, or a headless
            process's own) may leave a liveness probe unanswered before it is killed and
            restarted (:mod:`vllm_omni_plugin.replicas.liveness`), for every stage;
            ``0`` disables the probe; None: each stage's ``runtime.stall_timeout``, else
            :data:`~vllm_omni_plugin.replicas.liveness.DEFAULT_STALL_TIMEOUT_S`.
        request_timeout: seconds a request may take from the head's first sight of it
            to its last output before it fails with HTTP 504; None: no limit.
        insecure: the head's control plane listens on a network address without a
            cluster token (``--omni-cluster-insecure``); shown in ``/metrics``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    heartbeat_timeout: float = Field(default=30.0, gt=0)
    lb_policy: str = "random"
    replica_wait_timeout: float = Field(default=30.0, gt=0)
    admission_timeout: float = Field(default=30.0, ge=0)
    stall_timeout: float | None = Field(default=None, ge=0)
    request_timeout: float | None = Field(default=None, gt=0)
    insecure: bool = False


class RealtimeSettings(BaseModel):
    """The Realtime API's limits (``/v1/realtime``, head only).

    Attributes:
        max_sessions: WebSocket sessions open at once; one more is refused (closed
            with code 1013, "try again later", after an ``error`` event saying why).
        idle_timeout: seconds a session may go without a client event while no
            response runs, before the server closes it (code 1000, after an
            ``error`` event).
        max_input_audio: seconds of audio a session's input audio buffer holds at most
            (pcm16 at 24 kHz: 48,000 bytes a second); an append past it is refused with
            an ``error`` event and the buffer kept. The default, 300 s (14.4 MB), is
            about 3,900 audio tokens of Qwen3-Omni's audio encoder (13 a second), far
            below its context, and far longer than one spoken turn.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    max_sessions: int = Field(default=8, ge=1)
    idle_timeout: float = Field(default=300.0, gt=0)
    max_input_audio: float = Field(default=300.0, gt=0)


class OmniSettings(BaseModel):
    """Settings of one stage engine in omni mode.

    Attributes:
        stage_configs_path: absolute path of the pipeline YAML.
        stage_id: the stage this engine serves.
        entry: True for the engine ``vllm serve`` builds (the entry stage),
            False for downstream stage engines.
        payload_dir: the inter-stage payload store's run directory, or None.
        devices: the head's placement: device indices per stage id of every stage it
            runs (``runtime.devices`` or ``--omni-placement``'s default; see
            :mod:`vllm_omni_plugin.config.placement`); a stage absent is left to vLLM.
        placement_env: the environment this engine's workers run in, which places
            them (``{"CUDA_VISIBLE_DEVICES": "1"}``, ``{"VLLM_CPU_OMP_THREADS_BIND":
            "0|1"}``; see :mod:`vllm_omni_plugin.worker.placement`), or None.
        cluster: the head's control-plane settings.
        realtime: the Realtime API's limits.
        row_cache_bytes: host memory (bytes) each engine of a stage whose requests
            publish rows (the Qwen3-Omni thinker) keeps for the rows of prefix-cached KV
            blocks, so that such requests read the prefix cache
            (:mod:`vllm_omni_plugin.worker.row_cache`); 0: they compute every position.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    stage_configs_path: str
    stage_id: int = Field(default=0, ge=0)
    entry: bool = True
    payload_dir: str | None = None
    devices: dict[int, str] = Field(default_factory=dict)
    placement_env: dict[str, str] | None = None
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    realtime: RealtimeSettings = Field(default_factory=RealtimeSettings)
    row_cache_bytes: int = Field(default=1 << 30, ge=0)

    def for_stage(self, stage_id: int, **changes: Any) -> OmniSettings:
        """These settings for a downstream engine of ``stage_id``."""
        return self.model_copy(update={"stage_id": stage_id, "entry": False, **changes})

    def additional_config(self, base: dict | None = None) -> dict[str, Any]:
        """``base`` (an ``additional_config``) with these settings under
        :data:`ADDITIONAL_CONFIG_KEY`."""
        return {**(base or {}), ADDITIONAL_CONFIG_KEY: self.model_dump()}

    @classmethod
    def from_vllm_config(cls, vllm_config) -> OmniSettings | None:
        """The settings of this engine, None when not in omni mode.

        Raises:
            pydantic.ValidationError: the stored settings are malformed.
        """
        extra = getattr(vllm_config, "additional_config", None) or {}
        value = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
        return cls.model_validate(value) if isinstance(value, dict) else None


def in_omni_mode(vllm_config) -> bool:
    """Whether ``vllm_config`` (a ``VllmConfig``) belongs to an engine of an omni pipeline:
    its ``additional_config`` carries the plugin's settings. Cheap (no validation): the
    compat patches ask it on every call to tell omni mode from plain vLLM."""
    extra = getattr(vllm_config, "additional_config", None)
    return isinstance(extra, dict) and ADDITIONAL_CONFIG_KEY in extra


def is_entry_stage(vllm_config) -> bool:
    """True for the engine ``vllm serve`` builds in omni mode (not a downstream stage)."""
    settings = OmniSettings.from_vllm_config(vllm_config)
    return settings is not None and settings.entry
