"""The plugin's vLLM worker: the platform's own worker plus the stage payload channel."""
