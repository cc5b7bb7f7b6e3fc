"""Developer tools for vllm_omni_plugin (e.g. tiny random checkpoints for CPU tests)."""
