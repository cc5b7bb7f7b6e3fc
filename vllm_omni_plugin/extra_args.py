"""Keys the plugin reads from and writes to ``SamplingParams.extra_args``.

``extra_args`` is an upstream vLLM field (the OpenAI server fills it from a
request's ``vllm_xargs``) that travels with a request to the engine and its
worker, so the plugin passes per-request settings through it instead of
patching vLLM's request classes.
"""

#: Output modalities the client asked for, e.g. ``["text", "audio"]`` (API layer).
MODALITIES = "omni_plugin_modalities"
#: Key under which the orchestrator hands the final stage's result to the API layer.
RESULT = "omni_plugin_result_key"
#: Voice (talker speaker name) requested by the client.
SPEAKER = "omni_plugin_speaker"
#: ``{"in": key, "out": key}`` payload-store keys of one stage request (orchestrator -> worker).
PAYLOAD = "omni_plugin_payload"
