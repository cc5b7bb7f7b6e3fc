#!/usr/bin/env bash
# Install everything (first run) and run the test suite. Extra args go to pytest: paths
# (a folder such as plugin_tests/engine, a module, a test id) narrow the run; with none,
# pytest runs plugin_tests (pyproject.toml's testpaths).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${VLLM_OMNI_PLUGIN_VENV:-.venv}"
exec "$VENV/bin/python" -m pytest "$@"
