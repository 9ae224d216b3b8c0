"""The gateway times tokens as they arrive: the first once, then each later delivery, each with
the instance that sent it (a migration changes it mid-stream)."""

from __future__ import annotations

import time

from services.gateway.generation import Generation
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import GenerationOptions
from services.gateway.streams import OutputStream
from shared.messages import FinishReason, TokenChunk
from shared.metrics_server import render


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []

    def first_token(self, engine: str, ttft_s: float) -> None:
        self.calls.append(("first", engine, ttft_s))

    def next_tokens(self, engine: str, gap_s: float) -> None:
        self.calls.append(("next", engine, gap_s))


async def migrate_while_reading(times) -> None:
    """Tokens from a, then (migrated) from b, each read as it comes, as the response writer does."""
    stream = OutputStream("r1", "a")
    generation = Generation(stream, lambda ids: "".join(chr(97 + i % 26) for i in ids), [1, 2, 3],
                            GenerationOptions(), 5.0, arrival=time.monotonic() - 0.5, token_times=times)
    events = generation.events()
    for chunks in ([TokenChunk("r1", "a", 0, [5, 6])],
                   [TokenChunk("r1", "a", 2, []), TokenChunk("r1", "b", 2, [7])],  # an empty chunk is no delivery
                   [TokenChunk("r1", "b", 3, [8], finish_reason=FinishReason.LENGTH)]):
        for chunk in chunks:
            stream.feed(chunk)
        await anext(events)
    assert generation.finish_reason == "length"


async def test_first_token_once_then_each_delivery_with_its_sender():
    times = Recorder()
    await migrate_while_reading(times)
    assert [(kind, engine) for kind, engine, _ in times.calls] == [("first", "a"), ("next", "b"), ("next", "b")]
    assert times.calls[0][2] >= 0.5  # from the request's arrival
    assert all(0 <= gap < 0.5 for _, _, gap in times.calls[1:])


async def test_the_gateways_histograms_count_them_per_instance():
    metrics = GatewayMetrics("tiny", 2048)
    await migrate_while_reading(metrics)
    text = render(metrics.registry).decode()
    assert 'vllm:time_to_first_token_seconds_count{engine="a",model_name="tiny"} 1.0' in text
    assert 'vllm:inter_token_latency_seconds_count{engine="b",model_name="tiny"} 2.0' in text
