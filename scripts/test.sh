#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install_prometheus.sh || true  # optional: without it the real-Prometheus tests skip
bash scripts/install_compose.sh || true  # optional: without it the compose tests skip
exec .venv/bin/python -m pytest -q -ra "$@"
