#!/usr/bin/env bash
# Install everything (first run) and run the test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${VLLM_OMNI_PLUGIN_VENV:-.venv}"
exec "$VENV/bin/python" -m pytest plugin_tests "$@"
