"""Holding the destination's next engine step for a commit due any moment (issue 20).

A request that commits while the destination's step is in flight can only join the step after
it: up to a whole step more on the client's stall (half a step on average). So the source tells
the destination ahead (`CommitNotice`: "the commit lands in about X s", sent as it asks to
suspend the request after its own step in flight: the notice leads by what is left of that
step and the last stage), and the destination's engine loop, before it starts a step, waits
for a commit due before that step would end, at most `hold_max_s`; the commit (or its abort)
wakes it at once and the request is in that step. The price is the hold itself: the
destination's other requests wait for it (their token gap grows by the hold), which is why it
is bounded and taken only when the commit is due within one of this engine's steps. A commit
that never comes (aborted migration, source dead) releases the hold at its bound, and its
notice is dropped; a later notice of it (a source noticing steps ahead notices at each) may
hold again, but no migration holds more than its budget in all (`CommitHoldRule.budget_s`, a
few steps): past it, its notices are ignored until it ends.

The bound is also a share of this engine's typical step (`shared.policy.commit_hold`, the rule
the simulator models too). A notice that comes steps ahead (the source's `notice_steps`) paces
the steps before the commit: each waits its share of the phase gap, a fixed time that the
commit, landing early, cuts short; the source's notice at each of its steps corrects the time.

`StepClock` is the engine loop's steps as both sides see them (a source times its notice by
its own steps, a destination bounds its hold by its own).
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from collections.abc import Callable

from shared.cancellation import wait_set
from shared.policy.commit_hold import DEFAULT_HOLD_STEP_SHARE, TYPICAL_STEP_WINDOW, CommitHoldRule


class StepClock:
    """When the step in flight started, how long steps take lately, and a wait for the next
    start. Fed by the engine loop (`started`, `ended`), in that order, one step at a time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started_at: float | None = None  # of the step in flight; None between steps
        self.last_ended_at: float | None = None
        self._recent: collections.deque[float] = collections.deque(maxlen=TYPICAL_STEP_WINDOW)
        self._start = asyncio.Event()

    def started(self, now: float) -> None:
        assert self.started_at is None, "a step started while another was in flight"
        self.started_at = now
        self._start.set()  # (the waiters woken hold the old event; new ones wait for the next start)
        self._start = asyncio.Event()

    def ended(self, now: float) -> None:
        assert self.started_at is not None, "a step ended that never started"
        self._recent.append(now - self.started_at)
        self.started_at, self.last_ended_at = None, now

    @property
    def typical_s(self) -> float:
        """The median of the recent steps (0 before the first)."""
        return statistics.median(self._recent) if self._recent else 0.0

    def left_s(self) -> float:
        """Until the step in flight should end, by the typical step (0: none in flight)."""
        if self.started_at is None:
            return 0.0
        return max(0.0, self.started_at + self.typical_s - self._clock())

    async def next_start(self, timeout_s: float) -> bool:
        """Wait for the next step to start (False: none within `timeout_s`, e.g. an idle engine)."""
        return await wait_set(self._start, timeout_s)


class CommitHold:
    """The destination's side: notices of imminent commits, and the wait before a step."""

    def __init__(self, hold_max_s: float, steps: StepClock, clock: Callable[[], float] = time.monotonic,
                 step_share: float = DEFAULT_HOLD_STEP_SHARE) -> None:
        self.rule = CommitHoldRule(hold_max_s, step_share)  # (it checks both)
        self.steps = steps
        self._clock = clock
        # migration id → (when its commit should land, whether its source asked for pacing: it
        # notices steps ahead)
        self._expected: dict[str, tuple[float, bool]] = {}
        self._held_s: dict[str, float] = {}  # migration id → seconds held for it (until it settles)
        # What a held step awaits: resolved by a settle or the bound's timer. (A bare future, not
        # `wait_for` on an event: that wakes the loop's task one turn later, behind the commit's
        # own follow-up work.)
        self._waiter: asyncio.Future[None] | None = None
        self.last_held_s = 0.0  # the hold before the latest step (0: none)
        self.num_holds = self.num_paced_holds = self.num_released_at_bound = 0

    @property
    def hold_max_s(self) -> float:
        return self.rule.hold_max_s

    @property
    def enabled(self) -> bool:
        return self.rule.enabled

    @property
    def num_expected(self) -> int:
        return len(self._expected)

    @property
    def num_budgeted(self) -> int:
        """Migrations whose holds so far count against their budget (until they settle)."""
        return len(self._held_s)

    def expect(self, migration_id: str, commit_in_s: float, paced: bool = False) -> bool:
        """A source's notice: the migration's commit should land in `commit_in_s` (`paced`: the
        source notices steps ahead, and the steps before the commit may be paced for it). False:
        not taken (holds off, or the migration spent its budget)."""
        if not self.enabled or self._spent(migration_id):
            return False
        self._expected[migration_id] = (self._clock() + commit_in_s, paced)
        return True

    def settle(self, migration_id: str) -> None:
        """The migration committed (its request is in the engine now) or ended: a hold waiting
        for it goes on at once. (A migration noticed or not: the call is harmless either way.)"""
        self._held_s.pop(migration_id, None)
        if self._expected.pop(migration_id, None) is not None:
            _wake(self._waiter)

    def bound_s(self) -> float:
        """The longest hold now (`CommitHoldRule.bound_s` by this engine's typical step)."""
        return self.rule.bound_s(self.steps.typical_s)

    def due(self, now: float) -> list[str]:
        """The migrations whose commit should land within the bound of a step started now: worth
        holding that step for (a later one joins the step after, as early)."""
        typical = self.steps.typical_s
        return [mid for mid, (at, _) in self._expected.items() if self.rule.holds_for(at - now, typical)]

    def paced(self, now: float) -> tuple[str, float] | None:
        """With none due: the earliest expected commit whose source asked for pacing, and how long
        a step started now waits to line the steps before it up with it
        (`CommitHoldRule.paced_hold_s`); None: no pacing."""
        paced = [(at, mid) for mid, (at, pace) in self._expected.items() if pace]
        if not paced:
            return None
        at, mid = min(paced)
        hold_s = self.rule.paced_hold_s(at - now, self.steps.typical_s)
        return (mid, hold_s) if hold_s > 0 else None

    async def wait(self) -> float:
        """Before a step: hold it for the commits due (`due`), until they all settle or for
        `bound_s()` at most; else pace it for a commit a few steps off (`paced`), for its share
        or until that commit settles. The seconds held (0: the step goes at once)."""
        self.last_held_s = 0.0
        if not self._expected:
            return 0.0
        started = self._clock()
        for mid in [mid for mid, (at, _) in self._expected.items() if at + self.hold_max_s < started]:
            del self._expected[mid]  # overdue by more than a hold: the source is late or gone
        due = self.due(started)
        paced = None if due else self.paced(started)
        if not due and paced is None:
            return 0.0
        self.num_holds += 1
        if paced is None:
            deadline = started + self.bound_s()
        else:  # (the commit stays expected after it: it is due steps later)
            self.num_paced_holds += 1
            due, deadline = [paced[0]], started + paced[1]
        loop = asyncio.get_running_loop()
        while any(mid in self._expected for mid in due):
            remaining = deadline - self._clock()
            if remaining <= 0:
                break
            assert self._waiter is None, "two steps held at once"
            waiter = self._waiter = loop.create_future()  # (no await since the check above: no settle missed)
            timer = loop.call_later(remaining, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        late = [] if paced is not None else [mid for mid in due if mid in self._expected]
        for mid in late:  # a commit that did not come within the bound: not held for again, unless noticed again
            del self._expected[mid]
        self.num_released_at_bound += bool(late)
        self.last_held_s = self._clock() - started
        for mid in due:
            if mid not in self._expected and mid not in late:
                continue  # it settled during the hold: its budget went with it (`settle`)
            self._held_s[mid] = self._held_s.get(mid, 0.0) + self.last_held_s
            if self._spent(mid):
                self._expected.pop(mid, None)
        return self.last_held_s

    def _spent(self, migration_id: str) -> bool:
        return self._held_s.get(migration_id, 0.0) >= self.rule.budget_s(self.steps.typical_s)


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
