"""The narrow interface between a llumlet and its inference engine (vLLM or simulated).

The llumlet owns the loop: it calls `step()` while the engine has work, publishes each step's
outputs, and builds load reports from `request_views()`. Engines never talk to NATS.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shared.messages import FinishReason, GenerateRequest


class EngineError(Exception):
    """A request the engine cannot take (too long, bad sampling parameters, duplicate id)."""


class RequestPhase(enum.Enum):
    WAITING = "waiting"  # queued, never scheduled (or preempted and requeued: see num_preemptions)
    RUNNING = "running"


@dataclass(frozen=True)
class RequestView:
    """What load reports and migration selection need to know about one live request.

    `demand_blocks` is what a queued request needs to be (re)scheduled: the blocks of its whole
    current sequence (prompt + tokens generated before a preemption), plus one for the next token.
    """

    request_id: str
    priority: int
    phase: RequestPhase
    physical_blocks: int
    demand_blocks: int
    num_tokens: int
    num_preemptions: int = 0


@dataclass(frozen=True)
class StepOutput:
    """New tokens of one request from one step, indexed from the start of its output."""

    request_id: str
    start_index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_preemptions: int = 0


@runtime_checkable
class Engine(Protocol):
    kind: str  # "sim" or "vllm"
    model_name: str
    block_size: int
    num_blocks_total: int
    max_model_len: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request; raises EngineError if it can never run here."""

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it was not here."""

    def has_work(self) -> bool: ...

    async def step(self) -> list[StepOutput]:
        """Run one engine iteration (continuous batching) and return what it produced."""

    def num_free_blocks(self) -> int: ...

    def num_preemptions_total(self) -> int: ...

    def request_views(self) -> list[RequestView]:
        """Live requests: waiting ones first, in the order the local scheduler will take them."""
