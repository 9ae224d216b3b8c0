"""What a llumlet's load reports tell admission control (issue 19 §1) about the work it serves:
the generate orders it accepted (which of the scheduler's dispatches a report shows), the
requests it finished with their output tokens, in total and per output-length bin (the
scheduler's output-length estimate for this instance), and the pace of its recent decoding
steps — step time, the number of requests each decoded and their context tokens, exponential
averages — from which the scheduler derives the step inflation (measured step time over its
latency model's decode-only time for that batch).

Fed from the engine loop after each step, from the step's outputs alone (no request views: too
costly every step).
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.engine_model.views import StepOutput
from shared.messages import FinishReason
from shared.policy.admission import NUM_OUTPUT_BINS, output_length_bin

STEP_WEIGHT = 0.02  # per decoding step: the averages span the last ~50 steps (as the simulator's)
SERVED = (FinishReason.STOP, FinishReason.LENGTH)  # an abort or error says nothing of output lengths


class ServedTally:
    def __init__(self) -> None:
        self.num_accepted = 0
        self.num_finished = 0
        self.finished_output_tokens = 0
        self.output_histogram = [0] * NUM_OUTPUT_BINS  # finished requests per output-length bin
        self.step_time_s = 0.0  # 0 until a step decoded something
        self.decode_batch = 0.0
        self.decode_context = 0.0  # tokens of context over the requests a step decoded

    def accepted(self) -> None:
        """A generate order is in the engine (in the same turn: no report shows one without the other)."""
        self.num_accepted += 1

    def step_done(self, started: float, ended: float, outputs: Iterable[StepOutput]) -> None:
        decoded = context = 0
        for output in outputs:
            if output.start_index > 0 and output.token_ids:  # (start_index 0: its prefill ended here)
                decoded += 1
                context += output.num_prompt_tokens + output.start_index
            if output.finish_reason in SERVED:
                self.num_finished += 1
                # (start_index counts from its start, migrations included; a resumed one from its resume)
                served = output.start_index + len(output.token_ids)
                self.finished_output_tokens += served
                self.output_histogram[output_length_bin(served)] += 1
        if decoded:
            self._average(max(0.0, ended - started), decoded, context)

    def went_idle(self) -> None:
        """Nothing left to run: the pace described a batch that is gone (its prefills mixed in),
        and kept, it would price the next request's empty batch by it. With no step to update it,
        a pace slowed by a burst's prefills would refuse every later request on TBT for good (the
        benchmark `admission_live` found 0 admitted after a first burst). The first decoding step
        after this sets it again."""
        self.step_time_s = self.decode_batch = self.decode_context = 0.0

    def _average(self, step_s: float, batch: int, context: int) -> None:
        if self.decode_batch == 0.0:  # the first decoding step sets the averages
            self.step_time_s, self.decode_batch, self.decode_context = step_s, float(batch), float(context)
            return
        self.step_time_s += STEP_WEIGHT * (step_s - self.step_time_s)
        self.decode_batch += STEP_WEIGHT * (batch - self.decode_batch)
        self.decode_context += STEP_WEIGHT * (context - self.decode_context)
