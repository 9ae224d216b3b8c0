# One image for every Corral service; docker-compose.yml picks the command.
# CPU build of vLLM by default (scripts/install_vllm.sh picks the CUDA build where nvidia-smi works
# at build time; for GPU hosts build FROM a CUDA base image instead).
FROM python:3.11-slim

ARG TORCH_CPU_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 CORRAL_HOME=/models

WORKDIR /app
COPY pyproject.toml README.md ./
COPY scripts ./scripts
RUN python -m venv /app/.venv \
 && TORCH_CPU_INDEX_URL="$TORCH_CPU_INDEX_URL" bash scripts/install_vllm.sh /app/.venv/bin/python
COPY shared ./shared
COPY services ./services
COPY loadgen ./loadgen
RUN /app/.venv/bin/pip install -e . \
 && /app/.venv/bin/corral make-model /models/tiny-llama

ENV PATH="/app/.venv/bin:$PATH"
ENTRYPOINT ["corral"]
