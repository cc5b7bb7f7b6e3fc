"""vLLM version detection: one cached helper and the supported range."""

from __future__ import annotations

import functools

#: Inclusive lower, exclusive upper bound of the vLLM releases this plugin
#: supports (kept in step with setup.cfg's install_requires).
SUPPORTED_MIN = (0, 30, 0)
SUPPORTED_MAX_EXCLUSIVE = (0, 34, 0)
SUPPORTED_RANGE = ">=0.30.0,<0.34"


def _parse(version: str) -> tuple[int, int, int]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def vllm_version() -> str:
    """The installed vLLM version string, without importing vLLM."""
    from importlib.metadata import version

    return version("vllm")


def is_supported(version: str | None = None) -> bool:
    v = _parse(version or vllm_version())
    return SUPPORTED_MIN <= v < SUPPORTED_MAX_EXCLUSIVE
