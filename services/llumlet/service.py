"""The llumlet: owns one engine, streams its outputs, reports its load, takes orders over NATS."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from services.llumlet.config import LlumletConfig
from services.llumlet.engine import Engine
from shared.engine_model.views import EngineError
from services.llumlet.metrics import LlumletMetrics
from services.llumlet.served import ServedTally
from services.llumlet.tracing import RequestSpans, trace_context_of
from shared.metrics_server import serve_metrics
from services.llumlet.readiness import not_ready_reason
from services.llumlet.gateway_watch import GatewayWatch
from services.llumlet.routes import OutputRoutes
from services.llumlet.migration.runtime import LlumletMigration
from services.llumlet.migration_hooks import LlumletMigrationHooks
from services.llumlet.output import OutputPublisher
from services.llumlet.handoff import PrefillHandoff, nats_ask
from services.llumlet.kv_events import KvEventPublisher
from services.llumlet.kv_journal import journal_of
from services.llumlet.load_reports import LoadReporter
from services.llumlet.migration import kv_auth
from shared import bus_guard, subjects, tracing
from shared.messages import (
    AbortRequest,
    Ack,
    DrainOrder,
    DrainSource,
    FinishReason,
    GatewayHeartbeat,
    GenerateRequest,
    Refusal,
    TokenChunk,
    WireError,
    decode,
    decode_or_drop,
    encode,
)
from shared.nats_client import connect, flush_in_order
from services.stop_phases import StopPhases
from shared.policy.disaggregation import wants_handoff

log = logging.getLogger(__name__)

LOOP_LAG_S = 0.5  # the gateway watch woke this late: the llumlet was stalled, not its gateways silent


class Llumlet:
    def __init__(self, config: LlumletConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.instance_id = config.instance_id
        self.role = config.role
        self.nc: Client | None = None
        self.draining = False
        self.drained_by: DrainSource | None = None  # who made it drain, reported while it does
        self.leaving = False  # stopping: new requests are refused (DRAINING) so the gateway tries another
        self.routes = OutputRoutes()  # where each request's output goes
        self.gateways = GatewayWatch()  # a gateway gone silent: its requests have no reader
        self._work = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # Token output to the gateways (held in order while NATS cannot take it).
        self.output = OutputPublisher(self.instance_id, self.routes, lambda: self.nc, lambda: self.spans)
        self.migration: LlumletMigration | None = None
        self.handoff: PrefillHandoff | None = None  # a prefill instance's hand-offs to decode instances
        self.metrics: LlumletMetrics | None = None
        self.served = ServedTally()  # finished requests and step pace, for admission control
        self.spans = RequestSpans(self.instance_id, "")  # replaced once tracing is set up in start()
        self.reports = LoadReporter(self)  # what the schedulers know of this instance

    def _build_migration(self) -> LlumletMigration | None:
        """After the engine started: its KV tensors (what the copier moves) exist only then."""
        ops = self.engine.migration_ops() if self.config.enable_migration else None
        if ops is None:
            if self.config.enable_migration:
                log.warning("engine %s cannot migrate requests: migration off", self.engine.kind)
            return None
        config = self.config
        return LlumletMigration(
            self.instance_id, ops, config.migration, LlumletMigrationHooks(self),
            config.kv_host, config.kv_port, config.kv_advertise_host,
        )

    def _build_handoff(self) -> PrefillHandoff | None:
        if not wants_handoff(self.role):
            return None
        coordinator = self.migration.coordinator if self.migration is not None else None
        if coordinator is None:
            log.warning("role %s without live migration: requests decode here (as on a mixed instance)", self.role)
            return None
        ops = self.migration.ops

        async def resume(request_id: str) -> None:
            if await ops.resume(request_id):
                self.wake_engine()

        return PrefillHandoff(self.instance_id, nats_ask(lambda: self.nc), coordinator.migrate,
                              ops.migration_snapshot, self.config.handoff_concurrency,
                              on_outcome=self.metrics.handed_off, suspend=ops.suspend, resume=resume)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        tracing.setup_tracing("corral-llumlet", self.instance_id)
        await self.engine.start()
        self.spans = RequestSpans(self.instance_id, self.engine.model_name)
        self.migration = self._build_migration()
        self.metrics = LlumletMetrics(self.engine.model_name, self.instance_id)
        bus_guard.register(self.metrics.registry)
        kv_auth.register(self.metrics.registry)
        serve_metrics(self.metrics.registry, self.config.metrics_port, ready=self.not_ready_reason)
        self.nc = await connect(self.config.nats_url, f"llumlet-{self.instance_id}")
        nc = self.nc
        await nc.subscribe(subjects.llumlet(self.instance_id, "generate"), cb=self._on_generate)
        await nc.subscribe(subjects.ABORT_ALL, cb=self._on_abort)
        await nc.subscribe(subjects.GATEWAY_HEARTBEATS_ALL, cb=self._on_gateway_heartbeat)
        await nc.subscribe(subjects.llumlet(self.instance_id, "drain"), cb=self._on_drain)
        self._tasks = [
            asyncio.create_task(self._engine_loop(), name="engine-loop"),
            asyncio.create_task(self.reports.run(), name="report-loop"),
            asyncio.create_task(self._watch_gateways(), name="gateway-watch"),
        ]
        if (journal := journal_of(self.engine)) is not None:  # its prefix cache, told to the schedulers
            kv_events = KvEventPublisher(self.instance_id, self.engine.block_size, journal, lambda: self.nc)
            await kv_events.subscribe(nc)
            self._tasks.append(asyncio.create_task(kv_events.run(), name="kv-events"))
        if self.migration is not None:
            for loop in await self.migration.start(nc):
                self._tasks.append(asyncio.create_task(loop, name=loop.__qualname__))
            self.migration.coordinator.on_ended = self.metrics.outgoing_migration_ended
        self.handoff = self._build_handoff()
        if self.handoff is not None:
            self._tasks.append(asyncio.create_task(self.handoff.run(), name="handoff"))
        await self.reports.publish()
        log.info(
            "llumlet %s up: role=%s engine=%s blocks=%d block_size=%d",
            self.instance_id,
            self.role,
            self.engine.kind,
            self.engine.num_blocks_total,
            self.engine.block_size,
        )

    async def wait_failed(self) -> None:
        """Returns (raising) only if a background loop died: the process should then exit."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()

    def not_ready_reason(self) -> str | None:
        """The metrics port's `/ready` (called from its thread: only reads)."""
        connected = self.nc is not None and self.nc.is_connected
        return not_ready_reason(self.reports.last, self.draining, connected, self.config.report_interval_s, time.time())

    async def stop(self) -> None:
        """Each phase bounded (`StopPhases`): a stop always ends in an exit, and one that waits
        logs where."""
        phases = StopPhases(f"llumlet {self.instance_id}", log)
        await phases.run("announcing", self._announce_leaving(), 5)
        await phases.run("emptying out", self._empty_out(self.config.stop_grace_s), self.config.stop_grace_s + 5)
        for task in self._tasks:
            task.cancel()
        await phases.run("ending its loops", asyncio.gather(*self._tasks, return_exceptions=True), 5)
        if self.migration is not None:  # outgoing requests resume here, incoming leases are freed
            await phases.run("ending migrations", self.migration.stop(), 10)
        await phases.run("failing what is left", self._fail_all("instance stopped", resumable=True), 10)
        if self.nc is not None and not self.nc.is_closed and not await phases.run("draining NATS", self.nc.drain(), 5):
            await phases.run("closing NATS", self.nc.close(), 5)
        await phases.run("stopping the engine", self.engine.stop(), 30)

    async def _empty_out(self, grace_s: float) -> None:
        """Stopping: the scheduler migrates requests out of a draining instance (live, no
        recompute) and the rest keep decoding here, for up to `grace_s`."""
        deadline = time.monotonic() + grace_s
        if self.routes:
            log.info("llumlet %s stopping: migrating %d request(s) out (grace %.1f s)", self.instance_id,
                     len(self.routes), grace_s)
        while self.routes and time.monotonic() < deadline and not any(t.done() for t in self._tasks):
            await asyncio.sleep(0.02)
        if self.routes:
            log.info("llumlet %s stopping: %d request(s) left after the grace period: the gateways resume them",
                     self.instance_id, len(self.routes))

    async def _announce_leaving(self) -> None:
        """A last report marked draining: dispatch goes elsewhere now, not after the instance
        timeout (what this instance still holds migrates out or fails with an error)."""
        if self.nc is None or self.nc.is_closed or self.metrics is None:
            return
        self.draining = self.leaving = True
        self.drained_by = self.drained_by or DrainSource.STOPPING  # an autoscaler's drain stays its
        try:
            await self.reports.publish()
            await flush_in_order(self.nc, timeout_s=1)
        except (NatsError, TimeoutError) as exc:
            log.warning("could not announce that %s is leaving: %s", self.instance_id, exc)

    # ------------------------------------------------------------------ orders

    async def _on_generate(self, msg: Msg) -> None:
        try:
            request = decode(msg.data, GenerateRequest)
            if self.leaving:
                raise EngineError(f"instance {self.instance_id} is shutting down", Refusal.DRAINING)
            if request.request_id in self.routes:
                raise EngineError(f"request {request.request_id} is already running here", Refusal.DUPLICATE)
            request.trace_context = trace_context_of(msg.headers) or request.trace_context
            self.engine.add_request(request)
        except WireError as exc:
            bus_guard.rejected(msg.subject, exc.reason, str(exc), log, "generate order")
            await msg.respond(encode(Ack(ok=False, error=str(exc), reason=Refusal.INVALID)))
            return
        except EngineError as exc:
            await msg.respond(encode(Ack(ok=False, error=str(exc), reason=exc.reason)))
            return
        self.routes.open(request.request_id, request.reply_subject, request.resume_from)
        self.served.accepted()
        if request.batched_output:
            self.output.batch_for(request.reply_subject)
        self.metrics.request_arrived(request.request_id, time.monotonic())
        self.spans.started(request)
        self._work.set()
        self.report_soon()
        await msg.respond(encode(Ack(ok=True)))

    async def _on_abort(self, msg: Msg) -> None:
        order = decode_or_drop(msg.data, AbortRequest, log, "abort", msg.subject)
        if order is None or order.instance_id not in (None, self.instance_id):
            return  # (another instance's copy of the request)
        if self.migration is not None:
            self.migration.on_request_aborted(order.request_id)
        if (subject := self.routes.close(order.request_id)) is not None:
            self.engine.abort_request(order.request_id)
            log.debug("request %s aborted (%s)", order.request_id, order.reason)  # (benchmarks/cancellation.py)
            self.metrics.request_left(order.request_id)
            self.spans.ended(order.request_id, "aborted")
            self.report_soon()
            if order.gateway_id is None or subjects.gateway_output(order.gateway_id) != subject:
                # Not its gateway's abort: that gateway still waits for tokens; end its stream.
                error = f"request aborted ({order.reason}) by {order.gateway_id or 'another party'} ({self.instance_id})"
                chunk = TokenChunk(order.request_id, self.instance_id, 0, [], finish_reason=FinishReason.ERROR, error=error)
                await self.output.publish_chunk(subject, encode(chunk))

    async def _on_gateway_heartbeat(self, msg: Msg) -> None:
        beat = decode_or_drop(msg.data, GatewayHeartbeat, log, "gateway heartbeat", msg.subject)
        if beat is not None:
            self.gateways.heard(beat.gateway_id, beat.interval_s)

    async def _watch_gateways(self) -> None:
        """Abort the requests of a gateway gone silent (killed): nobody reads their tokens."""
        tick = time.monotonic()
        while True:
            await asyncio.sleep(0.1)
            lagged, tick = time.monotonic() - tick > LOOP_LAG_S, time.monotonic()
            if not self.output.bus_up() or lagged:
                # Away from NATS, or this loop itself stalled (a long engine step under load):
                # heartbeats may wait unread in our own buffers; their silence proves nothing.
                self.gateways.pause()
                continue
            for gateway_id in self.gateways.gone():
                orphans = self.routes.routed_to(subjects.gateway_output(gateway_id))
                if orphans:
                    log.warning("gateway %s went silent: aborting its %d request(s)", gateway_id, len(orphans))
                why = f"gateway {gateway_id} went silent"
                for request_id in orphans:
                    if self.migration is not None:
                        self.migration.on_request_aborted(request_id)
                    subject = self.routes.close(request_id)
                    self.engine.abort_request(request_id)
                    self.metrics.request_left(request_id)
                    self.spans.ended(request_id, "aborted", error=why)
                    # Should it be alive after all (starved, not killed: seen at load 11 on 2 cores),
                    # it resumes the request elsewhere from the tokens it delivered; nothing is lost.
                    chunk = TokenChunk(request_id, self.instance_id, 0, [], finish_reason=FinishReason.ERROR,
                                       error=f"{why}: request aborted ({self.instance_id})", resumable=True)
                    await self.output.publish_chunk(subject, encode(chunk))
                self.report_soon()

    async def _on_drain(self, msg: Msg) -> None:
        order = decode_or_drop(msg.data, DrainOrder, log, "drain order", msg.subject)
        if order is None:
            if msg.reply:  # a request is answered, a bad one too
                await msg.respond(encode(Ack(ok=False, error="bad drain order", reason=Refusal.INVALID)))
            return
        self.draining = order.drain
        self.drained_by = order.by if order.drain else None
        log.info("llumlet %s draining=%s (by %s)", self.instance_id, self.draining, order.by.value)
        self.report_soon()
        if msg.reply:
            await msg.respond(encode(Ack(ok=True)))

    # ------------------------------------------------------------------ engine loop

    async def _engine_loop(self) -> None:
        while True:
            if not self.output.bus_up():
                await self.output.wait_for_bus()  # pause output rather than pile it up
                continue
            if not self.engine.has_work():
                self.served.went_idle()
                self._work.clear()
                await self._work.wait()
                continue
            # (a commit due any moment may hold the step, so that its request is in it)
            started = await self.migration.before_step() if self.migration is not None else time.monotonic()
            if self.migration is not None and self.migration.hold.last_held_s > 0:
                self.metrics.commit_holds.observe(self.migration.hold.last_held_s)
            try:
                outputs = await self.engine.step()
            except Exception:
                log.exception("engine step failed; failing in-flight requests")
                await self._fail_all("engine failure", resumable=True)
                raise
            views = self.engine.request_views() if self.metrics.wants_views(started) else ()
            ended = time.monotonic()
            self.metrics.step_done(started, ended, outputs, views)
            self.served.step_done(started, ended, outputs)
            await self.output.publish_step(outputs)
            if self.migration is not None:  # (its handover log line after the tokens went out)
                self.migration.after_step(started, ended)
            if self.handoff is not None:  # (after the first token went out from here)
                await self.handoff.prefilled(outputs)
            if outputs:
                self.reports.soon_if_blocks_moved()

    async def fail_request(self, request_id: str, reason: str) -> None:
        subject = self.routes.close(request_id)
        self.engine.abort_request(request_id)
        self.metrics.request_left(request_id)
        self.spans.ended(request_id, "failed", error=reason)
        if subject is not None and self.nc is not None and not self.nc.is_closed:
            error = f"{reason} ({self.instance_id})"
            chunk = TokenChunk(request_id, self.instance_id, 0, [], finish_reason=FinishReason.ERROR, error=error)
            await self.nc.publish(subject, encode(chunk))

    async def _fail_all(self, reason: str, resumable: bool = False) -> None:
        """Every request this instance holds ends with an error, never silence (`resumable`: the
        gateway resumes it elsewhere from the tokens it delivered)."""
        if self.nc is None or self.nc.is_closed:
            return
        for request_id, subject in self.routes.close_all():
            chunk = TokenChunk(
                request_id=request_id,
                instance_id=self.instance_id,
                start_index=0,
                token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=f"{reason} ({self.instance_id})",
                resumable=resumable,
            )
            await self.output.publish_chunk(subject, encode(chunk))
            self.engine.abort_request(request_id)
        self.spans.end_all("failed", error=reason)
        await flush_in_order(self.nc)

    # ------------------------------------------------------------------ wake-ups (the migration hooks' too)

    def wake_engine(self) -> None:
        """There is work for the engine loop (a request arrived, migrated in or resumed)."""
        self._work.set()

    def report_soon(self) -> None:
        """Publish a load report now rather than at the next interval."""
        self.reports.soon()
