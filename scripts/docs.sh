#!/usr/bin/env bash
# Build the documentation site (docs/, mkdocs.yml) with MkDocs and the Material theme,
# --strict: a broken link, a missing page or an anchor that does not exist fails it.
# MkDocs is pinned and installed in its own small venv (default
# ~/.cache/vllm-omni-plugin/venv-mkdocs-<version>), apart from the vLLM venvs.
#   bash scripts/docs.sh          # build into site/
#   bash scripts/docs.sh serve    # serve at localhost:8000, rebuilding on changes
set -euo pipefail
cd "$(dirname "$0")/.."
MKDOCS_MATERIAL_VERSION="${MKDOCS_MATERIAL_VERSION:-9.8.2}"
VENV="${VLLM_OMNI_PLUGIN_DOCS_VENV:-${VLLM_OMNI_PLUGIN_CACHE:-$HOME/.cache/vllm-omni-plugin}/venv-mkdocs-$MKDOCS_MATERIAL_VERSION}"
source scripts/tool_venv.sh
ensure_tool_venv "$VENV" mkdocs "mkdocs-material==$MKDOCS_MATERIAL_VERSION" "mkdocs==1.6.1"
export NO_MKDOCS_2_WARNING=1  # Material's notice on every build
command="${1:-build}"
[ $# -eq 0 ] || shift
if [ "$command" = serve ]; then
  exec "$VENV/bin/mkdocs" serve "$@"
fi
exec "$VENV/bin/mkdocs" build --strict --site-dir "${SITE_DIR:-site}" "$@"
