# One image for every Corral service; docker-compose.yml and deploy/kubernetes pick the command
# (`corral <service>`, the entry point `corral up` runs for each of its children).
#
#   docker build -t corral .                                 vLLM's CPU build (torch from the CPU index)
#   docker build --build-arg VLLM_TARGET=cuda -t corral-cuda .   vLLM's CUDA build (torch's CUDA wheels carry
#                                                            the CUDA libraries; the host needs the NVIDIA
#                                                            driver and container toolkit to run it)
# The simulated engine runs in either. A build sees no GPU, so VLLM_TARGET says which build to take.
FROM python:3.11-slim

ARG VLLM_TARGET=cpu
# torch's CPU wheels (PyPI's Linux torch is the CUDA build, gigabytes of it).
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 CORRAL_HOME=/models

WORKDIR /app
COPY pyproject.toml README.md ./
COPY scripts ./scripts
RUN python -m venv /app/.venv \
 && VLLM_TARGET="$VLLM_TARGET" TORCH_CPU_INDEX_URL="$TORCH_CPU_INDEX_URL" \
    bash scripts/install_vllm.sh /app/.venv/bin/python
COPY shared ./shared
COPY services ./services
COPY loadgen ./loadgen
# The `kubernetes` extra: the autoscaler's Kubernetes provider.
RUN /app/.venv/bin/pip install -e ".[kubernetes]" \
 && /app/.venv/bin/corral make-model /models/tiny-llama

ENV PATH="/app/.venv/bin:$PATH"
# Ports a service may listen on: gateway HTTP, metrics/probes (scheduler, llumlet), llumlet KV.
EXPOSE 8000 9090 7400
ENTRYPOINT ["corral"]
