"""Realtime API metrics in vLLM's ``/metrics`` (Prometheus).

The sessions are counted by vLLM's own WebSocket middleware, the one vLLM puts in front
of its realtime transcription endpoint (``WebSocketMetricsMiddleware``, read through
:func:`~vllm_omni_plugin.compat.internals.websocket_metrics_middleware`), around each
``/v1/realtime`` connection this plugin accepts (its only WebSocket route), so they carry
vLLM's names:

* ``vllm:websocket_connections_active`` (gauge): sessions open;
* ``vllm:websocket_connections_total`` (counter): sessions opened;
* ``vllm:websocket_connection_duration_seconds`` (histogram): how long they lasted.

The plugin's own, in ``prometheus_client``'s default registry (the one vLLM's
``/metrics`` serves) from this module's import on:

* ``vllm_omni:realtime_turn_latency_seconds`` (histogram): from the end of the user's
  turn (``input_audio_buffer.commit``, or server VAD's speech stop, which commits) to the
  first ``response.output_audio.delta`` of the response to it; a response that no commit
  preceded counts from its ``response.create``.
* ``vllm_omni:realtime_responses_cancelled_total{reason}`` (counter): responses
  cancelled, by the reason ``response.done`` gives: ``turn_detected`` (a barge-in:
  the user spoke over the answer), ``client_cancelled`` (``response.cancel``) and
  ``client_disconnected``.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

#: turn latency buckets, seconds: vLLM's time-to-first-token buckets
#: (``vllm/v1/metrics/buckets.py``) from 40 ms to 80 s
TURN_LATENCY_BUCKETS = (0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                        40.0, 80.0)

TURN_LATENCY = Histogram(
    "vllm_omni:realtime_turn_latency_seconds",
    "Realtime API: seconds from the end of the user's turn (commit or server VAD's speech "
    "stop; else response.create) to the response's first audio delta.",
    buckets=TURN_LATENCY_BUCKETS)

RESPONSES_CANCELLED = Counter(
    "vllm_omni:realtime_responses_cancelled",
    "Realtime API responses cancelled, by reason (turn_detected: a barge-in).",
    labelnames=["reason"])
