"""Helpers for the sim scheduler's tests (test_sim_scheduler*.py): a scheduler with overrides, requests,
one step, and running until idle."""

from __future__ import annotations

from shared.engine_model.request import SimRequest
from shared.engine_model.config import SchedulerConfig
from shared.engine_model.scheduler import SimScheduler
from shared.engine_model.step import SchedulerOutput


def make(**overrides) -> SimScheduler:
    config = dict(num_blocks=64, block_size=4, max_model_len=256, max_num_batched_tokens=100, max_num_seqs=16)
    config.update(overrides)
    return SimScheduler(SchedulerConfig(**config))


def req(
    rid: str, prompt: int, output: int, *, priority: int = 0, arrival: float = 0.0, target: int | None = None
) -> SimRequest:
    return SimRequest(rid, prompt, output, target_output_len=target, priority=priority, arrival_time=arrival)


def step(s: SimScheduler, now: float = 0.0) -> tuple[SchedulerOutput, list[str], list[str]]:
    out = s.schedule(now)
    events = s.update_from_output(out, now + 0.01)
    s.check_invariants()
    return out, [r.request_id for r in events.new_token], [r.request_id for r in events.finished]


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_new_tokens)}


def run_until_idle(s: SimScheduler, max_steps: int = 10_000) -> dict[str, int]:
    """Steps until no work is left; returns the number of tokens each request produced."""
    produced: dict[str, int] = {}
    for i in range(max_steps):
        if not s.has_work():
            return produced
        _, new, _ = step(s, now=i * 0.01)
        for rid in new:
            produced[rid] = produced.get(rid, 0) + 1
    raise AssertionError("scheduler did not drain")
