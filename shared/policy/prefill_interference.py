"""What admitting a prompt does to the requests already decoding on an instance (issue 19 §1,
`predicted` admission): its prefill runs in their steps.

A colocated instance mixes prefill chunks into its decode steps (chunked prefill, at most
`prefill_tokens_per_step` prompt tokens a step), so every prompt it admits lengthens the steps
of the requests decoding there. The TBT target is per request (the mean time per output token
after the first): on a prefill-heavy workload the requests that miss it are short ones that met a
long prefill or two in their few steps, not a batch too large. The measured step inflation sees
those prefills only after they ran (`current-load` admits on it).

A running request that has produced g tokens and has r left has a mean TBT of
    (g steps at the instance's measured pace + r decode steps + X) / (g + r - 1),
X the prefill time that lands in its r steps: what is queued ahead (prefilled first), then the
new prompt. That is past the target t exactly when r is below
    r*(X) = (g · pace + X - t · (g - 1)) / (t - decode step),
and r is unknown: the instance's output-length estimate gives P(r < x | g) = 1 - S(g + x) / S(g).
The new prompt reaches it only if its r steps carry the queue ahead (r ≥ queue / tokens a step).
So admitting pushes it past the target with probability P(max(r*(queue), queue / per step) ≤ r <
r*(queue + prompt)); the sum over the running requests is the expected misses the admission
causes (a request already past the target without it is lost either way and not counted).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.policy.admission import InstanceOutlook, LatencyFns


def expected_pushed_past_tbt(outlook: InstanceOutlook, prompt_tokens: int, latency: LatencyFns,
                             target_s: float) -> float:
    """Expected number of running requests that admitting `prompt_tokens` here pushes from
    within `target_s` (their mean TBT) to past it."""
    running = len(outlook.running_generated)
    if not running or prompt_tokens <= 0:
        return 0.0
    step_s = latency.decode_s(running, int(running * outlook.context_tokens_per_request))
    if step_s >= target_s:  # every step is past the target already: nothing left to push
        return 0.0
    paced_s = step_s * outlook.step_inflation
    queued = outlook.queued_prefill_tokens
    without_s, with_s = latency.prefill_s(queued), latency.prefill_s(queued + prompt_tokens)
    reach = queued / max(outlook.prefill_tokens_per_step, 1)  # steps before the new prompt's prefill starts
    pushed = 0.0
    for generated in outlook.running_generated:
        spent = generated * paced_s - target_s * (generated - 1)
        lo = max((spent + without_s) / (target_s - step_s), reach, 0.0)
        hi = (spent + with_s) / (target_s - step_s)
        if hi > lo:  # P(lo <= r < hi) = S(g + lo) / S(g) - S(g + hi) / S(g)
            pushed += outlook.output.still_running(generated, lo) - outlook.output.still_running(generated, hi)
    return pushed if math.isfinite(pushed) else float(running)
