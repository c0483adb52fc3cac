#!/usr/bin/env bash
# The test command (README): installs what it needs, then lints and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-host.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== protocol code up to date"; python scripts/gen_proto.py --check
echo "== ruff";          ruff check .
echo "== mypy (strict)"; mypy
echo "== import layers"; lint-imports --no-cache
echo "== pytest"
# -rs lists every skip with its reason. Under CI (CI=true) an integration test that
# skips, or a host that cannot run them, fails the run (tests/integration/conftest.py).
exec python -m pytest -p no:cacheprovider -q -rs "$@"
