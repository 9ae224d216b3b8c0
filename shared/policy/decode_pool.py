"""Admission with prefill/decode roles (issue 19 §1 on §2's pools): a request admitted to a
prefill instance decodes on the decode pool, so its TBT (and whether it finds room there at all)
is the decode pool's *when its prefill completes*, not the prefill instance's batch.

Mooncake's case: the prefill instances' queues make that moment late, and the requests queued
or prefilling there now all reach the decode pool before it. Rejecting on the decode pool as it
is now (`current-load`) admits until the pool is full, then refuses while the prefilled requests
it admitted land (prefill and decode load in anti-phase); those that find no room decode on
their prefill instance (degraded to mixed), slowing its prefills. `predicted` forecasts the
pool at the request's hand-off instead:
- the decode instances' running requests expected to be still running then (each instance's
  output-length survival over the decode steps that fit, at its measured pace: the same
  estimate as colocated admission), with the KV they will hold (grown by those steps); "then"
  is its hand-off or, when later, the time the last request now on its way is prefilled (the
  longest prefill queue's prefill time), so that departures are counted over the same span as
  the arrivals below (over its hand-off only: 0.8 % less goodput over 18 P/D benchmark runs);
- plus every request on a prefill instance now (waiting, prefilling, or prefilled and waiting
  for its hand-off), with the KV of its prompt: they land before it or while it decodes, and it
  needs its room for all of its decode, not at one instant (counting only those prefilled by its
  hand-off, and their survival to it, was tried: it admitted more into a pool that then had no
  room, about 2 % less goodput over the same 18 runs);
- plus itself.
The hand-off spreads requests to the freest decode instance, so the pool's batch is shared
evenly; a step of that batch (at the pool's measured step inflation) must meet the TBT target
when the pool's KV blocks (less normal priority's reserve) hold what will be there; when they do
not, the request would decode on its prefill instance, and that instance's own prediction
decides (`admission._on_decode_pool`). `current-load` runs the same check on the pool as it is
now, plus the request.

Pure functions: the scheduler builds the pool from load reports, the simulator from its engines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.messages import InstanceRole, LoadReport

if TYPE_CHECKING:
    from shared.policy.admission import InstanceOutlook, LatencyFns


@dataclass(frozen=True)
class DecodePool:
    """The decode instances a prefilled request is handed to, and the requests on their way."""

    instances: Sequence[InstanceOutlook]  # each live decode instance
    in_flight: int = 0  # requests on prefill instances (waiting, prefilling, awaiting hand-off)
    in_flight_blocks: int = 0  # the KV blocks they bring (their prompts)
    last_landing_s: float = 0.0  # when the last of them is prefilled (the longest prefill queue)


@dataclass(frozen=True)
class DecodeForecast:
    batch: int  # requests per decode instance when the request joins (the pool's, spread evenly)
    tbt_s: float  # a step of that batch (inf: the pool will not have room for it)
    blocks: int  # KV blocks the pool will hold then, the request's included
    capacity_blocks: int  # what it may hold (normal priority leaves its reserve free)


# A request on a prefill instance this many tokens in is decoding there for good (its hand-off
# was asked about HANDOFF_ATTEMPTS times, 50 ms apart, and found no room): not on its way.
HANDOFF_WINDOW_TOKENS = 8


def in_flight_of(prefill_loads: Sequence[LoadReport]) -> tuple[int, int]:
    """Requests on the prefill instances still to hand off to the decode pool, and their KV
    blocks: waiting prompts (their demand) and running requests not past the hand-off window
    (their share of the running blocks; one that degraded to mixed stays where it is)."""
    num, blocks = 0, 0.0
    for load in prefill_loads:
        listed = load.running_output_tokens[: load.num_running]
        unlisted = load.num_running - len(listed)  # past the report's cap: taken as on their way
        running = unlisted + sum(1 for g in listed if g <= HANDOFF_WINDOW_TOKENS)
        running_blocks = sum(level.running_blocks for level in load.by_priority)
        num += running + load.num_waiting
        blocks += load.waiting_demand_blocks + (running_blocks * running / load.num_running if load.num_running else 0)
    return num, math.ceil(blocks - 1e-9)


def decode_loads(loads: Sequence[LoadReport]) -> list[LoadReport]:
    """The live decode instances of a fleet, empty unless it has a live prefill instance (without
    one, decode instances take new requests as mixed ones: `disaggregation.dispatch_pool`)."""
    if not any(l.role is InstanceRole.PREFILL and not l.draining for l in loads):
        return []
    return [l for l in loads if l.role is InstanceRole.DECODE and not l.draining]


def prefill_loads(loads: Sequence[LoadReport]) -> list[LoadReport]:
    return [l for l in loads if l.role is InstanceRole.PREFILL and not l.draining]


def forecast(pool: DecodePool, ready_s: float, prompt_tokens: int, predicted: bool, latency: LatencyFns,
             reserve_share: float = 0.0) -> DecodeForecast:
    """The decode pool when a request with `prompt_tokens` lands there `ready_s` from now (or
    when the last request on its way lands, if later: `predicted`), or as it is now (current
    load)."""
    survivors = 0.0
    held_blocks = 0.0
    context = 0.0  # tokens of context the pool's batch will hold
    inflation = 0.0
    capacity = 0
    for outlook in pool.instances:
        running = len(outlook.running_generated)
        used = max(outlook.total_blocks - outlook.free_blocks_after_queue, 0)
        capacity += outlook.total_blocks
        inflation += outlook.step_inflation
        if not running:
            held_blocks += used  # its queue's claims (hand-offs landing)
            continue
        if predicted and math.isfinite(ready_s):
            step_s = latency.decode_s(running, int(running * outlook.context_tokens_per_request))
            paced_s = step_s * outlook.step_inflation
            steps = max(ready_s, pool.last_landing_s) / paced_s if paced_s > 0 else 0.0
            stay = sum(outlook.output.still_running(g, steps) for g in outlook.running_generated)
            # Those still running hold what they hold now and grow a token a step.
            held_blocks += used * stay / running + stay * steps / outlook.block_size
            context += stay * (outlook.context_tokens_per_request + steps)
        else:
            stay = running
            held_blocks += used
            context += running * outlook.context_tokens_per_request
        survivors += stay
    n = len(pool.instances)
    block_size = pool.instances[0].block_size if n else 16
    own_blocks = -(-(prompt_tokens + 1) // block_size)
    arriving = (pool.in_flight + 1) if predicted else 1
    arriving_blocks = (pool.in_flight_blocks if predicted else 0) + own_blocks
    blocks = math.ceil(held_blocks + arriving_blocks - 1e-9)
    limit = int(capacity * (1.0 - reserve_share))
    if not n:
        return DecodeForecast(0, math.inf, blocks, 0)
    batch = math.ceil((survivors + arriving) / n - 1e-9)
    context += arriving_blocks * block_size
    mean_context = context / (survivors + arriving)
    tbt = latency.decode_s(batch, int(batch * mean_context)) * (inflation / n)
    return DecodeForecast(batch, tbt if blocks <= limit else math.inf, blocks, limit)
