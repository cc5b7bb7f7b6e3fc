"""The head's engine side: the omni engine client and the request flow.

* :mod:`.omni_client` -- :class:`~.omni_client.OmniEngineClient`, the entry stage's
  ``AsyncLLM`` that vLLM's API server uses in omni mode;
* :mod:`.bootstrap` -- the head, built in one place;
* :mod:`.orchestrator` -- request flow between stages;
* :mod:`.streaming` -- stages that run before their input stage has finished;
* :mod:`.pd` -- prefill/decode disaggregation of the entry stage;
* :mod:`.admission` -- the bound on requests in flight at each downstream stage;
* :mod:`.omni_request` -- what one API request asks of the pipeline, and what it got;
* :mod:`.errors` -- a stage's per-request error and how a failed request is answered.
"""
