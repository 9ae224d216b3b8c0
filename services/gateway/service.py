"""GatewayService: owns the NATS connection, the subscriptions, and each request's way to an instance.

Subscription callbacks only decode and hand off (to a stream's queue or the instance table): NATS
runs a subscription's callbacks one at a time, so a slow one would stall every request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from services.gateway.body_parsing import ModelLimits
from services.gateway.body_workers import BodyWorkers
from services.gateway.config import GatewayConfig
from services.gateway.control_channel import ControlChannel
from services.gateway.dispatcher import Dispatcher
from services.gateway.instances import GatewayInstances
from services.gateway.prefix_hashes import PromptHasher
from services.gateway.metrics import GatewayMetrics
from services.gateway.errors import TRY_ANOTHER_INSTANCE, ApiError, refusal_error
from services.gateway.prepared import PreparedRequest, prepare_request
from services.gateway.protocol import GenerationOptions, RequestKind
from services.gateway.resume import Resumer
from services.gateway.streams import OutputStream, StreamRegistry
from services.gateway.tokenizer import ModelTokenizer
from shared import bus_guard, subjects, tracing
from shared.messages import (
    AbortRequest, Ack, DispatchRequest, GenerateRequest, Refusal, WireError, decode, decode_chunks, decode_load_report,
    encode,
)
from shared.nats_client import connect, flush_in_order, request as nats_request

log = logging.getLogger(__name__)

# After NATS comes back, instances get this long to reconnect and report before their silence
# counts as death (their reconnect backoff, shared/nats_client.py, is at most ~1.5 s).
RECONNECT_GRACE_S = 3.0
# A 503 because NATS is away: clients may retry soon (a broker restart takes seconds).
NATS_AWAY_HEADERS = {"retry-after": "1"}
BUSY_HEADERS = {"retry-after": "1"}  # at the in-flight bound: requests end every few seconds
LOOP_LAG_S = 0.5  # the watchdog woke this late: this gateway is behind on its own work


class _InstanceGone(Exception):
    """The instance chosen for a request died, or never acknowledged it: try another."""


class GatewayService:
    def __init__(self, config: GatewayConfig, tokenizer: ModelTokenizer | None = None) -> None:
        self.config = config
        self._owns_tokenizer = tokenizer is None
        self.tokenizer = tokenizer or ModelTokenizer.load(config.model_dir, config.max_model_len,
                                                          config.tokenizer_workers)
        self.metrics = GatewayMetrics(config.model_name, self.tokenizer.max_model_len)
        self.body_workers = BodyWorkers(config.body_parse_workers, config.body_offload_bytes)
        bus_guard.register(self.metrics.registry)
        self.instances = GatewayInstances(config.instance_timeout_s)
        self.prompt_hasher = PromptHasher()
        self.metrics.watch_instances(lambda: [load.instance_id for load in self.instances.live_loads()])
        self.resumer = Resumer(self._place, config.max_resumes, self._spawn,
                               is_open=lambda request_id: self.streams.is_open(request_id),
                               send=self._send_generate, abort=self._publish_abort)
        self.streams = StreamRegistry(on_handover_stall=self.metrics.migration_stalled,
                                      vocab_size=self.tokenizer.vocab_size, on_lost=self.resumer.lost,
                                      max_buffered=config.max_buffered_chunks,
                                      on_stray=lambda stream, instance_id: self._spawn(self._send_abort(
                                          stream.request_id, "a copy a resume left behind", instance_id)))
        self.started_at = int(time.time())
        self.output_subject = subjects.gateway_output(config.gateway_id)
        self._nc: Client | None = None
        self._dispatcher: Dispatcher | None = None
        self._watchdog: asyncio.Task[None] | None = None
        # Heartbeats (llumlets abort a silent gateway's requests) and fast aborts, off the main loop.
        self._control: ControlChannel | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._silence_floor = 0.0  # monotonic: no instance's silence counts from before this
        # Nor a stream's from before the gateway last caught up with its token output: a chunk
        # waiting in our own backlog is not a lost one (Resumer.silent).
        self._caught_up_since = 0.0
        self._token_sub: Subscription | None = None
        self._away_since: float | None = None  # when this gateway lost NATS (None: connected)

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def max_model_len(self) -> int:
        """The context the instances run: the smallest any live instance reports, so a request
        that passes here fits wherever it lands; the model's own (or --max-model-len) while none
        reports one."""
        return self.instances.smallest_max_model_len() or self.tokenizer.max_model_len

    def model_limits(self) -> ModelLimits:
        """What a request body is checked against (body_parsing), as of now."""
        return ModelLimits(self.max_model_len, self.tokenizer.chars_per_token, self.tokenizer.vocab_size)

    async def start(self) -> None:
        assert self._nc is None, "started twice"
        tracing.setup_tracing("corral-gateway", self.config.gateway_id)
        nc = await connect(self.config.nats_url, name=f"corral-gateway-{self.config.gateway_id}")
        self._token_sub = await nc.subscribe(self.output_subject, cb=self._on_token_chunk)
        await nc.subscribe(subjects.LOAD_REPORTS_ALL, cb=self._on_load_report)
        await flush_in_order(nc)
        self._nc = nc
        self._dispatcher = Dispatcher(nc, self.instances, self.metrics, self.config.dispatch_timeout_s)
        self._watchdog = asyncio.create_task(self._watch_holders(), name="gateway-watchdog")
        self._control = ControlChannel(self.config.nats_url, self.config.gateway_id)
        self._control.start()
        log.info("gateway %s connected to %s, serving %s", self.config.gateway_id, self.config.nats_url,
                 self.config.model_name)

    def fail_all(self, reason: str) -> None:
        """End every open request with an error (shutdown): their handlers then finish and abort."""
        for stream in self.streams:
            stream.fail(reason, 503)

    async def stop(self) -> None:
        self.fail_all("the gateway is shutting down")
        for stream in self.streams:
            self.release(stream, abort=True)
        if self._control is not None:
            await asyncio.to_thread(self._control.stop)
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        if self._nc is not None and not self._nc.is_closed:
            try:
                await self._nc.drain()
            except NatsError as exc:
                log.warning("NATS drain failed: %s", exc)
        await self.body_workers.close()
        if self._owns_tokenizer:
            self.tokenizer.close()

    # ---- subscriptions ----------------------------------------------------------------------

    async def _on_token_chunk(self, msg: Msg) -> None:
        # One chunk, or a TokenChunkBatch: an engine step's chunks of our requests on one instance.
        try:
            chunks = decode_chunks(msg.data)
        except WireError as exc:
            bus_guard.rejected(msg.subject, exc.reason, str(exc), log, "token chunk")
            return
        for chunk in chunks:
            if (problem := self.streams.refusal(chunk)) is not None:
                bus_guard.rejected(msg.subject, "invalid", problem, log, "token chunk")
                continue
            if not self.streams.route(chunk):
                log.debug("chunk for unknown request %s (finished or aborted)", chunk.request_id)

    async def _on_load_report(self, msg: Msg) -> None:
        report = decode_load_report(msg.data, log, msg.subject)
        if report is not None:
            self.instances.update(report)

    async def _watch_holders(self) -> None:
        """Resume requests whose instance died (its 50 ms load reports stopped) or lost a chunk;
        a dead holder would otherwise hang them."""
        interval = min(0.1, self.config.death_timeout_s / 4)
        while True:
            woke = time.monotonic() + interval
            await asyncio.sleep(interval)
            if time.monotonic() - woke > LOOP_LAG_S or (self._token_sub is not None and self._token_sub.pending_msgs):
                self._caught_up_since = time.monotonic()  # behind: streams' silence proves nothing yet
            try:
                self._check_holders()
            except Exception:  # a bug here must not stop the watchdog for good
                log.exception("instance watchdog failed")

    def holder_dead(self, instance_id: str, since: float) -> bool:
        """No load report from the instance for `death_timeout_s` while other instances reported
        (or for the generic `instance_timeout_s` at all), counting from `since` (when we started
        relying on it) and never from before NATS came back to this gateway."""
        since = max(since, self._silence_floor)
        return (self.instances.silent_for(instance_id, since)
                > self.instances.death_limit_s(instance_id, self.config.death_timeout_s)
                or self.instances.is_silent(instance_id, since))

    def _check_holders(self) -> None:
        now = time.monotonic()
        if not self.connected:  # silence means nothing while we hear no one
            self._away_since = self._away_since or now
            self._silence_floor = now + RECONNECT_GRACE_S
            if now - self._away_since > self.config.nats_outage_fail_s:
                self.fail_all(f"the gateway lost NATS {now - self._away_since:.0f} s ago")
            return
        self._away_since = None
        for stream in self.streams:
            holder = stream.holder
            if stream.finished or holder is None or holder in stream.left:
                continue
            if self.holder_dead(holder, stream.holder_since):
                self.instances.mark_dead(holder)
                self.resumer.lost(stream, holder, f"instance {holder} stopped reporting")
            elif stream.gap_since is not None and now - stream.gap_since > self.config.death_timeout_s:
                self.resumer.lost(stream, holder, f"a token chunk from instance {holder} was lost")
            else:  # a lost last chunk shows no gap: only silence
                self.resumer.silent(stream, holder, not_before=max(self._silence_floor, self._caught_up_since))
        self.instances.forget_marks(older_than_s=60 * self.config.instance_timeout_s)

    # ---- requests ---------------------------------------------------------------------------

    def prepare(self, kind: RequestKind, prompt_token_ids: list[int], options: GenerationOptions, priority: int,
                response_id: str | None = None, arrival: float | None = None,
                request_id: str | None = None) -> PreparedRequest:
        """`prepare_request` against this gateway's model (context window, vocabulary, default budget)."""
        return prepare_request(kind, prompt_token_ids, options, priority, max_model_len=self.max_model_len,
                               vocab_size=self.tokenizer.vocab_size, default_max_tokens=self.config.default_max_tokens,
                               response_id=response_id, arrival=arrival, request_id=request_id)

    async def submit(self, request: PreparedRequest) -> OutputStream:
        """Dispatch and hand the request to an instance; its output then flows into the stream.
        Raises ApiError when no instance takes it."""
        if self._nc is None or self._dispatcher is None or not self._nc.is_connected:
            raise ApiError(503, "the gateway is not connected to NATS", headers=NATS_AWAY_HEADERS)
        if len(self.streams) >= self.config.max_requests_in_flight:
            raise ApiError(503, f"this gateway is serving its limit of {self.config.max_requests_in_flight} requests "
                                "(--max-requests-in-flight); retry later", headers=BUSY_HEADERS)
        # Open the stream first: the instance may publish tokens before its Ack reaches us.
        stream = self.streams.open(request.request_id, request.max_tokens)
        self.metrics.in_flight_changed(+1)
        self.resumer.track(request)
        try:
            async with stream.placing:  # (a resume set off meanwhile waits: Resumer._resume)
                await self._place(request, stream)
        except asyncio.CancelledError:
            self.release(stream, abort=True, acknowledged=False)  # the client left while the generate was in flight
            raise
        except BaseException:
            self.release(stream, abort=False)
            raise
        return stream

    async def _place(self, request: PreparedRequest, stream: OutputStream, exclude: list[str] | None = None,
                     resume_from: int = 0) -> None:
        """Choose an instance and hand it the request (`resume_from`: see GenerateRequest)."""
        assert self._dispatcher is not None
        exclude = list(exclude or ())
        gone: list[str] = []  # why the instances tried so far did not take it
        hashes, block_size = await self.prompt_hasher.hashes(
            request.prompt_token_ids, self.instances.prefix_block_size() if self.config.dispatch_prefix_hashes else None)
        for _attempt in range(3):  # more tries when the chosen instance is gone or leaving
            dispatch = DispatchRequest(request.request_id, len(request.prompt_token_ids), request.max_tokens,
                                       request.priority, list(exclude), block_hashes=hashes,
                                       prefix_block_size=block_size)
            try:
                placement = await self._dispatcher.place(dispatch, request.kind.prompt_param)
            except ApiError as error:
                if not gone:
                    raise
                raise ApiError(error.status, f"{'; '.join(gone)}; {error.message}", error.param, error.headers,
                               error.reason) from error
            instance_id, stream.predicted_ttft_s = placement.instance_id, placement.predicted_ttft_s
            stream.set_holder(instance_id)
            try:
                await self._send_generate(instance_id, request, stream, resume_from)
                if not self.streams.is_open(stream.request_id):  # released meanwhile (a resume)
                    self._publish_abort(request.request_id, "released while it was placed")
                log.debug("request %s (%d prompt tokens, max_tokens %d, priority %d) → %s", request.request_id,
                          len(request.prompt_token_ids), request.max_tokens, request.priority, instance_id)
                return
            except NoRespondersError:
                log.warning("instance %s has no responders: marking it dead", instance_id)
                self.instances.mark_dead(instance_id)
                exclude.append(instance_id)
            except _InstanceGone as why:
                log.warning("request %s: %s; trying another instance", request.request_id, why)
                gone.append(str(why))
                exclude.append(instance_id)
            except ApiError as error:
                if error.reason not in TRY_ANOTHER_INSTANCE:
                    raise
                log.info("instance %s refused request %s (%s): trying another", instance_id, request.request_id,
                         error.reason.value)
                exclude.append(instance_id)
        raise ApiError(503, f"the instances chosen for the request are gone or leaving ({', '.join(exclude)})",
                       reason=Refusal.NO_INSTANCE)

    async def _send_generate(self, instance_id: str, request: PreparedRequest, stream: OutputStream,
                             resume_from: int = 0) -> None:
        assert self._nc is not None
        try:
            subject = subjects.llumlet(instance_id, "generate")
        except ValueError as exc:
            raise ApiError(500, f"dispatch chose an invalid instance id: {exc}") from exc
        generate = GenerateRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling=request.options.sampling_params(self._max_tokens_on(instance_id, request)),
            reply_subject=self.output_subject, priority=request.priority, arrival_time=time.time(),
            resume_from=resume_from, batched_output=True,
        )
        try:
            msg = await self._acknowledged(instance_id, subject, encode(generate), stream)
        except NoRespondersError:
            raise
        except TimeoutError as exc:
            if stream.holder == instance_id and stream.orderer.next_index > resume_from:
                return  # the acknowledgement was lost, not the request: its tokens are flowing
            self._publish_abort(request.request_id, "no acknowledgement")  # it may still have queued it
            raise _InstanceGone(f"instance {instance_id} did not acknowledge the request within "
                                f"{self.config.generate_timeout_s:g} s") from exc
        except NatsError as exc:
            raise ApiError(503, f"the gateway is not connected to NATS: {exc}",
                           headers=NATS_AWAY_HEADERS) from exc
        if msg is None:
            self.instances.mark_dead(instance_id)
            self._publish_abort(request.request_id, "instance died before acknowledging")
            raise _InstanceGone(f"instance {instance_id} died before acknowledging the request")
        try:
            ack = decode(msg.data, Ack)
        except WireError as exc:
            self._publish_abort(request.request_id, "bad acknowledgement")
            raise ApiError(500, f"instance {instance_id} sent a bad acknowledgement") from exc
        if not ack.ok:
            # An llumlet too old to say why: we cannot tell whose fault it was, so ours (503).
            raise refusal_error(ack.reason or Refusal.ENGINE_FAILED,
                                f"instance {instance_id} refused the request: {ack.error or 'refused'}",
                                request.kind.prompt_param)

    async def _acknowledged(self, instance_id: str, subject: str, payload: bytes, stream: OutputStream) -> Msg | None:
        """The instance's answer to a generate order; None when it died while we waited (its load
        reports stopped): a request sent at the moment of death goes elsewhere at once."""
        assert self._nc is not None
        since = time.monotonic()
        answer = asyncio.ensure_future(nats_request(self._nc, subject, payload, self.config.generate_timeout_s,
                                                    tracing.inject()))
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=0.05)
                if done:
                    return answer.result()
                if self.holder_dead(instance_id, since):
                    return None
        finally:
            answer.cancel()

    def _max_tokens_on(self, instance_id: str, request: PreparedRequest) -> int:
        """An instance may run with a shorter context than the model's: fit the budget to it."""
        limit = self.instances.max_model_len(instance_id)
        room = None if limit is None else limit - len(request.prompt_token_ids)
        return min(request.max_tokens, room) if room is not None and room >= 1 else request.max_tokens

    def release(self, stream: OutputStream, *, abort: bool, acknowledged: bool = True) -> bool:
        """Forget a request; tell every llumlet to drop it unless its engine already finished it.
        False when it was released already.

        The abort of a request its instance `acknowledged` goes out on the control channel, at
        once; one whose generate order may still be in flight follows that order on the main
        connection, which keeps them in order (see control_channel)."""
        if not self.streams.close(stream.request_id):
            return False
        self.resumer.forget(stream.request_id)
        self.metrics.in_flight_changed(-1)
        if abort:
            reason = "client disconnected or request ended early"
            if not (acknowledged and self._control is not None and self._control.abort(stream.request_id, reason)):
                self._publish_abort(stream.request_id, reason)
        return True

    def _publish_abort(self, request_id: str, reason: str) -> None:
        # A task of its own: release() runs in cancelled generators where awaiting is not possible.
        self._spawn(self._send_abort(request_id, reason))

    async def _send_abort(self, request_id: str, reason: str, instance_id: str | None = None) -> None:
        """To every instance, or to `instance_id` alone."""
        if self._nc is None or self._nc.is_closed:
            return
        order = AbortRequest(request_id, reason, self.config.gateway_id, instance_id=instance_id)
        try:
            await self._nc.publish(subjects.ABORT_ALL, encode(order))
        except NatsError as exc:
            log.warning("could not publish abort of %s: %s", request_id, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def serve(config: GatewayConfig) -> None:
    """Run a gateway (HTTP server included) until SIGINT/SIGTERM, then stop it cleanly."""
    from services.gateway.server import serve as serve_http  # the server module imports this one

    await serve_http(config)
