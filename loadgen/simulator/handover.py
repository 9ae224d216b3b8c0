"""A migration's handover as its request sees it, in the simulator (issue 20): the moment the
source lets go and the destination takes over, by the llumlets' rules.

- The source's suspend waits for its step in flight when the request is in it, and the request
  keeps that step's token (as the live engines: `SimEngine.suspend`, vLLM's).
- The destination's commit hold (`shared.policy.commit_hold`): a step about to start waits for a
  commit due within the rule's bound, and the commit's kick starts it with the request in it.
  As a live source's notice, the commit is expected from the moment the last stage waits for the
  source's step (its end plus the last stage's copy), and exactly once the request is suspended.
  As the live hold, a commit that is not in within the bound releases the step then, and is
  never held for again.
- The stall: from the request's last token on the source to its first on the destination, what
  the gateway's `corral:gateway_migration_stall_seconds` measures live.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from shared.engine_model.request import SimRequest
from shared.policy.commit_hold import CommitHoldRule

if TYPE_CHECKING:
    from loadgen.simulator.instance import SimInstance
    from loadgen.simulator.migration_state import Migration, MigrationStats


class Handovers:
    def __init__(self, hold: CommitHoldRule, stats: MigrationStats,
                 wake: Callable[[SimInstance, float], None]) -> None:
        self.hold = hold
        self.stats = stats
        self._wake = wake  # kick this instance at that time (a hold's bound)
        self._suspending: dict[str, list[Migration]] = {}  # source id -> last stages waiting for its step
        self._committing: dict[str, list[Migration]] = {}  # destination id -> migrations in their last stage
        self._holds: dict[str, tuple[float, set[str]]] = {}  # destination id -> (its hold's bound, ids due)
        self._stalled_since: dict[str, float] = {}  # request id -> its last token on the source (committed)

    # -- the source ------------------------------------------------------------------------------

    def suspend_waits(self, migration: Migration, request: SimRequest | None, last_stage_s: float) -> bool:
        """Whether the last stage waits for the source's step in flight (the request is in it);
        `after_step` hands it back when that step ends. The commit is expected from now."""
        src = migration.src
        if src.step is None or not any(r is request for r in src.step.requests):
            return False
        self._suspending.setdefault(src.instance_id, []).append(migration)
        self.expect_commit(migration, src.step_ends_at + last_stage_s)
        return True

    def after_step(self, src: SimInstance) -> list[Migration]:
        """The last stages that waited for this instance's step, which has just ended."""
        return self._suspending.pop(src.instance_id, [])

    # -- the destination -------------------------------------------------------------------------

    def expect_commit(self, migration: Migration, due_at: float) -> None:
        """The migration's commit is due then (expected, or the last stage's end once it runs)."""
        migration.commit_due_at = due_at
        if not self.hold.enabled:
            return
        committing = self._committing.setdefault(migration.dst.instance_id, [])
        if migration not in committing:
            committing.append(migration)

    def holds_step(self, dst: SimInstance, now: float) -> bool:
        """Whether the destination's step about to start waits, as the live hold: one hold per
        step, for the commits due within its bound (by the typical step) when it begins, until
        they have all committed or the bound passes. A commit expected later (or noticed during
        the hold) joins the step after it; one not in by the bound is never held for again."""
        committing = self._committing.get(dst.instance_id)
        if not committing:  # (every step start asks: most have nothing to wait for)
            self._holds.pop(dst.instance_id, None)
            return False
        hold = self._holds.get(dst.instance_id)
        if hold is not None:
            ends, due = hold
            pending = [m for m in committing if m.migration_id in due]
            if pending and now < ends:
                return True
            del self._holds[dst.instance_id]
            for migration in pending:  # late past the bound: never held for again
                committing.remove(migration)
            return False  # the step goes now (no second hold before it)
        due = [m for m in committing if self.hold.holds_for(m.commit_due_at - now, dst.typical_step_s)]
        if not due:
            return False
        ends = now + self.hold.bound_s(dst.typical_step_s)
        self._holds[dst.instance_id] = (ends, {m.migration_id for m in due})
        self._wake(dst, ends)
        expected_s = max(m.commit_due_at for m in due) - now
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

    def forget(self, migration: Migration) -> None:
        """The migration ended (committed or aborted): it waits for no step and holds none."""
        for waiting, instance_id in ((self._suspending, migration.src.instance_id),
                                     (self._committing, migration.dst.instance_id)):
            migrations = waiting.get(instance_id)
            if migrations is not None and migration in migrations:
                migrations.remove(migration)
                if not migrations:
                    del waiting[instance_id]
