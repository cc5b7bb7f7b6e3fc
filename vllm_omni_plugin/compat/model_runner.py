"""Which request owns which rows of a model runner's forward.

Why: the stage payload channel (``worker/stage_io.py``) slices per-position model outputs
by request, during the forward (the talker, code2wav and the DiT read their inputs from
inside it) and after it (the thinker and BAGEL AR publish rows). vLLM has two model
runners with different batch orders and neither exposes the mapping:

* the V1 ``GPUModelRunner`` (and ``CPUModelRunner``) keeps ``input_batch.req_ids`` in row
  order, during and after the forward;
* the V2 runner (``vllm/v1/worker/gpu/model_runner.py``, vLLM's default on CUDA where it
  supports the model) sorts the step's requests (``sort_batch_req_ids``: decodes first),
  builds the step's ``InputBatch`` in ``prepare_inputs`` and keeps it in a local variable
  during the forward; only after the forward does it store it in
  ``execute_model_state.input_batch`` (until ``sample_tokens``).

So on V2 :func:`watch_step` wraps the runner *instance*'s ``prepare_inputs`` to keep the
batch it returns (the class is untouched), and :func:`batch_req_ids` reads whichever
layout the runner has (feature detection, no version check).
Upstream reason: no API maps forward rows to request ids (the EAGLE-3 auxiliary hidden
states, which the thinker stage reuses, are consumed inside the runner).
Remove when: vLLM exposes the row-to-request mapping of a step.
Shim test: plugin_tests/unit/test_compat_shims.py.
"""

from __future__ import annotations

from vllm_omni_plugin.compat import MARKER

#: the instance attribute holding the V2 batch of the step being executed
_STEP_BATCH = "_omni_step_batch"


def watch_step(model_runner) -> None:
    """Call before each ``execute_model``: forget the previous step's batch and, on a V2
    runner (no ``input_batch`` attribute, a ``prepare_inputs`` method), keep the batch its
    ``prepare_inputs`` returns from now on (installed once per runner instance)."""
    if hasattr(model_runner, "input_batch"):  # V1: the batch is an attribute already
        return
    setattr(model_runner, _STEP_BATCH, None)
    prepare = getattr(model_runner, "prepare_inputs", None)
    if prepare is None or getattr(prepare, MARKER, False):
        return

    def prepare_inputs(*args, **kwargs):
        batch = prepare(*args, **kwargs)
        setattr(model_runner, _STEP_BATCH, batch)
        return batch

    setattr(prepare_inputs, MARKER, True)
    model_runner.prepare_inputs = prepare_inputs


def batch_req_ids(model_runner) -> list[str]:
    """The requests of the step being executed, in row order: inside its forward (V2:
    after :func:`watch_step`) or between ``execute_model`` and ``sample_tokens``.

    Raises:
        RuntimeError: the runner has none of the layouts (vLLM changed it).
    """
    state = getattr(model_runner, "execute_model_state", None)
    for batch in (getattr(state, "input_batch", None),  # V2 after the forward
                  getattr(model_runner, _STEP_BATCH, None),  # V2 during it
                  getattr(model_runner, "input_batch", None)):  # V1
        if batch is not None and hasattr(batch, "req_ids"):
            return list(batch.req_ids)
    raise RuntimeError(
        f"{type(model_runner).__name__} exposes neither execute_model_state.input_batch, "
        "a batch from prepare_inputs nor input_batch.req_ids; "
        "vllm_omni_plugin/compat/model_runner.py needs updating")
