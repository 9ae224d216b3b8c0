"""Watch load reports and every token chunk on its way to a gateway (read-only, for tests)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import nats

from shared import subjects
from shared.messages import DrainOrder, MigrateOrder, TokenChunk, decode, decode_chunks, encode
from tests.support.observer import NatsObserver


class StreamWatch:
    def __init__(self, url: str) -> None:
        self.url = url
        self.chunks: dict[str, list[TokenChunk]] = defaultdict(list)

    async def __aenter__(self) -> StreamWatch:
        self.observer = await NatsObserver(self.url).__aenter__()
        self.nc = await nats.connect(self.url)

        async def on_chunk(msg) -> None:
            for chunk in decode_chunks(msg.data):  # one chunk, or a step's batch of them
                self.chunks[chunk.request_id].append(chunk)

        await self.nc.subscribe(f"{subjects.PREFIX}.gateway.*.out", cb=on_chunk)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()
        await self.observer.__aexit__(*exc)

    @property
    def latest(self):
        return self.observer.latest

    async def wait_for(self, predicate, timeout_s: float = 10.0) -> bool:
        return await self.observer.wait_for(predicate, timeout_s)

    def finished(self, request_id: str) -> bool:
        return any(chunk.finish_reason for chunk in self.chunks[request_id])

    async def wait_finished(self, *request_ids: str, timeout_s: float = 5.0) -> bool:
        """The gateway and this watch subscribe separately: an HTTP reply can beat our copy of
        the last chunk, so wait for it before comparing token streams."""
        deadline = time.monotonic() + timeout_s
        while not all(self.finished(rid) for rid in request_ids):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def order(self, instance_id: str, message: DrainOrder | MigrateOrder) -> None:
        """Give a llumlet a drain or migrate order, as the scheduler would."""
        verb = "drain" if isinstance(message, DrainOrder) else "migrate"
        await self.nc.publish(subjects.llumlet(instance_id, verb), encode(message))

    def publishers(self, request_id: str) -> list[str]:
        """The instances that published the request's tokens, in order of hand-over. A chunk
        that brings no new token is skipped, as the gateway skips it: a source's last chunk may
        arrive after the destination's catch-up (the COMMIT goes over TCP, not behind it on NATS)."""
        seen: list[str] = []
        indexes: set[int] = set()
        for chunk in self.chunks[request_id]:
            new = set(range(chunk.start_index, chunk.start_index + len(chunk.token_ids))) - indexes
            indexes |= new
            if new and (not seen or seen[-1] != chunk.instance_id):
                seen.append(chunk.instance_id)
        return seen

    def tokens(self, request_id: str, contiguous: bool = True) -> list[int]:
        """The request's tokens by index; a duplicate must repeat the same token, and with
        `contiguous` no index may be missing."""
        by_index: dict[int, int] = {}
        for chunk in self.chunks[request_id]:
            for i, token in enumerate(chunk.token_ids):
                assert by_index.setdefault(chunk.start_index + i, token) == token, "conflicting duplicate"
        if contiguous:
            assert sorted(by_index) == list(range(len(by_index))), "a gap in the token indices"
        return [by_index[i] for i in range(len(by_index))]
