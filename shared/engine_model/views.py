"""What an engine says about its requests: views for load reports and migration, step outputs,
and the error for a request it cannot take. Shared by both engines and the simulator."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.messages import FinishReason, Refusal, TokenLogprob


class EngineError(Exception):
    """A request the engine cannot take (too long, bad sampling parameters, duplicate id).

    `reason` says which, for code (the llumlet's Ack carries it to the gateway); the message says
    it for people."""

    def __init__(self, message: str, reason: Refusal = Refusal.INVALID) -> None:
        super().__init__(message)
        self.reason = reason


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
    num_output_tokens: int = 0  # generated so far (admission predicts the remaining output from it)


@dataclass(frozen=True)
class StepOutput:
    """New tokens of one request from one step, indexed from the start of its output."""

    request_id: str
    start_index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int | None = None  # of the prompt, found in the prefix cache (None: the engine keeps none)
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
