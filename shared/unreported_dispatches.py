"""The dispatches an instance's latest load report does not show yet.

After a dispatch the scheduler counts the request into the instance's load (`account_dispatch`)
until the next report replaces that load. But a report built before the request's generate order
reached the instance (the gateway sends it after the reply; in a burst, tens of ms later) lands
after the dispatch and wipes it. Admission then saw room that was taken, and an instance took a
prompt more than fits (measured live: one request of a burst waited a second for memory); dispatch
saw a queue emptier than it was, and a burst leaned onto whichever instance each wiping report
made look best (live, `corral-prefix`: the holder of a cached system prompt took 10-15 of a
24-request burst, 8-11 once reports were restored). So every report is `restore`d before a table
takes it (the scheduler's; the gateway's, for its own dispatch while the scheduler is away): the
dispatches it does not show are accounted on it again, as when they were sent.

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

from shared.messages import DispatchRequest, LoadReport
from shared.policy.dispatch import account_prompt

FORGET_AFTER_S = 2.0


@dataclass(frozen=True)
class Sent:
    at: float  # monotonic
    seq: int  # the report it was accounted on (a report of that seq still carries the accounting)
    prompt_tokens: int
    priority: int


class UnreportedDispatches:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sent: dict[str, deque[Sent]] = {}
        self._accepted: dict[str, int] = {}  # each instance's num_accepted_total when last looked at

    def dispatched(self, load: LoadReport, request: DispatchRequest) -> None:
        """`load`: the instance's load the dispatch is accounted on."""
        sent = self._sent.setdefault(load.instance_id, deque())
        sent.append(Sent(self._clock(), load.seq, request.num_prompt_tokens, request.priority))

    def restore(self, report: LoadReport) -> LoadReport:
        """`report` with the dispatches to its instance it does not show accounted on it again.
        Only for a report its table takes (`InstanceTable.takes`): an older one, reordered, would
        count back with its count of accepted orders what was counted off."""
        for sent in self._missing(report):
            report = account_prompt(report, sent.prompt_tokens, sent.priority)
        return report

    def forget(self, instance_id: str) -> None:
        """The instance left the table."""
        for books in (self._sent, self._accepted):
            books.pop(instance_id, None)

    def _missing(self, load: LoadReport) -> list[Sent]:
        """What was dispatched to the instance that `load` does not show (counting off, first,
        what its accepted orders show arrived)."""
        iid = load.instance_id
        last = self._accepted.get(iid)
        self._accepted[iid] = load.num_accepted_total
        sent = self._sent.get(iid)
        if not sent:
            return []
        if last is not None and load.num_accepted_total < last:  # it restarted: what it held is gone
            sent.clear()
            return []
        for _ in range(min(load.num_accepted_total - last, len(sent)) if last is not None else 0):
            sent.popleft()
        horizon = self._clock() - FORGET_AFTER_S
        while sent and sent[0].at < horizon:
            sent.popleft()
        return [s for s in sent if s.seq < load.seq]
