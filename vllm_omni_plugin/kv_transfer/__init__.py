"""KV transfer between the prefill and decode roles of a stage (vLLM KV connectors).

The plugin's connector, :class:`~vllm_omni_plugin.kv_transfer.mooncake.OmniMooncakeConnector`,
is registered with vLLM's ``KVConnectorFactory`` under :data:`CONNECTOR_NAME`, so
``--kv-transfer-config '{"kv_connector": "OmniMooncakeConnector", ...}'`` selects it in any
vLLM process where the plugin is loaded. Importing this package imports no vLLM module;
the connector module is imported only when vLLM builds a connector.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid

from vllm_omni_plugin.logger import init_logger

logger = init_logger(__name__)

#: The name the connector is registered under (``KVTransferConfig.kv_connector``).
CONNECTOR_NAME = "OmniMooncakeConnector"
CONNECTOR_MODULE = "vllm_omni_plugin.kv_transfer.mooncake"

#: ``kv_connector_extra_config`` keys the plugin's connector reads (vLLM's own keys, such as
#: ``mooncake_protocol`` and ``num_workers``, keep their meaning).
EXTRA_BOOTSTRAP_PORT = "omni_plugin_bootstrap_port"
EXTRA_MAX_DESCS_PER_PEER = "omni_plugin_max_descs_per_peer"
EXTRA_TRANSFER_TIMEOUT = "omni_plugin_transfer_timeout_s"

#: Transfer descriptors (``src, dst, length`` triples) one write to a peer may carry.
#: Measured on Mooncake 0.3.13 over TCP: more than about 2048 outstanding descriptors per peer
#: fail and leave that peer's session broken; half of that leaves headroom.
DEFAULT_MAX_DESCS_PER_PEER = 1024


def register_connectors() -> bool:
    """Register the plugin's connector with vLLM's ``KVConnectorFactory`` (lazily: the
    connector module is imported when vLLM first builds it). Returns False when the name
    was already registered (``register()`` runs in every vLLM process, possibly twice)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # already registered in this process
        return False
    return True


#: The address vLLM's side channel and Mooncake's transfer engine advertise to peers
#: (vLLM's ``get_ip()``: this variable, else the address of the default route).
HOST_IP_ENV = "VLLM_HOST_IP"


def advertise_host(host: str, stage_id: int) -> str | None:
    """Make the engines this process starts (of stage ``stage_id``) advertise ``host`` for
    KV transfers (where peers write to and pull from), unless ``VLLM_HOST_IP`` is set
    already; logs the outcome. ``host`` is the address the plugin's own peers reach this
    process at (a head's ``--omni-master-address``, a headless replica's route-probe
    address); a wildcard or a host name is left to vLLM. Returns the address now in
    ``VLLM_HOST_IP``, or None.

    Raises:
        ValueError: ``VLLM_HOST_IP`` is not an address of this host (vLLM's side channel
            binds it; without this check the engine fails deep in its start-up, and a
            prefill engine of vLLM's offline ``LLM`` hangs).
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None and not address.is_unspecified:
        os.environ.setdefault(HOST_IP_ENV, str(address))
    advertised = os.environ.get(HOST_IP_ENV)
    if advertised:
        _check_local(advertised, stage_id)
    logger.info("stage %d: KV transfers advertise %s (%s)", stage_id, advertised,
                HOST_IP_ENV)
    return advertised


def _check_local(address: str, stage_id: int) -> None:
    """Raise ValueError naming ``VLLM_HOST_IP`` unless ``address`` can be bound here."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        raise ValueError(
            f"{HOST_IP_ENV}={address} is not an address of this host ({exc.strerror}): stage "
            f"{stage_id}'s KV transfers bind it; set it to one of this host's addresses, or "
            f"unset it") from None


#: The ``SamplingParams.extra_args`` key vLLM's KV connectors read per request.
KV_TRANSFER_PARAMS = "kv_transfer_params"


def new_engine_id(stage_name: str) -> str:
    """A fresh engine id for one start of an engine of ``stage_name``: the decode side
    caches a prefill engine's addresses by engine id, so a restarted engine needs a new
    one."""
    return f"{stage_name}-{uuid.uuid4().hex[:12]}"


def kv_transfer_config(pd, engine_id: str, transfer_timeout_s: float,
                       bootstrap_port: int | None = None) -> dict:
    """``KVTransferConfig`` fields of one engine of a stage with ``pd`` (a ``PDConfig``):
    the plugin's connector, ``kv_producer`` for a prefill stage, ``kv_consumer`` for a
    decode stage, Mooncake's protocol and device, the transfer timeout (seconds; see
    :class:`~vllm_omni_plugin.kv_transfer.mooncake.OmniMooncakeConnectorWorker`) and the
    bootstrap port of a prefill engine. vLLM's ``kv_load_failure_policy`` is ``fail``: a
    request whose KV cache does not arrive ends with finish reason ``error``."""
    extra = {"mooncake_protocol": pd.protocol, EXTRA_MAX_DESCS_PER_PEER: pd.max_descs_per_peer,
             EXTRA_TRANSFER_TIMEOUT: transfer_timeout_s}
    if pd.device_name:
        extra["device_name"] = pd.device_name
    if bootstrap_port is not None:
        extra[EXTRA_BOOTSTRAP_PORT] = bootstrap_port
    return {"kv_connector": CONNECTOR_NAME,
            "kv_role": "kv_producer" if pd.role == "prefill" else "kv_consumer",
            "engine_id": engine_id, "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": extra}


def prefill_request_params(transfer_id: str) -> dict:
    """``kv_transfer_params`` of a request to a prefill engine: keep its KV cache for the
    decode engine that asks for ``transfer_id``."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def prefill_engine_params(vllm_config, host: str) -> dict | None:
    """Where a decode engine pulls from this prefill engine (``remote_engine_id``,
    ``remote_bootstrap_addr``), or None when ``vllm_config`` is not a prefill engine of
    the plugin's connector. ``host``: the address decode engines reach this one at."""
    config = getattr(vllm_config, "kv_transfer_config", None)
    if config is None or config.kv_connector != CONNECTOR_NAME or \
            config.kv_role != "kv_producer":
        return None
    port = (config.kv_connector_extra_config or {}).get(EXTRA_BOOTSTRAP_PORT)
    if port is None:
        return None
    return {"remote_engine_id": config.engine_id,
            "remote_bootstrap_addr": f"http://{host}:{port}"}


def decode_request_params(transfer_id: str, prefill_engine: dict) -> dict:
    """``kv_transfer_params`` of a request to a decode engine: pull the prompt's KV cache
    that the prefill engine described by ``prefill_engine`` (see
    :func:`prefill_engine_params`) keeps under ``transfer_id``."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "transfer_id": transfer_id, **prefill_engine}
