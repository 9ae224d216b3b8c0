"""The dispatches (and P/D hand-offs) an instance's latest load report does not show yet.

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

A P/D hand-off is the same race one NATS round trip long: the scheduler accounts the decode
instance's blocks for it (`account_handoff`) when it answers, and a report built before the
hand-off's PRE-ALLOC landed wiped them, so hand-offs answered together could pile onto one decode
instance. They are counted off by the new migrations the instance has answered
(`num_migrations_asked_total`): once answered, a hand-off's blocks show in its reports (granted)
or never will (refused: then it is not accounted on past that, and a retry is asked afresh). A
migration in that is no hand-off counts one off too: that errs toward showing less, as every
report did before hand-offs were restored.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from shared.messages import DispatchRequest, LoadReport
from shared.policy.disaggregation import account_handoff
from shared.policy.dispatch import account_prompt

FORGET_AFTER_S = 2.0


class Arrival(Enum):
    """What the instance counts when a kind of dispatch arrives there."""

    ORDER = "num_accepted_total"  # a generate order accepted
    MIGRATION = "num_migrations_asked_total"  # a new migration answered, granted or refused

    def count(self, load: LoadReport) -> int:
        return getattr(load, self.value)


@dataclass(frozen=True)
class Sent:
    at: float  # monotonic
    seq: int  # the report it was accounted on (a report of that seq still carries the accounting)
    account: Callable[[LoadReport], LoadReport]  # accounts it on a load again


@dataclass
class _Unshown:
    """One instance's dispatches of one kind, oldest first, and its count of their arrivals."""

    sent: deque[Sent] = field(default_factory=deque)
    arrived: int | None = None  # the count when last looked at

    def missing(self, arrived: int, seq: int, horizon: float) -> list[Sent]:
        """What a report of `seq` whose count is `arrived` does not show (counting off, first,
        what the count says arrived; forgetting what was sent before `horizon`)."""
        last, self.arrived = self.arrived, arrived
        if not self.sent:
            return []
        if last is not None and arrived < last:  # it restarted: what it held is gone
            self.sent.clear()
            return []
        for _ in range(min(arrived - last, len(self.sent)) if last is not None else 0):
            self.sent.popleft()
        while self.sent and self.sent[0].at < horizon:
            self.sent.popleft()
        return [s for s in self.sent if s.seq < seq]


class UnreportedDispatches:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._unshown: dict[str, dict[Arrival, _Unshown]] = {}

    def dispatched(self, load: LoadReport, request: DispatchRequest, cached_tokens: int = 0) -> None:
        """`load`: the instance's load the dispatch is accounted on (`cached_tokens`: as there)."""
        tokens, priority = request.num_prompt_tokens, request.priority
        self._add(load, Arrival.ORDER, lambda report: account_prompt(report, tokens, priority, cached_tokens))

    def handed_off(self, load: LoadReport, num_blocks: int) -> None:
        """A P/D hand-off of `num_blocks` answered with the instance of `load`."""
        self._add(load, Arrival.MIGRATION, lambda report: account_handoff(report, num_blocks))

    def restore(self, report: LoadReport) -> LoadReport:
        """`report` with the dispatches to its instance it does not show accounted on it again.
        Only for a report its table takes (`InstanceTable.takes`): an older one, reordered, would
        count back with its counts of arrivals what was counted off."""
        horizon = self._clock() - FORGET_AFTER_S
        books = self._books(report.instance_id)
        for arrival in Arrival:
            for sent in books[arrival].missing(arrival.count(report), report.seq, horizon):
                report = sent.account(report)
        return report

    def forget(self, instance_id: str) -> None:
        """The instance left the table."""
        self._unshown.pop(instance_id, None)

    def _add(self, load: LoadReport, arrival: Arrival, account: Callable[[LoadReport], LoadReport]) -> None:
        self._books(load.instance_id)[arrival].sent.append(Sent(self._clock(), load.seq, account))

    def _books(self, instance_id: str) -> dict[Arrival, _Unshown]:
        books = self._unshown.get(instance_id)
        if books is None:
            books = self._unshown[instance_id] = {arrival: _Unshown() for arrival in Arrival}
        return books
