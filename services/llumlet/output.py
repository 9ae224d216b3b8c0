"""The llumlet's token output: one chunk per request per step, batched per gateway when the
gateway takes batches, and held in order while NATS cannot take them (never dropped)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from nats.aio.client import Client
from nats.errors import OutboundBufferLimitError

from services.llumlet.routes import OutputRoutes
from services.llumlet.tracing import RequestSpans
from shared.engine_model.views import StepOutput
from shared.messages import TokenChunk, TokenChunkBatch, encode

log = logging.getLogger(__name__)

STEP_BATCH_CHUNKS = 256  # chunks per TokenChunkBatch: well inside NATS' 1 MiB payload, logprobs included


class OutputPublisher:
    """Publishes what the engine produced to each request's gateway (`OutputRoutes`)."""

    def __init__(self, instance_id: str, routes: OutputRoutes, bus: Callable[[], Client | None],
                 spans: Callable[[], RequestSpans]) -> None:
        self.instance_id = instance_id
        self.routes = routes
        self._bus = bus  # the llumlet's NATS client (None before it connects)
        self._spans = spans  # (the llumlet replaces its spans once tracing is set up)
        # Token chunks NATS could not take (its reconnect buffer full): published, in order,
        # once it is back. The engine pauses while NATS is away, so this stays small.
        self._held: list[tuple[str, bytes]] = []
        # Output subjects of gateways that take one TokenChunkBatch per step (GenerateRequest.batched_output).
        self._batching_subjects: set[str] = set()

    def batch_for(self, subject: str) -> None:
        """The gateway behind `subject` takes one TokenChunkBatch per step."""
        self._batching_subjects.add(subject)

    def bus_up(self) -> bool:
        """NATS is connected and everything held back has gone out."""
        nc = self._bus()
        return nc is not None and nc.is_connected and not self._held

    async def wait_for_bus(self) -> None:
        """Until NATS is back and what was held has gone out (or the client is closed)."""
        while (nc := self._bus()) is not None and not nc.is_closed:
            if nc.is_connected:
                if not self._held:
                    return
                subject, payload = self._held[0]
                try:
                    await nc.publish(subject, payload)
                except OutboundBufferLimitError:
                    await asyncio.sleep(0.05)
                    continue
                self._held.pop(0)
                continue
            await asyncio.sleep(0.05)

    async def publish_chunk(self, subject: str, payload: bytes) -> None:
        """A token chunk must arrive: if NATS cannot take it now, hold it (`wait_for_bus`)."""
        if not self._held:
            try:
                await self._bus().publish(subject, payload)
                return
            except OutboundBufferLimitError:
                log.warning("llumlet %s: NATS is away and its buffer full: holding output", self.instance_id)
        self._held.append((subject, payload))

    async def publish_step(self, outputs: Iterable[StepOutput]) -> None:
        """A step's outputs: one message per batching gateway, one per chunk otherwise."""
        step_chunks: dict[str, list[TokenChunk]] = {}
        for output in outputs:
            await self.publish_output(output, step_chunks)
        await self._publish_step_chunks(step_chunks)

    async def _publish_step_chunks(self, step_chunks: dict[str, list[TokenChunk]]) -> None:
        """One message per gateway for a step's chunks (a lone chunk goes as itself): with N
        requests of one gateway here, one NATS message per step instead of N."""
        for subject, chunks in step_chunks.items():
            for start in range(0, len(chunks), STEP_BATCH_CHUNKS):
                part = chunks[start:start + STEP_BATCH_CHUNKS]
                await self.publish_chunk(subject, encode(part[0] if len(part) == 1 else TokenChunkBatch(part)))

    async def publish_output(self, output: StepOutput, step_chunks: dict[str, list[TokenChunk]] | None = None) -> None:
        subject = self.routes.subject(output.request_id)
        if subject is None:
            return  # aborted meanwhile
        offset = self.routes.offset(output.request_id)
        if output.finish_reason is not None:
            self.routes.close(output.request_id)
        self._spans().output(output)
        chunk = TokenChunk(
            request_id=output.request_id,
            instance_id=self.instance_id,
            start_index=output.start_index + offset,
            token_ids=output.token_ids,
            finish_reason=output.finish_reason,
            num_prompt_tokens=max(0, output.num_prompt_tokens - offset),
            num_preemptions=output.num_preemptions,
            logprobs=output.logprobs,
            num_cached_tokens=output.num_cached_tokens if output.start_index == 0 else None,
        )
        if step_chunks is not None and subject in self._batching_subjects:
            step_chunks.setdefault(subject, []).append(chunk)
            return
        await self.publish_chunk(subject, encode(chunk))
