"""vLLM's metric conventions (vllm/v1/metrics/loggers.py and buckets.py, vLLM 0.32), in one place
for the gateway and the llumlets, so a dashboard built for vLLM reads Corral unchanged."""

from __future__ import annotations

# Every vllm:* series carries these; `engine` is the instance id (vLLM: the data-parallel rank).
LABELS = ("model_name", "engine")

# vLLM's FinishReason strings, all present at zero from the start (Corral never says "repetition").
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
# e2e, queue, prefill, decode and inference time share these.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# vllm:num_requests_waiting_by_reason: "capacity" waits for room, "deferred" for something else
# (LoRA budget, a KV transfer); they sum to vllm:num_requests_waiting.
WAITING_REASONS = ("capacity", "deferred")
# vllm:prompt_tokens_cached_by_source: the tier that supplied cached prompt tokens (CacheHitSource).
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
# vllm:engine_sleep_state: awake = 1 while the engine serves (Corral's engines never sleep).
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's `build_1_2_5_buckets(max_model_len)`: 1, 2, 5, 10, 20, 50, … up to the context."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10
