"""Autoscaler: keeps the average normal-priority freeness inside a band by adding instances and
draining them. A drained instance is stopped only once it is empty, so no request is lost.

With prefill/decode pools (issue 19 §2) each pool is scaled apart, on its own signal
(`pool_scaling_decision`): new llumlets get the pool's `--role`."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from services.autoscaler.config import AutoscalerConfig
from services.autoscaler.providers import InstanceProvider, ProviderError
from shared import subjects
from shared.engine_model.report_cadence import RECEIVER_WARM_UP_S
from shared.instance_table import InstanceTable
from shared.messages import (
    Ack,
    DrainOrder,
    DrainSource,
    InstanceRole,
    LoadReport,
    ScalingAction,
    ScalingEvent,
    decode,
    decode_load_report,
    encode,
)
from shared.nats_client import connect, request as nats_request
from shared.policy.scaling import ScaleAction, ScalingDecision, ScalingState, pool_scaling_decision, scaling_decision

log = logging.getLogger(__name__)

POOLS = (InstanceRole.PREFILL, InstanceRole.DECODE)


class Autoscaler:
    def __init__(self, config: AutoscalerConfig, provider: InstanceProvider) -> None:
        self.config = config
        self.provider = provider
        self.table = InstanceTable(config.instance_timeout_s)
        self.state = ScalingState()
        self.pool_states = {role: ScalingState() for role in POOLS}  # (with prefill/decode pools)
        self._roles: dict[str, InstanceRole] = {}  # the pool of each instance started here
        self.nc: Client | None = None
        self._starting: dict[str, float] = {}  # started, not yet reporting → start time
        self._draining: set[str] = set()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.nc = await connect(self.config.nats_url, "autoscaler")
        await self.nc.subscribe(subjects.LOAD_REPORTS_ALL, cb=self._on_report)
        # Instances the provider already has count (a Kubernetes Deployment's pods outlive us).
        if self.config.disaggregated:
            for role, count in zip(POOLS, (self.config.initial_prefill, self.config.initial_decode)):
                for _ in range(count - len(await asyncio.to_thread(self.provider.managed_in, role))):
                    await self._start_one(role)
        else:
            for _ in range(self.config.initial_instances - len(await asyncio.to_thread(self.provider.managed))):
                await self._start_one()
        self._task = asyncio.create_task(self._loop(), name="autoscaler-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self.provider.stop_all)
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.drain()

    async def _on_report(self, msg: Msg) -> None:
        report = decode_load_report(msg.data, log, msg.subject)
        if report is None:
            return
        self.table.update(report)
        self._starting.pop(report.instance_id, None)

    async def _start_one(self, role: InstanceRole | None = None) -> str:
        if role is None:
            instance_id = await asyncio.to_thread(self.provider.start_instance)  # may wait on an API server
        else:
            instance_id = await asyncio.to_thread(self.provider.start_instance, role)
            self._roles[instance_id] = role
        self._starting[instance_id] = time.monotonic()
        return instance_id

    async def _loop(self) -> None:
        # Not before every live instance has reported once (idle ones beat every 0.25 s): on the
        # empty table of its first moments it would start instances the fleet already has.
        await asyncio.sleep(max(0.0, RECEIVER_WARM_UP_S - self.config.tick_s))
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                await self.tick()
            except ProviderError as exc:  # e.g. the API server refused or was away: try again next tick
                log.error("instance provider: %s", exc)

    async def tick(self) -> None:
        await self._forget_failed_starts()
        await self._adopt_earlier_drains()
        await self._stop_drained()
        loads = [l for l in self.table.live() if l.instance_id not in self._draining]
        if not self.config.disaggregated:
            decision, self.state = scaling_decision(
                loads, self.state, self.config.scaling, time.monotonic(), pending=len(self._starting)
            )
            await self._act(decision, loads)
            return
        for role in POOLS:
            pending = sum(1 for instance_id in self._starting if self._roles.get(instance_id) is role)
            decision, self.pool_states[role] = pool_scaling_decision(
                role, loads, self.pool_states[role], self.config.scaling, self.config.prefill_band, time.monotonic(),
                pending=pending)
            await self._act(decision, [l for l in loads if l.role is role], role)

    async def _act(self, decision: ScalingDecision, loads: list[LoadReport], role: InstanceRole | None = None) -> None:
        if decision.action is ScaleAction.OUT:
            instance_id = await self._start_one(role)
            await self._event(ScalingAction.SCALE_OUT, instance_id, decision.average_freeness)
        elif decision.action is ScaleAction.IN:
            victim = self._managed_victim(loads, decision.victim, await asyncio.to_thread(self.provider.managed))
            if victim is not None:
                await self._drain(victim)
                await self._event(ScalingAction.DRAIN, victim, decision.average_freeness)

    def _managed_victim(self, loads: list[LoadReport], preferred: str | None, managed: set[str]) -> str | None:
        """The policy's victim if this provider can stop it, else the emptiest one it can."""
        if preferred in managed:
            return preferred
        candidates = [l for l in loads if l.instance_id in managed]
        if not candidates:
            return None
        return min(candidates, key=lambda l: (l.num_running + l.num_waiting, l.instance_id)).instance_id

    async def _drain(self, instance_id: str) -> None:
        try:
            order = DrainOrder(drain=True, by=DrainSource.AUTOSCALER)
            reply = await nats_request(self.nc, subjects.llumlet(instance_id, "drain"), encode(order), 2.0)
            decode(reply.data, Ack)
        except (NoRespondersError, TimeoutError) as exc:
            log.warning("drain order to %s not acknowledged (%s); stopping it when it stops reporting", instance_id, exc)
        self._draining.add(instance_id)

    async def _adopt_earlier_drains(self) -> None:
        """An instance that reports an autoscaler's drain this one did not order was drained by an
        autoscaler before a restart (the draining set lives in memory): finish the job, stop it once
        empty. Operator drains (a preStop, `corral drain`) are left alone: their pod is going anyway.
        Only instances the provider still manages: one already stopped (its last reports may linger
        a moment) is not stopped twice."""
        unknown = [l.instance_id for l in self.table.live()
                   if l.drained_by is DrainSource.AUTOSCALER and l.instance_id not in self._draining]
        if not unknown:
            return
        managed = await asyncio.to_thread(self.provider.managed)
        for instance_id in unknown:
            if instance_id in managed:
                log.info("instance %s was drained by an autoscaler before this one started: stopping it once empty",
                         instance_id)
                self._draining.add(instance_id)

    async def _stop_drained(self) -> None:
        for instance_id in list(self._draining):
            report = self.table.get(instance_id)
            gone = report is None
            empty = report is not None and report.draining and report.num_running == 0 and report.num_waiting == 0
            if gone or empty:
                self._draining.discard(instance_id)
                self._roles.pop(instance_id, None)
                self.table.remove(instance_id)
                await asyncio.to_thread(self.provider.stop_instance, instance_id)
                await self._event(ScalingAction.STOPPED, instance_id, None)

    async def _forget_failed_starts(self) -> None:
        now = time.monotonic()
        for instance_id, started in list(self._starting.items()):
            if now - started > self.config.start_timeout_s:
                log.error("instance %s never reported; giving up on it", instance_id)
                del self._starting[instance_id]
                self._roles.pop(instance_id, None)
                await asyncio.to_thread(self.provider.stop_instance, instance_id)

    async def _event(self, action: ScalingAction, instance_id: str, average: float | None) -> None:
        log.info("%s %s (average freeness %s)", action.value, instance_id, average)
        managed = await asyncio.to_thread(self.provider.managed)  # a Kubernetes provider asks its API server
        event = ScalingEvent(action, instance_id, len(managed), time.time(), average)
        await self.nc.publish(subjects.SCALING_EVENTS, encode(event))
