"""How long a migration's destination holds its next engine step for a commit due any moment
(issue 20): one rule for the llumlet's `CommitHold` and the simulator's model of it.

A request that commits while the destination's step is in flight joins only the step after it.
Holding the step for a commit due x seconds into it moves that wait: the migrating request's
stall shrinks by (step - x), and each other request of the destination's batch waits x longer.
Holding only while x <= `step_share` of the typical step (half by default) bounds the extra
wait either side at half a step; a hold of a whole step (or none) leaves someone a whole one.

That alone catches a commit only when it happens to fall early in a step: about half of them,
since the two engines' steps run at independent phases. So a source may notice a few steps ahead
(`--migration-notice-steps`; why not by default: `DEFAULT_NOTICE_STEPS`), and the destination
paces: each of its steps before the commit waits an equal share of the phase gap
(`paced_hold_s`), so that its last step before the commit starts as the commit lands, and the
migrating request joins it. The other requests there pay
the whole phase gap (up to a step in all, where one hold took at most half a step and only for
the commits it caught), in two or three holds of at most half a step each: their worst gap at
a handover is what it was (a step and a half), their total wait longer.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOLD_STEP_SHARE = 0.5
# A source tells the destination its commit is coming this many of its own steps ahead, the
# step in flight the first (1: in that step, as it suspends after it; the destination then holds
# or not, and never paces). Three lets the destination's first
# step start after the notice be one or two whole steps before the commit, so every commit is
# paced, each hold at most half a step: the migrating request's stall met one step + 2 ms on the
# simulated engine (benchmarks/migration_sim.py, 2026-12-02: +1.2-2.5 ms at the median, P90 within
# two steps, against +0.4-9.0 and 5.8-17.4 ms a step ahead). But each step ahead is a step later
# the commit lands, and the source holds the request's blocks that much longer: across simulated
# fleets (benchmarks/prefix_dispatch.py) three steps ahead cost a target on each GPU, and P99 TTFT
# 1.03-1.04x over 8 seeds on A10s, as much without any pacing and with the source's migration slot
# freed meanwhile (2026-12-02); the others' held time rose 3.6x (benchmarks/commit_hold_sim.py).
# So one by default; `--migration-notice-steps 3` where a request's stall matters more.
DEFAULT_NOTICE_STEPS = 1
TYPICAL_STEP_WINDOW = 16  # an engine's typical step: the median of its last this many
# How long one migration may hold a destination's steps in all, paced and due, in its typical
# steps: an honest source's holds add up to the phase gap and one due hold (three steps ahead,
# across simulated fleets: P99 1.5 steps, at most 2.5; benchmarks/commit_hold_sim.py,
# 2026-12-03), so one past this repeats its notice without committing (a bug, or a hostile peer
# holding every step): its notices are not believed until it ends.
HOLD_BUDGET_STEPS = 4.0


@dataclass(frozen=True)
class CommitHoldRule:
    hold_max_s: float = 0.0  # the longest hold in seconds, whatever the steps (0: never hold)
    step_share: float = DEFAULT_HOLD_STEP_SHARE  # and at most this share of the typical step

    def __post_init__(self) -> None:
        if self.hold_max_s < 0:
            raise ValueError("hold_max_s must be >= 0 (0: never hold a step for a commit)")
        if not 0 < self.step_share <= 1:
            raise ValueError("step_share must be in (0, 1]")

    @property
    def enabled(self) -> bool:
        return self.hold_max_s > 0

    def budget_s(self, typical_step_s: float) -> float:
        """The most one migration may hold in all (`HOLD_BUDGET_STEPS` steps; the hold's own
        bound stands for a step until one is known)."""
        return HOLD_BUDGET_STEPS * (typical_step_s if typical_step_s > 0 else self.hold_max_s)

    def bound_s(self, typical_step_s: float) -> float:
        """The longest hold before a step: `hold_max_s`, and `step_share` of the typical step once
        one is known (0: none yet)."""
        return self.hold_max_s if typical_step_s <= 0 else min(self.hold_max_s, self.step_share * typical_step_s)

    def holds_for(self, commit_in_s: float, typical_step_s: float) -> bool:
        """Whether a step about to start waits for a commit due in `commit_in_s` (a later one
        joins the step after, as early as a hold could bring it)."""
        return self.enabled and commit_in_s <= self.bound_s(typical_step_s)

    def paced_hold_s(self, commit_in_s: float, typical_step_s: float) -> float:
        """For a commit due a whole step or more after a step about to start: how long that step
        waits so that, with the steps between paced alike, the last step before the commit
        starts as it lands (then `holds_for` takes it into that step). With k whole steps before
        the commit and r seconds left over, each of the k + 1 starts waits r / (k + 1), within
        the bound (with k >= 1 and the default half-step share, always). 0: nothing to pace (a
        commit due within this step, or no typical step yet)."""
        step = typical_step_s
        if not self.enabled or step <= 0 or commit_in_s < step:
            return 0.0
        whole = int(commit_in_s // step)
        left_over = commit_in_s - whole * step
        return min(left_over / (whole + 1), self.bound_s(step))


# On by default: measured on the simulated engine (benchmarks/migration_sim.py, A10 steps of
# 35-43 ms), half a step's hold cut the migrated request's stall by 17-22 ms at the median and
# 13-18 ms at P90, and the worst gap the destination's other requests saw across a handover rose
# by 15-18 ms: the worst gap anyone sees at a handover fell from about two steps to one and a
# half. The 50 ms cap bounds it on slow steps (a long prefill chunk makes a long typical step).
DEFAULT_HOLD = CommitHoldRule(hold_max_s=0.05)
