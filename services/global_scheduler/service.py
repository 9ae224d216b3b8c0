"""Global scheduler: a load table from reports; answers dispatch requests by freeness."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.global_scheduler.admission import DispatchAdmission
from services.global_scheduler.config import SchedulerConfig
from services.global_scheduler.leadership import Leadership
from services.global_scheduler.metrics import SchedulerMetrics
from services.global_scheduler.migration_loop import MigrationLoop, MigrationPairer
from services.global_scheduler.dispatcher import DEFAULT_POLICY, NamedDispatch
from services.global_scheduler.prefix_tracker import PrefixTracker
from services.global_scheduler.roles import InstanceRoles
from shared import bus_guard, subjects, tracing
from shared.cancellation import wait_set
from shared.engine_model.report_cadence import RECEIVER_WARM_UP_S
from shared.instance_table import InstanceTable
from shared.messages import (
    DispatchReply,
    DispatchRequest,
    HandoffAnswer,
    HandoffQuery,
    LoadReport,
    Refusal,
    SchedulerHeartbeat,
    WireError,
    decode,
    decode_load_report,
    decode_or_drop,
    encode,
)
from shared.metrics_server import serve_metrics
from shared.nats_client import connect
from shared.policy.dispatch import account_dispatch
from shared.policy.dispatch_index import DispatchIndex
from shared.unreported_dispatches import UnreportedDispatches

log = logging.getLogger(__name__)
_tracer = tracing.tracer("corral.global_scheduler")
# Report handling done back to back before a dispatch may go first (~0.1 ms of reports).
REPORTS_PER_YIELD = 8


class GlobalScheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        # Loads ranked by dispatch score as reports arrive: a dispatch reads the top, not every instance.
        self.index = DispatchIndex(config.policy)
        self.table = InstanceTable(config.instance_timeout_s, listener=self.index)
        self.unreported = UnreportedDispatches()
        self.roles = InstanceRoles(self.table, config.guard, config.policy.headroom_blocks, self.unreported)  # P/D
        self.nc: Client | None = None
        self.dispatch_nc: Client | None = None  # dispatch and hand-off queries, apart from the reports
        self._reports_since_yield = 0
        self._heard_a_report = asyncio.Event()
        self._reports_subscribed_at: float | None = None  # monotonic
        self._tasks: list[asyncio.Task] = []
        self.migration_loop: MigrationLoop | None = None
        self.leadership = Leadership(config.scheduler_id, config.leader_lease_s)
        self.metrics = SchedulerMetrics(self.table.live, self._standing_pairs)
        bus_guard.register(self.metrics.registry)
        # The llumlets' prefix caches (their KV events): admission's and a named policy's dispatch.
        self.prefixes = PrefixTracker(lambda: (load.instance_id for load in self.table.live()), self.metrics.registry,
                                      load_of=self.table.get)
        self.admission = (DispatchAdmission(config.admission, self.metrics.registry, self.prefixes.index)
                          if config.admission is not None else None)
        self.named_dispatch = (NamedDispatch(config.dispatch_policy, config.policy, self.table.live,
                                             self.prefixes.index, config.dispatch_gpu, self.metrics.registry,
                                             table=self.table, recompute_weight=config.prefix_recompute_weight,
                                             room_wait_weight=config.prefix_room_wait_weight,
                                             saturation_weight=config.prefix_saturation_weight,
                                             cached_queue_weight=config.prefix_cached_queue_weight,
                                             held_request_tokens=config.prefix_held_request_tokens)
                               if config.dispatch_policy != DEFAULT_POLICY else None)

    def _standing_pairs(self) -> int:
        return 0 if self.migration_loop is None else len(self.migration_loop.pairer.pairs)

    async def start(self) -> None:
        tracing.setup_tracing("corral-global-scheduler")
        serve_metrics(self.metrics.registry, self.config.metrics_port, ready=self.not_ready_reason)
        self.nc = await connect(self.config.nats_url, "global-scheduler")
        # Requests on a connection of their own: on the reports' one a dispatch would queue behind
        # every report nats-server had already written to that socket (20,000/s at 1,000
        # instances: P99 30 ms against 6 ms apart, benchmarks/control_plane.py).
        self.dispatch_nc = await connect(self.config.nats_url, "global-scheduler-dispatch")
        await self.nc.subscribe(subjects.LOAD_REPORTS_ALL, cb=self._on_report)
        self._reports_subscribed_at = time.monotonic()
        await self.dispatch_nc.subscribe(subjects.DISPATCH, queue=subjects.SCHEDULER_QUEUE, cb=self._on_dispatch)
        await self.dispatch_nc.subscribe(subjects.HANDOFF, queue=subjects.SCHEDULER_QUEUE, cb=self._on_handoff)
        await self.nc.subscribe(subjects.SCHEDULER_HEARTBEAT, cb=self._on_peer_heartbeat)
        await self.prefixes.start(self.nc)
        self._tasks = [asyncio.create_task(self._expiry_loop(), name="expiry"),
                       asyncio.create_task(self.prefixes.run(), name="prefix-index")]
        if self.config.enable_migration:
            pairer = MigrationPairer(self.config.policy, self.config.guard, self.prefixes.index)
            self.migration_loop = MigrationLoop(pairer, self.table.live, self.nc.publish,
                                                self.config.migration_interval_s,
                                                on_order=lambda order: self.metrics.order_sent(order.cancel),
                                                leads=self.leadership.leads)
            self._tasks.append(asyncio.create_task(self.migration_loop.run(), name="migration-pairing"))
            # Only replicas that pair are candidates (dispatch-only replicas stay out of the election).
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        # Start-up's objects (modules, classes) leave the collector's view: a full collection then
        # walks the table, not the whole heap (25 ms pauses at 1,000 instances before).
        gc.freeze()
        log.info("global scheduler %s up (migration %s)", self.config.scheduler_id,
                 "on" if self.config.enable_migration else "off")

    def not_ready_reason(self) -> str | None:
        """The metrics port's `/ready`: it answers dispatch once connected (called from that port's thread)."""
        connected = all(nc is not None and nc.is_connected for nc in (self.nc, self.dispatch_nc))
        return None if connected else "not connected to NATS"

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.prefixes.stop()
        for nc in (self.dispatch_nc, self.nc):
            if nc is not None and not nc.is_closed:
                await nc.drain()

    async def _on_report(self, msg: Msg) -> None:
        # nats-py runs a subscription's backlog back to back (its queue's get() returns at once
        # while messages wait): yield now and then, or a burst of reports holds every dispatch.
        self._reports_since_yield += 1
        if self._reports_since_yield >= REPORTS_PER_YIELD:
            self._reports_since_yield = 0
            await asyncio.sleep(0)
        report = decode_load_report(msg.data, log, msg.subject)
        if report is None:
            return
        self._heard_a_report.set()
        if self.table.get(report.instance_id) is None:
            log.info("instance %s joined (%s, %d blocks)", report.instance_id, report.engine, report.num_blocks_total)
        self.take_report(report)
        self.roles.saw(report)

    def take_report(self, report: LoadReport) -> None:
        """Into the table, with the dispatches it does not show yet added back
        (`shared/unreported_dispatches.py`): for dispatch and admission alike."""
        if self.table.takes(report):  # (a reordered older one is dropped)
            self.table.update(self.unreported.restore(report))

    async def _until_an_instance_reported(self) -> None:
        """Just started, no report yet: idle instances beat every 0.25 s, so an empty table may only
        mean they have not spoken since we subscribed. Wait for one (up to the warm-up) rather
        than refuse with "no instance"."""
        if self._heard_a_report.is_set() or self._reports_subscribed_at is None:
            return
        left = RECEIVER_WARM_UP_S - (time.monotonic() - self._reports_subscribed_at)
        if left > 0:
            await wait_set(self._heard_a_report, left)

    def decide(self, request: DispatchRequest) -> DispatchReply:
        predicted: dict[str, float] = {}  # admission's TTFT on each admitted instance
        with self.metrics.decision_seconds.time():
            self.table.expire()
            if self.roles.disaggregated:  # P/D: decode instances take no new request
                request = self.roles.restrict(request, self.table.live())
            if self.admission is not None:  # early rejection, before any prefill is spent
                request, refusal, predicted = self.admission.check(self.table.live(), request)
                if refusal is not None:
                    self.metrics.dispatched(Refusal.OVERLOADED)
                    return refusal
            if self.named_dispatch is None:
                decision = self.index.choose(request)  # = choose_instance(self.table.live(), ...)
            else:
                decision = self.named_dispatch.choose(request)
        self.metrics.dispatched(decision.reason if decision.instance_id is None else None)
        if decision.instance_id is None:
            return DispatchReply(rejected=decision.rejected, reason=decision.reason)
        chosen = self.table.get(decision.instance_id)
        self.unreported.dispatched(chosen, request, decision.cached_tokens)  # (until its reports show it)
        self.table.replace_load(account_dispatch(chosen, request, decision.cached_tokens))
        return DispatchReply(instance_id=decision.instance_id, predicted_ttft_s=predicted.get(decision.instance_id))

    async def _on_dispatch(self, msg: Msg) -> None:
        with _tracer.start_as_current_span(f"process {subjects.DISPATCH}", context=tracing.extract(msg.headers),
                                           kind=SpanKind.CONSUMER) as span:
            try:
                request = decode(msg.data, DispatchRequest)
            except WireError as exc:
                bus_guard.rejected(msg.subject, exc.reason, str(exc), log, "dispatch request")
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                await msg.respond(encode(DispatchReply(rejected=str(exc), reason=Refusal.INVALID)))
                return
            await self._until_an_instance_reported()
            reply = self.decide(request)
            if span.is_recording():
                span.set_attributes({"corral.request_id": request.request_id,
                                     "corral.instance_id": reply.instance_id or "",
                                     "corral.rejected": reply.rejected or "",
                                     "corral.instances_live": len(self.table)})
            await msg.respond(encode(reply))

    async def _on_handoff(self, msg: Msg) -> None:
        try:
            query = decode(msg.data, HandoffQuery)
        except WireError as exc:
            bus_guard.rejected(msg.subject, exc.reason, str(exc), log, "hand-off query")
            await msg.respond(encode(HandoffAnswer(reason=str(exc)[:1024])))
            return
        await msg.respond(encode(self.roles.handoff(query)))

    async def _on_peer_heartbeat(self, msg: Msg) -> None:
        beat = decode_or_drop(msg.data, SchedulerHeartbeat, log, "scheduler heartbeat", msg.subject)
        if beat is not None:
            self.leadership.heard(beat.scheduler_id)

    async def _heartbeat_loop(self) -> None:
        beat = encode(SchedulerHeartbeat(self.config.scheduler_id))
        while True:
            if self.nc is not None and self.nc.is_connected:
                try:
                    await self.nc.publish(subjects.SCHEDULER_HEARTBEAT, beat)
                except Exception as exc:  # (NATS away) the next beat tries again
                    log.debug("scheduler heartbeat not sent: %s", exc)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _expiry_loop(self) -> None:
        # Compared with the live set rather than read from `expire()`: dispatch's `live()` expires
        # entries too, silently, and a death must be logged whichever noticed it first.
        known: set[str] = set()
        while True:
            await asyncio.sleep(min(0.25, self.config.instance_timeout_s / 4))
            live = {load.instance_id for load in self.table.live()}
            for instance_id in sorted(known - live):
                log.warning("instance %s died or left: no load report for %.1f s; dropped", instance_id,
                            self.config.instance_timeout_s)
                self.unreported.forget(instance_id)
            known = live
