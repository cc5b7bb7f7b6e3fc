"""Patch: ``vllm serve --headless --stage-id N`` starts omni headless replicas.

Why: ``vllm serve --headless`` is vLLM's data-parallel headless mode: it
starts engine cores that join a DP head. In omni mode with ``--stage-id`` the
same flag has to start replicas of stage ``N`` that register with the omni
head instead. vLLM's ``ServeSubcommand.cmd`` calls the module-level
``run_headless(args)`` when no API server is to be started; this wrapper
dispatches to :func:`vllm_omni_plugin.replicas.server.run_headless_replicas`
for omni headless command lines and calls vLLM's function unchanged otherwise.
This is the one documented seam for ``--headless`` (docs/design/replicas.md).
Upstream reason: no hook for what a headless ``vllm serve`` runs
(vllm/entrypoints/cli/serve.py, 0.30-0.32).
Remove when: vLLM lets a plugin supply the headless runner.
"""

from __future__ import annotations

import functools
import sys

from vllm_omni_plugin.compat import MARKER

#: What :func:`apply` patches (``module:attribute path``), for the environment report.
TARGETS = ("vllm.entrypoints.cli.serve:run_headless",)


def apply() -> bool:
    """Wrap ``vllm.entrypoints.cli.serve.run_headless`` so that omni headless command lines
    start omni replicas.

    Returns:
        True when this call patched the function; False when vLLM's serve module is not
        imported in this process, lacks ``run_headless`` or is already patched.
    """
    # Only where the CLI runs: vLLM's CLI imports its serve module before it
    # loads plugins; engine and worker processes never need it (nor its imports).
    serve = sys.modules.get("vllm.entrypoints.cli.serve")
    if serve is None:
        return False
    original = getattr(serve, "run_headless", None)
    if original is None or getattr(original, MARKER, False):
        return False

    @functools.wraps(original)
    def run_headless(args, *rest, **kwargs):
        from vllm_omni_plugin.config.cli import is_omni_headless

        if is_omni_headless(args):
            from vllm_omni_plugin.replicas.server import run_headless_replicas

            return run_headless_replicas(args)
        return original(args, *rest, **kwargs)

    setattr(run_headless, MARKER, True)
    serve.run_headless = run_headless
    return True
