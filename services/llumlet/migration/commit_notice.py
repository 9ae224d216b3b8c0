"""The source's side of the destination's step hold (`commit_hold.py`): when to tell the
destination that a commit is imminent, and how soon it will land.

Where the destination's grants say it holds, the source tells the destination (`CommitNotice`)
when the commit is due `notice_steps` of its own steps ahead (the step in flight the first), at
the start of each next one again with the time corrected, and asks for the suspend at the start
of the last: the commit lands once that step ends and the last stage is through. Steps ahead,
the destination paces its own steps to meet it (`shared.policy.commit_hold`); the request decodes
here meanwhile. The last stage's time is learned from the small last stages this source
committed lately.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

from services.llumlet.migration.commit_hold import StepClock
from services.llumlet.migration.handshake import DestinationLink
from services.llumlet.migration.ops import MigratableEngine
from services.llumlet.migration.outgoing import OutgoingMigration
from shared.messages import CommitNotice
from shared.policy.commit_hold import DEFAULT_NOTICE_STEPS

LAST_STAGE_GUESS_S = 0.002  # suspend → commit landed, before this source has timed one
SMALL_LAST_STAGE_BLOCKS = 2  # a last stage this small is timed as the fixed part of the next ones


class CommitNotifier:
    def __init__(self, ops: MigratableEngine, link: DestinationLink, steps: StepClock | None,
                 clock: Callable[[], float] = time.monotonic, notice_steps: int = DEFAULT_NOTICE_STEPS) -> None:
        assert notice_steps >= 1, notice_steps
        self.ops = ops
        self.link = link
        self.steps = steps  # this instance's engine steps (None: no commit notices)
        self._clock = clock
        self.notice_steps = notice_steps
        # Suspend → commit landed of recent small last stages (a live one's usual 1-2 blocks).
        self._last_stages: collections.deque[float] = collections.deque(maxlen=8)

    async def notice(self, m: OutgoingMigration, check: Callable[[], object]) -> bool:
        """At each of our next `notice_steps` steps (the request keeps decoding meanwhile; the
        step in flight is the first), tell the destination the commit is due when the last of
        them ends and the last stage is through; the caller suspends at once after, so the last
        notice leads by what is left of its step and the last stage. `check` raises when
        the request can no longer move (it finished meanwhile). False: no notice (the destination
        does not hold, or the commit's time cannot be told)."""
        if self.steps is None or m.dst_hold_max_s <= 0:
            return False
        for steps_left in range(self.notice_steps, 0, -1):
            # The step in flight counts as the first (as the simulator counts it): the suspend
            # waits for it either way, so the notice's lead is what is left of it plus the steps
            # after it. Between steps, the next start is the first.
            first_in_flight = steps_left == self.notice_steps and self.steps.started_at is not None
            if not first_in_flight:
                typical = self.steps.typical_s
                await self.steps.next_start(timeout_s=max(0.5, 4 * typical))  # (none: the notice is just shorter)
            check()
            last_stage = self.last_stage_estimate(m)
            if last_stage is None:
                return False
            m.notice_commit_in_s = self.steps.left_s() + (steps_left - 1) * self.steps.typical_s + last_stage
            m.noticed_at = self._clock()
            await self.link.notice(m.dst, CommitNotice(m.migration_id, m.notice_commit_in_s,
                                                       paced=self.notice_steps > 1))
        return True

    def last_stage_estimate(self, m: OutgoingMigration) -> float | None:
        """Suspend → commit: what small last stages took lately, plus the blocks beyond those at
        this migration's rate so far; None when there is no rate to go by (a blocking copy sends
        everything after the suspend: no notice). An estimate late by more than the destination's
        step loses the hold; early, the hold waits longer (at most its bound)."""
        fixed = statistics.median(self._last_stages) if self._last_stages else LAST_STAGE_GUESS_S
        snapshot = self.ops.migration_snapshot(m.request_id)
        extra = 0 if snapshot is None else max(0, snapshot.num_blocks - m.blocks_sent - SMALL_LAST_STAGE_BLOCKS)
        sent = [s for s in m.stages if s.num_blocks]
        if not extra:
            return fixed
        if not sent:
            return None
        seconds_per_block = sum(s.seconds for s in sent) / sum(s.num_blocks for s in sent)
        return fixed + extra * seconds_per_block

    def committed(self, m: OutgoingMigration, now: float) -> None:
        """A noticed migration committed: a small last stage is the fixed part the next notices
        predict (the commit lands about mid-round-trip)."""
        if m.noticed_at is not None and m.stages and m.stages[-1].num_blocks <= SMALL_LAST_STAGE_BLOCKS:
            self._last_stages.append(m.commit_sent_at - m.suspended_at + (now - m.commit_sent_at) / 2)
