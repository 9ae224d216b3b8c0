"""Admission control in the simulator: builds each instance's `InstanceOutlook` and asks the
pure policy (`shared.policy.admission`) which instances may take an arriving request.

The queued prefill comes from the load report dispatch sees (`prefix_dispatch.queued_prefill_tokens`,
the function predicted-TTFT dispatch uses, equally stale, at admission's own weights: the plain
count, every queued block whole and no per-request term, as the live admission); the output
produced so far by each running request is read from the instance's scheduler (live, from the
load report's `running_output_tokens`). Each instance's output-length estimate (a histogram of served output
lengths; live, the one the load reports carry) learns from the requests it finishes, its step
inflation (step time over decode-only time, an exponential average over its decoding steps) from
the steps it runs. With P/D roles the decode pool comes from the decode instances and the
prefill instances' reports (`shared.policy.decode_pool`), as the live scheduler builds it; the
chunked-prefill budget a step is the engines' `max_num_batched_tokens`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.engine_model.latency import LatencyModel
from shared.engine_model.request import SimRequest
from shared.messages import InstanceRole, LoadReport
from shared.policy.admission import (
    AdmissionDecision,
    AdmissionPolicy,
    InstanceOutlook,
    LatencyFns,
    OutputLengthEstimate,
    SloConfig,
    admit,
)
from shared.policy.decode_pool import DecodePool, decode_loads, in_flight_of, prefill_loads
from shared.policy.prefix_dispatch import queued_prefill_tokens


INFLATION_WEIGHT = 0.02  # per step: the average spans the last ~50 steps (a few seconds)


@dataclass(frozen=True)
class AdmissionModel:
    policy: AdmissionPolicy
    slo: SloConfig
    prior_output_len: float = 256.0  # the output-length estimate before an instance served any


class SimAdmission:
    def __init__(self, model: AdmissionModel, latency: LatencyModel, instances: dict) -> None:
        self.model = model
        self._instances = instances  # instance id -> SimInstance (the cluster's own dict)
        self._outputs: dict[str, OutputLengthEstimate] = {}
        self._inflation: dict[str, float] = {}
        self._model = latency
        self._latency = LatencyFns(
            prefill_s=lambda n: latency.prefill_ms(n) / 1e3 if n > 0 else 0.0,
            decode_s=lambda bs, ctx: latency.decode_ms(bs, ctx) / 1e3,
        )

    def estimate(self, instance_id: str) -> OutputLengthEstimate:
        est = self._outputs.get(instance_id)
        if est is None:
            est = self._outputs[instance_id] = OutputLengthEstimate(prior_mean=self.model.prior_output_len)
        return est

    def observe_finished(self, instance_id: str, requests: Sequence[SimRequest]) -> None:
        est = self.estimate(instance_id)
        for request in requests:
            est.observe(request.num_output_tokens)

    def observe_step(self, instance_id: str, step) -> None:
        """After each engine step (a `SchedulerOutput`): its time over its decode-only time. An
        instance left with nothing to run forgets it, as a live llumlet does (`ServedTally.went_idle`)."""
        if step.decode_batch_size:
            decode = self._model.decode_ms(step.decode_batch_size, step.decode_context_tokens) / 1e3
            ratio = self._model.step_time_of(step) / decode
            old = self._inflation.get(instance_id, 1.0)
            self._inflation[instance_id] = old + INFLATION_WEIGHT * (ratio - old)
        scheduler = self._instances[instance_id].scheduler
        if not scheduler.running and not scheduler.waiting:
            self._inflation.pop(instance_id, None)

    def decide(self, loads: Sequence[LoadReport], prompt_tokens: int, priority: int,
               fleet: Sequence[LoadReport] = (), cached_tokens: Mapping[str, int] | None = None) -> AdmissionDecision:
        """`loads`: the instances the request may be dispatched to; `fleet`: every serving one (with
        P/D roles, the decode pool a prefilled request moves to is among them); `cached_tokens`:
        the prompt's tokens each instance's prefix cache holds."""
        outlooks = [self._outlook(load) for load in loads if not load.draining]
        decode = decode_loads(fleet)
        pool = None
        if decode:
            prefill = prefill_loads(fleet)
            last = max((self._latency.prefill_s(queued_prefill_tokens(load)) for load in prefill), default=0.0)
            pool = DecodePool([self._outlook(load) for load in decode], *in_flight_of(prefill), last)
        return admit(outlooks, prompt_tokens, priority, self.model.policy, self.model.slo, self._latency, pool,
                     cached_tokens)

    def _outlook(self, load: LoadReport) -> InstanceOutlook:
        scheduler = self._instances[load.instance_id].scheduler
        running = scheduler.running
        generated = [r.num_output_tokens for r in running]
        context = sum(r.num_tokens for r in running) / len(running) if running else 0.0
        free = load.num_blocks_free - load.waiting_demand_blocks - load.committed_blocks - load.reserved_blocks
        return InstanceOutlook(load.instance_id, queued_prefill_tokens(load), load.num_waiting, generated, context,
                               self.estimate(load.instance_id), free, load.block_size,
                               self._inflation.get(load.instance_id, 1.0), load.num_blocks_total,
                               hands_off=load.role is InstanceRole.PREFILL,
                               prefill_tokens_per_step=scheduler.config.max_num_batched_tokens)
