"""The llumlet's load reports, what the schedulers know of it: what its engine holds, how it
serves, whether it drains. One is built every `report_interval_s`, and sooner when something
changed (`soon`: a request came, went or migrated; or a step moved the free blocks by
`report_change_fraction` of them); it goes out when it says something new, or as a heartbeat
(`report_heartbeat_s`; `shared.engine_model.report_cadence`). A report is rebuilt each time: none
is buffered while NATS is away. The last one built also answers `/ready`
(`services.llumlet.readiness`)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from nats.aio.client import Client
from nats.errors import OutboundBufferLimitError

from services.llumlet.config import LlumletConfig
from services.llumlet.engine import Engine
from services.llumlet.metrics import LlumletMetrics
from services.llumlet.migration.runtime import LlumletMigration
from services.llumlet.served import ServedTally
from shared import subjects
from shared.cancellation import wait_set
from shared.engine_model.load_report import aggregate_views, build_load_report
from shared.engine_model.report_cadence import blocks_moved, report_due
from shared.messages import DrainSource, InstanceRole, LoadReport, encode


class ReportedLlumlet(Protocol):
    """The llumlet's surface a report is built from (`Llumlet`; no import of it: no cycle)."""

    instance_id: str
    role: InstanceRole
    config: LlumletConfig
    engine: Engine
    draining: bool
    drained_by: DrainSource | None
    served: ServedTally
    migration: LlumletMigration | None
    metrics: LlumletMetrics | None
    nc: Client | None


class LoadReporter:
    def __init__(self, llumlet: ReportedLlumlet) -> None:
        self.llumlet = llumlet
        self.last: LoadReport | None = None  # the last one built (sent or not)
        self.last_sent: LoadReport | None = None
        self._last_sent_at = 0.0  # monotonic
        self.num_skipped = 0  # built, and not sent: they said nothing new
        self._seq = 0
        self._now = asyncio.Event()

    def current_load(self) -> LoadReport:
        self._seq += 1
        llumlet = self.llumlet
        engine, served, migration = llumlet.engine, llumlet.served, llumlet.migration
        return build_load_report(
            instance_id=llumlet.instance_id,
            seq=self._seq,
            sent_at=time.time(),
            requests=aggregate_views(engine.request_views()),
            num_blocks_total=engine.num_blocks_total,
            num_blocks_free=engine.num_free_blocks(),
            block_size=engine.block_size,
            num_preemptions_total=engine.num_preemptions_total(),
            headroom_blocks=llumlet.config.policy.headroom_blocks,
            draining=llumlet.draining,
            drained_by=llumlet.drained_by,
            reserved_blocks=migration.reserved_blocks if migration is not None else 0,
            committed_blocks=engine.num_committed_blocks(),
            waiting_prefill_tokens=engine.waiting_prefill_tokens(),
            num_migrating=migration.num_migrating if migration is not None else 0,
            num_migrating_in=migration.num_migrating_in if migration is not None else 0,
            max_migrations_in=migration.limits.max_in if migration is not None else 0,
            kv_address=migration.kv_address if migration is not None else "",
            max_model_len=engine.max_model_len,
            model=engine.model_name,
            engine=engine.kind,
            num_finished_total=served.num_finished,
            finished_output_tokens_total=served.finished_output_tokens,
            finished_output_histogram=served.output_histogram,
            num_accepted_total=served.num_accepted,
            num_migrations_asked_total=migration.num_migrations_asked_total if migration is not None else 0,
            step_time_s=served.step_time_s,
            step_decode_batch=served.decode_batch,
            step_decode_context=served.decode_context,
            role=llumlet.role,
            migration_candidate_hashes=migration.candidate_hashes() if migration is not None else (),
        )

    async def publish(self) -> None:
        report = self.current_load()
        self.last = report
        self.llumlet.metrics.observe_report(report)
        nc = self.llumlet.nc
        if not nc.is_connected:
            return  # a report is rebuilt every interval: not worth buffering while NATS is away
        now = time.monotonic()
        if not report_due(self.last_sent, report, now - self._last_sent_at, self.llumlet.config.report_heartbeat_s):
            self.num_skipped += 1
            return
        try:
            await nc.publish(subjects.load_report(self.llumlet.instance_id), encode(report))
        except OutboundBufferLimitError:
            return  # as above: the next one will do
        self.last_sent, self._last_sent_at = report, now

    def soon(self) -> None:
        """Publish a load report now rather than at the next interval."""
        self._now.set()

    def soon_if_blocks_moved(self) -> None:
        """After a step: report now if the free blocks moved by `report_change_fraction` of them
        since the last report."""
        engine = self.llumlet.engine
        if blocks_moved(self.last, engine.num_free_blocks(), engine.num_blocks_total,
                        self.llumlet.config.report_change_fraction):
            self._now.set()

    async def run(self) -> None:
        while True:
            await wait_set(self._now, self.llumlet.config.report_interval_s)
            self._now.clear()
            await self.publish()
