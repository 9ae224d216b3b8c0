"""The dispatches an instance's latest load report does not show yet (admission control, issue 19 §1).

After a dispatch the scheduler counts the request into the instance's load (`account_dispatch`)
until the next report replaces that load. But a report built before the request's generate order
reached the instance (the gateway sends it after the reply; in a burst, tens of ms later) lands
after the dispatch and wipes it: admission then saw room that was taken, and an instance took a
prompt more than fits (measured live: one request of a burst waited a second for memory).

An instance reports how many generate orders it has accepted (`num_accepted_total`); each one
more counts off the oldest dispatch sent to it (orders arrive about in dispatch order). A dispatch
not yet counted off is missing from every report after the one it was accounted on. Dispatches
that never arrive (refused there, the client gone, another gateway's or scheduler's order counted
in their place) are forgotten after `FORGET_AFTER_S`: until then the instance looks busier than it
is, the safe side for admission.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine_model.block_manager import blocks_for_tokens
from shared.messages import DispatchRequest, LoadReport

FORGET_AFTER_S = 2.0


@dataclass(frozen=True)
class Sent:
    at: float  # monotonic
    seq: int  # the report it was accounted on (a report of that seq still carries the accounting)
    prompt_tokens: int
    blocks: int


@dataclass(frozen=True)
class Unreported:
    num: int = 0
    prompt_tokens: int = 0
    blocks: int = 0


class UnreportedDispatches:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sent: dict[str, deque[Sent]] = {}
        self._accepted: dict[str, int] = {}  # each instance's num_accepted_total when last looked at

    def dispatched(self, load: LoadReport, request: DispatchRequest) -> None:
        """`load`: the instance's load the dispatch is accounted on."""
        blocks = blocks_for_tokens(request.num_prompt_tokens + 1, load.block_size)
        sent = self._sent.setdefault(load.instance_id, deque())
        sent.append(Sent(self._clock(), load.seq, request.num_prompt_tokens, blocks))

    def missing_from(self, load: LoadReport) -> Unreported:
        """What was dispatched to the instance that `load` does not show."""
        iid = load.instance_id
        last = self._accepted.get(iid)
        self._accepted[iid] = load.num_accepted_total
        sent = self._sent.get(iid)
        if not sent:
            return Unreported()
        if last is not None and load.num_accepted_total < last:  # it restarted: what it held is gone
            sent.clear()
            return Unreported()
        for _ in range(min(load.num_accepted_total - last, len(sent)) if last is not None else 0):
            sent.popleft()
        horizon = self._clock() - FORGET_AFTER_S
        while sent and sent[0].at < horizon:
            sent.popleft()
        missing = [s for s in sent if s.seq < load.seq]
        return Unreported(len(missing), sum(s.prompt_tokens for s in missing), sum(s.blocks for s in missing))
