#!/usr/bin/env bash
# The main job on an embedded default (README): private containerd + the proxy +
# demo pods, printing what the hooks changed. Ctrl-C cleans up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-host.sh
exec .venv/bin/koord-runtime-proxy demo "$@"
