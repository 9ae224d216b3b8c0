"""Turn dataset requests into the concrete requests a run sends: prompt, length, time, priority."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadgen.arrivals import arrival_times, priority_flags
from loadgen.errors import LoadgenError
from loadgen.records import RequestSpec
from loadgen.synth import PromptSynthesizer

HIGH_PRIORITY = -1  # vLLM convention: lower runs earlier
NORMAL_PRIORITY = 0


@dataclass(frozen=True)
class ScheduledRequest:
    index: int
    arrival_s: float
    prompt: str | list[int]  # token ids only when sent as such to /v1/completions
    input_len: int  # tokenizer count of the prompt (or the dataset's count when no tokenizer)
    max_tokens: int
    priority: int | None  # None: the field is not sent


@dataclass(frozen=True)
class SchedulePlan:
    """How to schedule: arrival process, priorities and the max_tokens policy."""

    arrival: str = "burst"  # see loadgen.arrivals.ARRIVAL_KINDS
    rate: float = math.inf
    cv: float = 1.0
    time_scale: float = 1.0
    seed: int = 0
    priority_fraction: float | None = None
    max_tokens: int | None = None  # None: the dataset's output length ("trace" policy)
    default_output_len: int = 256  # "trace" policy on a dataset without output lengths
    send_token_ids: bool = False


def max_tokens_for(spec: RequestSpec, plan: SchedulePlan) -> int:
    if plan.max_tokens is not None:
        return plan.max_tokens
    return spec.output_len if spec.output_len else plan.default_output_len


def build_schedule(
    specs: Sequence[RequestSpec],
    plan: SchedulePlan,
    synthesizer: PromptSynthesizer | None,
    on_prompt: Callable[[], None] | None = None,
) -> list[ScheduledRequest]:
    """One ScheduledRequest per dataset request, in send order; `on_prompt` after each prompt."""
    n = len(specs)
    try:
        times = arrival_times(
            plan.arrival,
            n,
            plan.rate,
            plan.cv,
            plan.seed,
            trace_timestamps=[s.timestamp_s for s in specs],
            time_scale=plan.time_scale,
            match_total_duration=True,
        )
        high = priority_flags(n, plan.priority_fraction or 0.0, plan.seed)
    except ValueError as exc:
        raise LoadgenError(str(exc)) from None
    scheduled = []
    for index, (spec, arrival_s, is_high) in enumerate(zip(specs, times, high)):
        prompt, input_len = _prompt(spec, index, synthesizer, plan.send_token_ids)
        priority = None
        if plan.priority_fraction is not None:
            priority = HIGH_PRIORITY if is_high else NORMAL_PRIORITY
        scheduled.append(
            ScheduledRequest(index, arrival_s, prompt, input_len, max_tokens_for(spec, plan), priority)
        )
        if on_prompt is not None:
            on_prompt()
    return scheduled


def _prompt(
    spec: RequestSpec, index: int, synthesizer: PromptSynthesizer | None, as_ids: bool
) -> tuple[str | list[int], int]:
    if synthesizer is None:
        if spec.prompt is None:
            raise LoadgenError(
                "this dataset has lengths but no text: pass --tokenizer DIR (a local Hugging Face "
                "tokenizer directory) to synthesize prompts of the exact length"
            )
        return spec.prompt, spec.input_len
    text, count = synthesizer.prompt_for(spec, index)
    if as_ids:
        ids = synthesizer.tokenizer.encode(text, add_special_tokens=False)
        return ids, len(ids)
    return text, count
