"""Loggers for the plugin.

vLLM's logging config only attaches handlers to loggers under the ``vllm``
namespace, so every logger of this package lives under ``vllm.omni_plugin``;
otherwise its messages would be silently dropped by ``vllm serve``.
"""

from __future__ import annotations

import logging

_ROOT = "vllm.omni_plugin"


def init_logger(name: str) -> logging.Logger:
    """Return the logger for module ``name`` (``vllm_omni_plugin.x.y``).

    The result is named ``vllm.omni_plugin.x.y`` so vLLM's handlers apply.
    """
    suffix = name.removeprefix("vllm_omni_plugin").lstrip(".")
    return logging.getLogger(f"{_ROOT}.{suffix}" if suffix else _ROOT)
