"""KV transfer between the prefill and decode roles of a stage (vLLM KV connectors).

The plugin's connector, :class:`~vllm_omni_plugin.kv_transfer.mooncake.OmniMooncakeConnector`,
is registered with vLLM's ``KVConnectorFactory`` under :data:`CONNECTOR_NAME`, so
``--kv-transfer-config '{"kv_connector": "OmniMooncakeConnector", ...}'`` selects it in any
vLLM process where the plugin is loaded. Importing this package imports no vLLM module;
the connector module is imported only when vLLM builds a connector.
"""

from __future__ import annotations

#: The name the connector is registered under (``KVTransferConfig.kv_connector``).
CONNECTOR_NAME = "OmniMooncakeConnector"
CONNECTOR_MODULE = "vllm_omni_plugin.kv_transfer.mooncake"

#: ``kv_connector_extra_config`` keys the plugin's connector reads (vLLM's own keys, such as
#: ``mooncake_protocol`` and ``num_workers``, keep their meaning).
EXTRA_BOOTSTRAP_PORT = "omni_plugin_bootstrap_port"
EXTRA_MAX_DESCS_PER_PEER = "omni_plugin_max_descs_per_peer"

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
