#!/usr/bin/env bash
# Lint the project with ruff (rules and line length in pyproject.toml's [tool.ruff]).
# ruff is pinned and installed in its own small venv (default
# ~/.cache/vllm-omni-plugin/venv-ruff-<version>), apart from the vLLM venvs. Extra args
# go to `ruff check`.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION="${RUFF_VERSION:-0.17.6}"
VENV="${VLLM_OMNI_PLUGIN_LINT_VENV:-${VLLM_OMNI_PLUGIN_CACHE:-$HOME/.cache/vllm-omni-plugin}/venv-ruff-$RUFF_VERSION}"
source scripts/tool_venv.sh
ensure_tool_venv "$VENV" ruff "ruff==$RUFF_VERSION"
exec "$VENV/bin/ruff" check vllm_omni_plugin plugin_tests benchmarks "$@"
