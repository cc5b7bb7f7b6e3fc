"""What vLLM's ``MooncakeConnectorWorker`` needs on vLLM's CPU build.

Why: ``MooncakeConnectorWorker.__init__`` asks ``torch.accelerator.current_device_index()``
for the device its sender threads bind to. With no accelerator (CPU torch, or CUDA torch on
a host without a GPU: "Found no NVIDIA driver") that call raises, so vLLM's connector cannot
start on its own CPU platform, although nothing else in it needs a device (host memory is
registered like device memory, and ``CpuPlatform.set_device(0)`` works). The call is inline
in ``__init__``, so no method override can reach it: :func:`cpu_device_index` replaces it,
only while the connector worker is built, and only where it raises on vLLM's CPU platform
(feature detection, no version check).
Upstream reason: ``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/
mooncake_connector.py`` (0.30-0.32) has no CPU branch for the device index.
Remove when: the lowest supported vLLM builds the Mooncake worker without that call on CPU
(the shim test ``test_shim_needed_mooncake_device_index`` fails then).

Also here: the bootstrap port. vLLM's prefill side reads it only from the environment
(``VLLM_MOONCAKE_BOOTSTRAP_PORT``, default 8998); :func:`use_bootstrap_port` sets it in the
connector's own process, where vLLM has already cached its environment.
Shim tests: ``plugin_tests/unit/test_compat_shims.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

#: The environment variable vLLM's Mooncake connector reads its bootstrap port from.
BOOTSTRAP_PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"


def _device_index_raises() -> bool:
    import torch

    try:
        torch.accelerator.current_device_index()
    except RuntimeError:
        return True
    return False


@contextlib.contextmanager
def cpu_device_index() -> Iterator[bool]:
    """While active, ``torch.accelerator.current_device_index()`` returns 0 on vLLM's CPU
    platform where it would raise. Yields whether it patched. Not thread-safe: use it only
    around ``MooncakeConnectorWorker.__init__`` (the worker's own start-up)."""
    import torch
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() and _device_index_raises()):
        yield False
        return
    original = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = lambda *args, **kwargs: 0
    try:
        yield True
    finally:
        torch.accelerator.current_device_index = original


def use_bootstrap_port(port: int) -> None:
    """Make vLLM's Mooncake connector in this process use ``port`` for its bootstrap server.

    vLLM's worker process caches its environment (``vllm.envs.enable_envs_cache``) before it
    builds KV connectors; the cache is rebuilt with vLLM's own ``disable_envs_cache`` /
    ``enable_envs_cache`` so that the new value is the one vLLM reads.

    Raises:
        RuntimeError: vLLM still reads another port, or ``port`` is already in use on this
            host (vLLM 0.30/0.31 would hang waiting for its server to start).
    """
    from vllm import envs

    cached = hasattr(envs.__getattr__, "cache_clear")
    envs.disable_envs_cache()
    os.environ[BOOTSTRAP_PORT_ENV] = str(port)
    if cached:
        envs.enable_envs_cache()
    seen = envs.VLLM_MOONCAKE_BOOTSTRAP_PORT
    if seen != port:
        raise RuntimeError(f"vLLM reads {BOOTSTRAP_PORT_ENV}={seen}, not the connector's port "
                           f"{port}; vllm_omni_plugin/compat/mooncake.py needs updating")
    ensure_port_free(port)


def ensure_port_free(port: int) -> None:
    """Raise ``RuntimeError`` naming ``port`` when a TCP server already listens on it.

    vLLM's bootstrap server binds ``0.0.0.0:port``; on 0.30/0.31 a port in use makes it spin
    forever instead of failing, so the connector checks first (a race with another process
    binding in between remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as the server will: a port left in TIME_WAIT is free, a listening one is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            raise RuntimeError(
                f"Mooncake bootstrap port {port} is in use on this host ({exc.strerror}); "
                f"pick another with kv_connector_extra_config.omni_plugin_bootstrap_port "
                f"or {BOOTSTRAP_PORT_ENV}") from None
