"""A migration's handover as its request sees it, in the simulator (issue 20): the moment the
source lets go and the destination takes over, by the llumlets' rules.

- The source's suspend waits for its step in flight when the request is in it, and the request
  keeps that step's token (as the live engines: `SimEngine.suspend`, vLLM's).
- The source's notice: as a live source, it suspends the request after `notice_steps` of its
  steps (the one in flight when the last stage is due, then the next ones), and tells the commit
  from the first of them, again at each step start, by the live estimate (`CommitNotifier`):
  the step's start plus the typical step (the steps before it), the typical step for each one
  left, and the last stage's copy. Nothing more once the request is suspended (a live source
  sends nothing after it); a request suspended at once (not in the step in flight, or a
  hand-off) is expected when its last stage will end.
- The destination's commit hold (`shared.policy.commit_hold`): a step about to start waits for a
  commit due within the rule's bound, and the commit's kick starts it with the request in it;
  for a commit whole steps off, where the source notices steps ahead, it waits its paced share
  (`paced_hold_s`), which the commit cuts short. As the live hold, a commit that is not in
  within the bound releases the step then, and is never held for again.
- The stall: from the request's last token on the source to its first on the destination, what
  the gateway's `corral:gateway_migration_stall_seconds` measures live.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loadgen.simulator.migration_state import is_decoding
from shared.engine_model.request import SimRequest
from shared.policy.commit_hold import CommitHoldRule

if TYPE_CHECKING:
    from loadgen.simulator.instance import SimInstance
    from loadgen.simulator.migration_state import Migration, MigrationStats


@dataclass
class _Countdown:
    """A last stage waiting for its source's steps: how many are left, and its copy's time."""

    migration: Migration
    steps_left: int
    last_stage_s: float


class Handovers:
    def __init__(self, hold: CommitHoldRule, stats: MigrationStats, notice_steps: int,
                 wake: Callable[[SimInstance, float], None]) -> None:
        assert notice_steps >= 1, notice_steps
        self.hold = hold
        self.stats = stats
        self.notice_steps = notice_steps
        self._wake = wake  # kick this instance at that time (a hold's bound)
        self._suspending: dict[str, list[_Countdown]] = {}  # source id -> last stages waiting for its steps
        self._committing: dict[str, list[Migration]] = {}  # destination id -> migrations in their last stage
        # destination id -> its hold: (when it started, when it ends at the latest, the ids it waits
        # for, paced)
        self._holds: dict[str, tuple[float, float, set[str], bool]] = {}
        self._stalled_since: dict[str, float] = {}  # request id -> its last token on the source (committed)
        self._held_s: dict[str, float] = {}  # migration id -> destination time held for it (its budget)

    @property
    def num_budgeted(self) -> int:
        """Migrations whose holds so far count against their budget (until they end)."""
        return len(self._held_s)

    # -- the source ------------------------------------------------------------------------------

    def suspend_waits(self, migration: Migration, request: SimRequest | None, last_stage_s: float,
                      now: float) -> bool:
        """Whether the last stage waits for the source's steps: the one in flight (the request is
        in it) and `notice_steps - 1` after it; `after_step` hands it back when the last ends.
        The commit is expected from now."""
        src = migration.src
        if src.step is None or not any(r is request for r in src.step.requests):
            return False
        countdown = _Countdown(migration, self.notice_steps, last_stage_s)
        self._suspending.setdefault(src.instance_id, []).append(countdown)
        self._expect_after(src, countdown, now)
        return True

    def step_started(self, src: SimInstance) -> None:
        """A step of this instance started: the notices of its waiting last stages again, as a
        live source's at each of its steps."""
        for countdown in self._suspending.get(src.instance_id, ()):
            self._expect_after(src, countdown, src.step_started_at)

    def _expect_after(self, src: SimInstance, countdown: _Countdown, now: float) -> None:
        """The live source's estimate (`CommitNotifier.notice`): the step in flight ends a typical
        step after its start (not when it will: the source cannot know), then a typical step for
        each one left, then the last stage."""
        typical = src.typical_step_s
        step_ends_at = max(now, src.step_started_at + typical)
        self.expect_commit(countdown.migration, step_ends_at + (countdown.steps_left - 1) * typical
                           + countdown.last_stage_s)

    def after_step(self, src: SimInstance) -> list[Migration]:
        """The last stages whose steps to wait for ended with this instance's step just now, and
        those whose request stopped decoding meanwhile (as a live source's check at each step:
        the caller aborts them)."""
        waiting = self._suspending.get(src.instance_id)
        if not waiting:
            return []
        for countdown in waiting:
            request = src.scheduler.get(countdown.migration.request_id)
            countdown.steps_left = 0 if request is None or not is_decoding(request) else countdown.steps_left - 1
        done = [c.migration for c in waiting if c.steps_left == 0]
        waiting[:] = [c for c in waiting if c.steps_left > 0]
        if not waiting:
            del self._suspending[src.instance_id]
        return done

    # -- the destination -------------------------------------------------------------------------

    def expect_commit(self, migration: Migration, due_at: float) -> None:
        """The migration's commit is due then (expected, or the last stage's end once it runs)."""
        migration.commit_due_at = due_at
        if not self.hold.enabled or self._spent(migration):
            return
        committing = self._committing.setdefault(migration.dst.instance_id, [])
        if migration not in committing:
            committing.append(migration)

    def holds_step(self, dst: SimInstance, now: float) -> bool:
        """Whether the destination's step about to start waits, as the live hold: one hold per
        step, for the commits due within its bound (by the typical step) when it begins, until
        they have all committed or the bound passes. A commit expected later (or noticed during
        the hold) joins the step after it; one not in by the bound is not held for again unless
        noticed again, and none holds more than its budget (`CommitHoldRule.budget_s`) in all: what
        its holds took, charged as each ends, to the migrations still waiting then."""
        committing = self._committing.get(dst.instance_id)
        if not committing:  # (every step start asks: most have nothing to wait for)
            self._holds.pop(dst.instance_id, None)
            return False
        hold = self._holds.get(dst.instance_id)
        if hold is not None:
            started, ends, due, paced = hold
            pending = [m for m in committing if m.migration_id in due]
            if pending and now < ends:
                return True
            del self._holds[dst.instance_id]
            # (one that committed meanwhile was forgotten, budget and all; one late past the bound,
            # or whose last step was held, is not held for again unless noticed again)
            for migration in pending:
                self._held_s[migration.migration_id] = self._held_s.get(migration.migration_id, 0.0) + now - started
                if not paced or self._spent(migration):
                    committing.remove(migration)
            return False  # the step goes now (no second hold before it)
        typical = dst.typical_step_s
        due = [m for m in committing if self.hold.holds_for(m.commit_due_at - now, typical)]
        paced = False
        if due:
            ends = now + self.hold.bound_s(typical)
            expected_s = max(m.commit_due_at for m in due) - now
        elif self.notice_steps > 1:  # the earliest commit whole steps off: its share (`CommitHold.paced`)
            earliest = min(committing, key=lambda m: m.commit_due_at)
            expected_s = self.hold.paced_hold_s(earliest.commit_due_at - now, typical)
            if expected_s <= 0:
                return False
            due, ends, paced = [earliest], now + expected_s, True
            self.stats.paced_holds += 1
        else:  # (a notice a step ahead asks for no pacing)
            return False
        self._holds[dst.instance_id] = (now, ends, {m.migration_id for m in due}, paced)
        self._wake(dst, ends)
        self.stats.holds += 1
        self.stats.held_s += expected_s
        self.stats.held_request_s += expected_s * len(dst.scheduler.running)
        return True

    # -- the request -----------------------------------------------------------------------------

    def committed(self, request: SimRequest) -> None:
        if request.last_token_time is not None:
            self._stalled_since[request.request_id] = request.last_token_time

    def new_tokens(self, requests: Iterable[SimRequest], now: float) -> None:
        """Tokens of a step that just ended: a committed request's first one ends its stall."""
        if self._stalled_since:
            for request in requests:
                last = self._stalled_since.pop(request.request_id, None)
                if last is not None:
                    self.stats.stall_s.append(now - last)

    def _spent(self, migration: Migration) -> bool:
        return self._held_s.get(migration.migration_id, 0.0) >= self.hold.budget_s(migration.dst.typical_step_s)

    def forget(self, migration: Migration) -> None:
        """The migration ended (committed or aborted): it waits for no step and holds none."""
        self._held_s.pop(migration.migration_id, None)
        src_id = migration.src.instance_id
        waiting = self._suspending.get(src_id)
        if waiting is not None:
            waiting[:] = [c for c in waiting if c.migration is not migration]
            if not waiting:
                del self._suspending[src_id]
        committing = self._committing.get(migration.dst.instance_id)
        if committing is not None and migration in committing:
            committing.remove(migration)
            if not committing:
                del self._committing[migration.dst.instance_id]
