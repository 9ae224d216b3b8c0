"""Watch what crosses NATS during a test: load reports and generate orders (read-only)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import nats

from shared import subjects
from shared.messages import GenerateRequest, LoadReport, decode


class NatsObserver:
    def __init__(self, url: str) -> None:
        self.url = url
        self.reports: list[tuple[float, LoadReport]] = []
        self.latest: dict[str, LoadReport] = {}
        self.generate_orders: Counter[str] = Counter()
        self.nc = None

    async def __aenter__(self) -> NatsObserver:
        self.nc = await nats.connect(self.url)
        await self.nc.subscribe(subjects.LOAD_REPORTS_ALL, cb=self._on_report)
        await self.nc.subscribe(f"{subjects.PREFIX}.llumlet.*.generate", cb=self._on_generate)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()

    async def _on_report(self, msg) -> None:
        report = decode(msg.data, LoadReport)
        self.reports.append((time.monotonic(), report))
        self.latest[report.instance_id] = report

    async def _on_generate(self, msg) -> None:
        decode(msg.data, GenerateRequest)
        self.generate_orders[msg.subject.split(".")[2]] += 1

    async def wait_for(self, predicate, timeout_s: float = 10.0) -> bool:
        """`predicate(latest)` may index an instance not heard from yet (a KeyError: not yet): an
        idle llumlet reports only as a heartbeat, every 0.25 s (`--report-heartbeat-s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if predicate(self.latest):
                    return True
            except KeyError:
                pass
            await asyncio.sleep(0.05)
        return False
