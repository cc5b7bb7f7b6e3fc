# Sourced by scripts/lint.sh and scripts/docs.sh: a pinned tool in a small venv of its own,
# apart from the vLLM venvs.
# ensure_tool_venv VENV BINARY PACKAGE...: install PACKAGEs into VENV (made afresh) unless
# VENV/bin/BINARY exists.
ensure_tool_venv() {
  local venv="$1" binary="$2"
  shift 2
  if [ ! -x "$venv/bin/$binary" ]; then
    echo "[$binary] installing $* into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "$@"
  fi
}
