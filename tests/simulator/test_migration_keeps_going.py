"""While its pair stands, a simulated source keeps migrating as a llumlet's loop does
(`MigrationCoordinator.run`): the next migration starts as a slot frees, after a commit or an
abort, and with nothing it may start it looks again every `idle_poll_s` (one default:
`shared.policy.migration.IDLE_POLL_S`), not only at the next pairing round."""

from __future__ import annotations

from collections import defaultdict

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
