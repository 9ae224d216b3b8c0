#!/usr/bin/env bash
# Installs Corral and everything it needs into .venv at the repository root. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# vLLM first: the CPU build on a CPU host, the CUDA build where a GPU is present.
bash scripts/install_vllm.sh .venv/bin/python
.venv/bin/python -m pip install -q -e ".[test]"
echo "Corral installed in .venv ($(.venv/bin/python -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null || echo 'no vllm: sim engine only'))"
