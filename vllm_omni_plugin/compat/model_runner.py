"""Which request owns which rows of a model runner's forward.

Why: the stage payload channel (``worker/stage_io.py``) slices per-position model outputs
by request. vLLM has two model runners with different batch orders: the V1
``GPUModelRunner`` (and ``CPUModelRunner``) keeps ``input_batch.req_ids`` in row order; the
V2 runner (``vllm/v1/worker/gpu/model_runner.py``, the default where it supports the model)
sorts the step's requests and keeps them in ``execute_model_state.input_batch.req_ids``
between ``execute_model`` and ``sample_tokens``. Neither is a public API; this module is
the one place that reads them (feature detection, no version check).
Upstream reason: no API maps forward rows to request ids (the EAGLE-3 auxiliary hidden
states, which the thinker stage reuses, are consumed inside the runner).
Remove when: vLLM exposes the row-to-request mapping of a step.
Shim test: plugin_tests/unit/test_compat_shims.py.
"""

from __future__ import annotations


def batch_req_ids(model_runner) -> list[str]:
    """The requests of the step just executed, in row order (call between
    ``execute_model`` and ``sample_tokens``).

    Raises:
        RuntimeError: the runner has neither layout (vLLM changed it).
    """
    state = getattr(model_runner, "execute_model_state", None)
    v2_batch = getattr(state, "input_batch", None)  # V1's state has no input_batch
    if v2_batch is not None:
        return list(v2_batch.req_ids)
    batch = getattr(model_runner, "input_batch", None)
    if batch is not None and hasattr(batch, "req_ids"):
        return list(batch.req_ids)
    raise RuntimeError(
        f"{type(model_runner).__name__} exposes neither execute_model_state.input_batch nor "
        "input_batch.req_ids; vllm_omni_plugin/compat/model_runner.py needs updating")
