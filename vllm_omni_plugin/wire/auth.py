"""Optional shared cluster token: HMAC-SHA256 signatures on control-plane frames.

When a token is configured, every frame on the coordinator sockets is followed
by one extra frame, ``HMAC-SHA256(key=token, msg=payload)`` (32 bytes). The
token itself never travels on the wire. Receivers verify with
:func:`hmac.compare_digest` and drop (and count) frames with a missing or wrong
signature. There is no replay protection and no confidentiality; see
``docs/design/coordinator.md`` ("Security").
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket

from vllm_omni_plugin import envs

#: Environment variable holding the shared cluster token (defined in envs.py).
CLUSTER_TOKEN_ENV = envs.CLUSTER_TOKEN

#: Length of a signature frame, in bytes (SHA-256 digest size).
MAC_BYTES = hashlib.sha256().digest_size


def cluster_token_from_env() -> str | None:
    """The cluster token from ``VLLM_OMNI_PLUGIN_CLUSTER_TOKEN``; ``None`` if unset or empty.

    Read at call time, so tests and child processes see the current environment.
    """
    return envs.cluster_token()


def resolve_key(cluster_token: str | None) -> bytes | None:
    """HMAC key for ``cluster_token``.

    ``None`` reads the environment (:func:`cluster_token_from_env`); ``""``
    explicitly disables signing even when the environment sets a token.
    Returns ``None`` when no token applies.
    """
    token = cluster_token_from_env() if cluster_token is None else cluster_token
    return token.encode("utf-8") if token else None


#: How to make a cluster token (32 random bytes as hex), for error messages and docs.
TOKEN_RECIPE = 'python -c "import secrets; print(secrets.token_hex(32))"'


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal, bracketed IPv6 included, or a name) reaches this
    machine only: it is, or every address it resolves to is, a loopback address
    (127.0.0.0/8, ``::1``). ``0.0.0.0``, ``*`` and names that do not resolve are not."""
    literal = host.strip("[]")
    try:
        return ipaddress.ip_address(literal).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(literal, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                               for info in infos)


def sign(key: bytes, payload: bytes) -> bytes:
    """HMAC-SHA256 of ``payload`` under ``key`` (:data:`MAC_BYTES` bytes)."""
    return hmac.new(key, payload, hashlib.sha256).digest()


def verify(key: bytes, payload: bytes | memoryview, mac: bytes | memoryview | None) -> bool:
    """True if ``mac`` is the signature of ``payload`` under ``key`` (constant-time compare)."""
    if mac is None:
        return False
    mac = bytes(mac)
    if len(mac) != MAC_BYTES:
        return False
    expected = hmac.new(key, payload, hashlib.sha256).digest()
    return hmac.compare_digest(expected, mac)
