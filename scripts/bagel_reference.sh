#!/usr/bin/env bash
# Regenerate plugin_tests/fixtures/bagel_reference/ from the official BAGEL code (a
# development check: CI reads the fixtures and never runs this).
#   BAGEL_REPO   checkout of github.com/ByteDance-Seed/Bagel, kept outside this project
#                (its modeling_utils.py is CC BY-NC 4.0: run it, copy nothing of it)
#   BAGEL_REF_VENV  the reference venv (default ~/.cache/vllm-omni-plugin/bagel-ref):
#                PyPI's torch 2.13.0 with torchvision 0.28.0 (a local +cpu torch would
#                not load PyPI's torchvision; scripts/setup_env.sh says why), OpenCV and
#                transformers 4.49.0, the release the official code pins (vLLM brings
#                transformers 5.x, under which it fails to build); the official image
#                transforms import torchvision and OpenCV
#   VLLM_OMNI_PLUGIN_VENV  the project's venv (default .venv), which writes the tiny
#                checkpoint (python -m vllm_omni_plugin.tools.tiny_checkpoint bagel)
# Fixtures come out bitwise the same on every run (the script checks each case twice).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${BAGEL_REPO:?set BAGEL_REPO to a checkout of github.com/ByteDance-Seed/Bagel}"
REF_VENV="${BAGEL_REF_VENV:-$HOME/.cache/vllm-omni-plugin/bagel-ref}"
VENV="${VLLM_OMNI_PLUGIN_VENV:-.venv}"
OUT=plugin_tests/fixtures/bagel_reference
if [ ! -x "$REF_VENV/bin/python" ]; then
  echo "[bagel-ref] creating $REF_VENV"
  python3 -m venv "$REF_VENV"
  "$REF_VENV/bin/pip" install -q "torch===2.13.0" torchvision==0.28.0 transformers==4.49.0 \
    einops safetensors pillow tqdm numpy opencv-python-headless
fi
commit="$(git -C "$BAGEL_REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
ckpt="$(mktemp -d)"
trap 'rm -rf "$ckpt"' EXIT
"$VENV/bin/python" -m vllm_omni_plugin.tools.tiny_checkpoint bagel "$ckpt/tiny" --seed 0 >/dev/null
"$REF_VENV/bin/python" scripts/bagel_reference.py --bagel-repo "$BAGEL_REPO" \
  --checkpoint "$ckpt/tiny" --out "$OUT" --commit "$commit"
echo "[bagel-ref] fixtures written to $OUT"
