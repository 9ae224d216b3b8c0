"""Choosing an instance: ask the global scheduler; if it is slow or absent, decide locally.

Bypass mode runs the scheduler's own pure policy (`choose_instance`) over the load reports this
gateway has seen, and counts each request it sends with `account_dispatch` so a burst between two
reports spreads instead of piling onto the instance that looked freest at the last one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from services.gateway.instances import GatewayInstances
from services.gateway.metrics import GatewayMetrics
from services.gateway.scheduler_breaker import SchedulerBreaker
from services.gateway.errors import ApiError, refusal_error
from shared import subjects, tracing
from shared.messages import DispatchReply, DispatchRequest, Refusal, WireError, decode, encode
from shared.nats_client import request as nats_request
from shared.policy import PolicyConfig, choose_instance
from shared.policy.disaggregation import dispatch_pool
from shared.policy.dispatch import REJECT_NO_INSTANCE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    instance_id: str
    predicted_ttft_s: float | None = None  # admission control's, on that instance (None: no admission)


class Dispatcher:
    def __init__(self, nc: Client, instances: GatewayInstances, metrics: GatewayMetrics, timeout_s: float,
                 policy: PolicyConfig | None = None) -> None:
        self._nc = nc
        self._instances = instances
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._policy = policy or PolicyConfig()
        self.bypassing = False  # inside a bypass episode: logged once when it starts and when it ends
        self.breaker = SchedulerBreaker()  # a frozen scheduler costs one timeout, not one per request
        self._opened: asyncio.Future[None] | None = None  # done once the breaker opened (see `_ask`)

    async def choose(self, request: DispatchRequest, prompt_param: str = "prompt") -> str:
        """The instance to run `request` on; ApiError (400/429/503, see `refusal_error`) when there
        is none. `prompt_param` is the body field a too-long refusal names."""
        return (await self.place(request, prompt_param)).instance_id

    async def place(self, request: DispatchRequest, prompt_param: str = "prompt") -> Placement:
        """As `choose`, with the TTFT the scheduler's admission control predicts there."""
        started = time.perf_counter()
        try:
            return await self._choose(request, prompt_param)
        finally:
            self._metrics.dispatch_latency.observe(time.perf_counter() - started)

    async def _choose(self, request: DispatchRequest, prompt_param: str) -> Placement:
        probe = not self.breaker.closed
        if not self.breaker.may_ask():
            return self._bypass(request, "the global scheduler stopped answering", prompt_param)
        try:
            msg = await self._ask(request, probe)
        except _BreakerOpened:
            return self._bypass(request, "the global scheduler stopped answering", prompt_param)
        except asyncio.CancelledError:
            if probe:
                self.breaker.abandoned()  # the client left mid-probe: the next request probes
            raise
        except NoRespondersError:
            self._breaker_answered()  # (an instant answer: nobody to wait for)
            return self._bypass(request, "no global scheduler is running", prompt_param)
        except TimeoutError:
            self._breaker_failed()
            return self._bypass(request, f"the global scheduler did not answer within {self._timeout_s:g} s",
                                prompt_param)
        except NatsError as exc:
            self._breaker_answered()  # (not the scheduler's fault; never leave a probe hanging)
            raise ApiError(503, f"the gateway is not connected to NATS: {exc}") from exc
        try:
            reply = decode(msg.data, DispatchReply)
        except WireError as exc:
            log.warning("bad dispatch reply: %s", exc)
            self._breaker_failed()
            return self._bypass(request, "the global scheduler sent a bad reply", prompt_param)
        self._breaker_answered()
        self._end_bypass()
        if reply.instance_id is not None:
            return Placement(reply.instance_id, reply.predicted_ttft_s)
        # A scheduler too old to say why: the generic refusal, load shedding (retry later).
        reason = reply.reason or Refusal.OVERLOADED
        raise refusal_error(reason, _message(reason, reply.rejected or "rejected by the global scheduler"),
                            prompt_param, reply.retry_after_s)

    async def _ask(self, request: DispatchRequest, probe: bool) -> Msg:
        """The scheduler's answer. A request asked while the breaker was closed stops waiting
        (`_BreakerOpened`) as soon as another's timeout opens it: requests in flight together
        pay one timeout between them, not one each. The probe waits its own timeout."""
        asking = nats_request(self._nc, subjects.DISPATCH, encode(request), self._timeout_s, tracing.inject())
        if probe:
            return await asking
        if self._opened is None:
            self._opened = asyncio.get_running_loop().create_future()
        opened, answer = self._opened, asyncio.ensure_future(asking)
        try:
            await asyncio.wait((answer, opened), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not answer.done():
                answer.cancel()
        if answer.done() and not answer.cancelled():
            return answer.result()
        raise _BreakerOpened

    def _breaker_answered(self) -> None:
        self.breaker.answered()
        if self._opened is not None and self._opened.done():
            self._opened = None  # closed again: the next opening is news

    def _breaker_failed(self) -> None:
        self.breaker.failed()
        if self._opened is not None and not self._opened.done():
            self._opened.set_result(None)

    def _bypass(self, request: DispatchRequest, why: str, prompt_param: str) -> Placement:
        if not self.bypassing:
            self.bypassing = True
            log.warning("%s: dispatching from this gateway's load reports (bypass mode)", why)
        # (the scheduler's dispatch pool: no decode instance while a prefill one is live)
        decision = choose_instance(dispatch_pool(self._instances.live_loads()), request, self._policy)
        if decision.instance_id is None:
            reason = decision.reason or Refusal.NO_INSTANCE
            raise refusal_error(reason, _message(reason, decision.rejected or REJECT_NO_INSTANCE), prompt_param)
        self._instances.account(decision.instance_id, request)
        self._metrics.bypass_dispatches.inc()
        return Placement(decision.instance_id)

    def _end_bypass(self) -> None:
        if self.bypassing:
            self.bypassing = False
            log.info("the global scheduler answers again: bypass mode ends")


class _BreakerOpened(Exception):
    """Another request's timeout opened the breaker while this one waited."""


def _message(reason: Refusal, rejected: str) -> str:
    if reason is Refusal.TOO_LONG:
        return f"{rejected}; shorten the prompt"
    if reason is Refusal.NO_INSTANCE:
        return f"{rejected}: no inference instance is alive"
    return f"request rejected: {rejected}"
