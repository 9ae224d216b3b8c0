"""While its pair stands, a simulated source keeps migrating as a llumlet's loop does
(`MigrationCoordinator.run`): the next migration starts as a slot frees, after a commit or an
abort, and with nothing it may start it looks again every `idle_poll_s` (one default:
`shared.policy.migration.IDLE_POLL_S`), not only at the next pairing round."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.migration import Migrator
from services.llumlet.migration.protocol import MigrationLimits
from shared.policy.baselines import get_policy
from shared.policy.migration import IDLE_POLL_S
from tests.simulator.helpers import SMALL, synthetic


def test_the_idle_poll_is_one_default_for_the_llumlets_and_the_simulator():
    assert SMALL.migration.idle_poll_s == MigrationLimits().idle_poll_s == IDLE_POLL_S


@pytest.mark.parametrize("seed", [0, 1])
def test_a_source_starts_its_next_migration_when_a_slot_frees_or_at_a_poll_while_its_pair_stands(monkeypatch,
                                                                                                  seed):
    # was: only at the pairing rounds (every 0.1 s) and after a commit whose fresh loads still
    # showed the gap, which no live component checks
    rounds: list[float] = []
    ends: dict[str, list[float]] = defaultdict(list)  # source -> when its migrations ended
    starts: list[tuple[str, str, float]] = []  # (source, destination, when)
    on_round, finish, start = Migrator.on_round, Migrator._finish, Migrator.start

    def recording_round(self, payload):
        rounds.append(self.sim.now)
        on_round(self, payload)

    def recording_finish(self, migration):
        ends[migration.src.instance_id].append(self.sim.now)
        finish(self, migration)

    def recording_start(self, src, dst, request_id, *, handoff=False):
        assert handoff or self.pairs.get(src.instance_id) == dst.instance_id  # only while its pair stands
        starts.append((src.instance_id, dst.instance_id, self.sim.now))
        return start(self, src, dst, request_id, handoff=handoff)

    monkeypatch.setattr(Migrator, "on_round", recording_round)
    monkeypatch.setattr(Migrator, "_finish", recording_finish)
    monkeypatch.setattr(Migrator, "start", recording_start)
    work = synthetic("synthetic:L-L", 200, rate=12.0, seed=seed)
    result = ClusterSimulator(SMALL, get_policy("corral"), work).run()
    assert result.migrations.committed > 0 and len(result.finished) == 200

    at_round, at_end, at_poll = 0, 0, 0
    round_times = set(rounds)
    for src, _, t in starts:
        if t in round_times:
            at_round += 1
        elif t in ends[src]:
            at_end += 1
        else:
            at_poll += 1
            # a poll comes a whole number of idle polls after a round or one of this source's ends
            polls = [(t - o) / SMALL.migration.idle_poll_s for o in rounds + ends[src] if o < t]
            assert any(abs(n - round(n)) < 1e-6 for n in polls), t
    assert at_round > 0 and at_end > 0 and at_poll > 0, (at_round, at_end, at_poll)


def test_every_free_slot_is_filled_or_looked_at_again_and_the_loop_follows_the_current_pair(monkeypatch):
    """With `max_out` 2: after the loop runs (a round, an end, a poll), a source whose pair stands
    either has every slot taken or looks again soon, for the destination it is paired with now
    (was: one start per call, and an end looked only at that migration's destination)."""
    keep, checked = Migrator._keep_migrating, [0]

    def checking(self, src, dst):
        keep(self, src, dst)
        if not self.sim.done and self.pairs.get(src.instance_id) == dst.instance_id:
            checked[0] += 1
            assert src.migrations_out >= self.model.max_out or self._polling.get(src.instance_id) == dst.instance_id

    ends = [0]
    freed = Migrator._slot_freed

    def ended(self, src):
        ends[0] += 1
        freed(self, src)
        dst_id = self.pairs.get(src.instance_id)
        if dst_id is not None and not self.sim.done:
            assert src.migrations_out >= self.model.max_out or self._polling.get(src.instance_id) == dst_id

    monkeypatch.setattr(Migrator, "_keep_migrating", checking)
    monkeypatch.setattr(Migrator, "_slot_freed", ended)
    config = replace(SMALL, migration=replace(SMALL.migration, max_out=2))
    result = ClusterSimulator(config, get_policy("corral"), synthetic("synthetic:L-L", 200, rate=12.0, seed=0)).run()
    assert result.migrations.committed > 0 and checked[0] > 0 and ends[0] > 0


def test_a_llumlet_reports_at_once_when_a_migration_starts_takes_blocks_or_ends(monkeypatch):
    """As its hooks' `changed` (the source's begin and end, the destination's grants and end):
    the scheduler's table sees a migration's slots and blocks then, not up to a report interval
    later (was: the simulator's reports kept the old counts, and the P/D choice passed over a
    destination at its limit after its migration had ended)."""
    finish, seen = Migrator._finish, [0]

    def checking(self, migration):
        finish(self, migration)
        for instance in (migration.src, migration.dst):
            assert instance.report_at == self.sim.now
            assert instance.report.num_migrating_in == instance.migrations_in
        seen[0] += 1

    monkeypatch.setattr(Migrator, "_finish", checking)
    result = ClusterSimulator(SMALL, get_policy("corral"), synthetic("synthetic:L-L", 200, rate=12.0, seed=1)).run()
    assert result.migrations.committed > 0 and seen[0] >= result.migrations.committed
