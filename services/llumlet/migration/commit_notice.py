"""The source's side of the destination's step hold (`commit_hold.py`): when to tell the
destination that a commit is imminent, and how soon it will land.

Where the destination's grants say it holds, the last stage starts right after one of this
instance's steps started: the source tells the destination (`CommitNotice`) that the commit is due
once that step ends and the last stage is through, about a step ahead, and the suspend follows.
The last stage's time is learned from the small last stages this source committed lately.
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

LAST_STAGE_GUESS_S = 0.002  # suspend → commit landed, before this source has timed one
SMALL_LAST_STAGE_BLOCKS = 2  # a last stage this small is timed as the fixed part of the next ones


class CommitNotifier:
    def __init__(self, ops: MigratableEngine, link: DestinationLink, steps: StepClock | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ops = ops
        self.link = link
        self.steps = steps  # this instance's engine steps (None: no commit notices)
        self._clock = clock
        # Suspend → commit landed of recent small last stages (a live one's usual 1-2 blocks).
        self._last_stages: collections.deque[float] = collections.deque(maxlen=8)

    async def notice(self, m: OutgoingMigration) -> bool:
        """Wait for the next step of ours to start (the request keeps decoding meanwhile), then
        tell the destination the commit is due when that step ends and the last stage is through;
        the caller suspends at once, so the notice comes about a step ahead. False: no notice (the
        destination does not hold, or the commit's time cannot be told)."""
        if self.steps is None or m.dst_hold_max_s <= 0:
            return False
        typical = self.steps.typical_s
        await self.steps.next_start(timeout_s=max(0.5, 4 * typical))  # (none: the notice is just shorter)
        last_stage = self.last_stage_estimate(m)
        if last_stage is None:
            return False
        m.notice_commit_in_s = self.steps.left_s() + last_stage
        m.noticed_at = self._clock()
        await self.link.notice(m.dst, CommitNotice(m.migration_id, m.notice_commit_in_s))
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
