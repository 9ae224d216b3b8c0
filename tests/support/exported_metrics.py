"""Every Corral registry with something in it, rendered: what a scrape of a busy cluster shows."""

from __future__ import annotations

import time

from services.gateway.metrics import GatewayMetrics, RequestTimeline
from services.global_scheduler.config import SchedulerConfig
from services.global_scheduler.service import GlobalScheduler
from services.llumlet.metrics import LlumletMetrics
from shared.engine_model.views import RequestPhase, RequestView, StepOutput
from shared.messages import DispatchRequest, FinishReason
from shared.metrics_server import render
from tests.unit.policy_helpers import make_load


def gateway_with_one_request() -> GatewayMetrics:
    metrics = GatewayMetrics("tiny", 2048)
    metrics.watch_instances(lambda: ["llumlet-0"])
    metrics.request_done("/v1/chat/completions", 200)
    metrics.first_token("llumlet-1", 0.2)
    for _ in range(4):
        metrics.next_tokens("llumlet-1", 0.1)
    metrics.request_finished(RequestTimeline(
        engine="llumlet-1", arrival=10.0, ended=11.0, num_prompt_tokens=30, num_output_tokens=5,
        max_tokens_param=16, finished_reason="length", first_token_at=10.2, last_token_at=10.6, num_cached_tokens=16))
    metrics.choices_finished(1, [("llumlet-1", 5)])
    return metrics


def llumlet_after_one_request() -> LlumletMetrics:
    """Arrived at 100.0, scheduled by the step of 100.5 (a prefill chunk), first token at 100.9."""
    metrics = LlumletMetrics("tiny", "llumlet-0")
    metrics.request_arrived("r1", 100.0)
    running = RequestView("r1", 0, RequestPhase.RUNNING, 2, 2, 30)
    metrics.step_done(100.5, 100.6, [], [running])
    metrics.step_done(100.6, 100.9, [StepOutput("r1", 0, [7], num_prompt_tokens=30)], [running])
    metrics.step_done(100.9, 101.0, [StepOutput("r1", 1, [8], FinishReason.LENGTH, num_prompt_tokens=30,
                                                num_preemptions=1)])
    return metrics


def scheduler_after_dispatching() -> GlobalScheduler:
    scheduler = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222"))
    for load in (make_load("llumlet-0", running={0: (2, 40)}), make_load("llumlet-1", running={0: (5, 90)})):
        load.sent_at = time.time()
        scheduler.table.update(load)
    scheduler.decide(DispatchRequest("r0", 16, 16, 0, []))
    scheduler.decide(DispatchRequest("long", 10**6, 16, 0, []))  # refused
    scheduler.metrics.order_sent(cancel=False)
    return scheduler


def exposition_texts() -> list[str]:
    """The gateway's, a llumlet's and the scheduler's /metrics bodies."""
    return [gateway_with_one_request().render().decode(), render(llumlet_after_one_request().registry).decode(),
            render(scheduler_after_dispatching().metrics.registry).decode()]
