#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with vLLM and the plugin.
#   VLLM_OMNI_PLUGIN_VENV  venv path (default: .venv in the checkout)
#   VLLM_VERSION           vLLM release to install (default: 0.32.0)
# On a machine without an NVIDIA driver it installs the CPU build of torch and
# removes the CUDA builds of torchvision/torchaudio/torchcodec that vLLM pulls
# in: with a CPU torch they break `transformers` model imports
# ("operator torchvision::nms does not exist"), and no stage needs them.
# transformers is left to each vLLM release's own pin, as users get it (0.30.0
# does not cap it); a venv keeps what it resolved until setup.cfg changes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_OMNI_PLUGIN_VENV:-.venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
stamp="$VENV/.omni-plugin-env-$VLLM_VERSION-$(sha1sum setup.cfg | cut -c1-12)"
install_self() {
  # Always (cheap): the checkout may have moved since the venv was made.
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . 2>/dev/null \
    || "$VENV/bin/pip" install --no-deps --no-build-isolation -e .
}
if [ -f "$stamp" ]; then
  echo "[setup] reusing $VENV (vLLM $VLLM_VERSION)"
  install_self
  exit 0
fi
echo "[setup] creating $VENV with vLLM $VLLM_VERSION (a few minutes the first time)"
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip >/dev/null 2>&1 || true
"$PIP" install -q "torch==$TORCH_VERSION"
"$PIP" install -q "vllm==$VLLM_VERSION"
"$PIP" install -q --no-build-isolation -e ".[test]"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
install_self
rm -f "$VENV"/.omni-plugin-env-*
touch "$stamp"
echo "[setup] done: $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
