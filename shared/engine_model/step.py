"""One scheduler step: its plan (what runs, with the aggregates the latency model reads) and what
it produced."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine_model.request import SimRequest


@dataclass(slots=True, eq=False)
class SchedulerOutput:
    """One step's plan: parallel lists of scheduled requests and their new token counts, plus
    the aggregates the latency model needs."""

    requests: list[SimRequest] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    prefill_tokens: int = 0
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (tokens, context before)
    decode_batch_size: int = 0
    decode_context_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def record(self, request: SimRequest, num_new: int, computed: int) -> None:
        """Schedule `num_new` tokens of `request` after its `computed` ones."""
        self.requests.append(request)
        self.num_new_tokens.append(num_new)
        self.num_scheduled_tokens += num_new
        if num_new == 1 and computed >= request.prompt_len:
            self.decode_batch_size += 1
            self.decode_context_tokens += computed + 1
        else:
            self.prefill_tokens += num_new
            self.prefill_chunks.append((num_new, computed))

    def unrecord(self, request: SimRequest) -> None:
        """Take back the last `record` of `request` (it was preempted later in the same step)."""
        k = len(self.requests) - 1 - self.requests[::-1].index(request)
        num_new = self.num_new_tokens[k]
        computed = request.num_computed_tokens
        del self.requests[k], self.num_new_tokens[k]
        self.num_scheduled_tokens -= num_new
        if num_new == 1 and computed >= request.prompt_len:
            self.decode_batch_size -= 1
            self.decode_context_tokens -= computed + 1
        else:
            self.prefill_tokens -= num_new
            self.prefill_chunks.remove((num_new, computed))


@dataclass(slots=True)
class StepEvents:
    """What a step produced: each request in `new_token` sampled exactly one token (its index is
    `num_output_tokens - 1`); `finished` ones are done and hold no blocks any more."""

    new_token: list[SimRequest]
    finished: list[SimRequest]
