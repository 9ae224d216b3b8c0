"""A source whose destination refused a migration starts none to it for a while, as a llumlet
(`MigrationLimits.refused_backoff_s`, one default: `shared.policy.migration.REFUSED_BACKOFF_S`)."""

from __future__ import annotations

from dataclasses import replace

import loadgen.simulator.migration as migration_module
from shared.policy.migration import REFUSED_BACKOFF_S
from tests.simulator.helpers import SMALL, simulate, synthetic


def test_a_refused_pair_is_tried_again_only_after_the_back_off(monkeypatch):
    # was: every pairing round (0.1 s) and every commit tried the refusing destination again
    refusals = [0]

    def refusing(**kwargs) -> bool:
        refusals[0] += 1
        return False  # (every destination busy: nothing ever moves)

    monkeypatch.setattr(migration_module, "may_migrate_into", refusing)
    workload = synthetic("synthetic:L-L", 60, rate=20.0, seed=1)

    def tries(backoff_s: float) -> int:
        refusals[0] = 0
        config = replace(SMALL, migration=replace(SMALL.migration, refused_backoff_s=backoff_s))
        result = simulate(config, "corral", workload)
        assert result.migrations.started == 0 and len(result.finished) == 60
        return refusals[0]

    assert SMALL.migration.refused_backoff_s == REFUSED_BACKOFF_S
    with_back_off, without = tries(REFUSED_BACKOFF_S), tries(0.0)
    assert 0 < with_back_off < without / 3


def test_blocks_past_the_first_grant_pass_the_destinations_guard_on_its_state_now():
    """As a live destination's top-up (`leases._guard_more`): a queue there, or too few blocks
    left free, refuses them (the simulator used to check only that the blocks exist)."""
    from types import SimpleNamespace

    from loadgen.simulator.migration import Migrator
    from shared.policy.migration import DEFAULT_GUARD

    def destination(free: int, waiting: int) -> SimpleNamespace:
        scheduler = SimpleNamespace(block_manager=SimpleNamespace(num_free=free),
                                    config=SimpleNamespace(num_blocks=1000), waiting=[object()] * waiting,
                                    committed_blocks=lambda: 0)
        return SimpleNamespace(scheduler=scheduler)

    migrator = Migrator.__new__(Migrator)
    migrator.guard = DEFAULT_GUARD
    assert migrator._may_take_more(destination(free=800, waiting=0), 3)
    assert not migrator._may_take_more(destination(free=800, waiting=1), 3)  # a queue there
    assert not migrator._may_take_more(destination(free=100, waiting=0), 50)  # under 10 % left
    migrator.guard = None
    assert migrator._may_take_more(destination(free=800, waiting=1), 3)  # (no guard: the bands alone)


def test_a_destination_refuses_a_new_migration_at_its_limit_or_by_its_state_not_by_its_report(monkeypatch):
    """As a live destination's first grant (`IncomingMigrations._refuse_new`): draining, at its
    limit of migrations in, or failing the guard on its state then refuses, and the source backs
    off (was: a destination at its limit was skipped without a back-off, and the guard read the
    report the pairing went by)."""
    from types import SimpleNamespace

    from loadgen.simulator.instance import InstanceState
    from loadgen.simulator.migration import Migrator
    from shared.policy.migration import DEFAULT_GUARD

    migrator = Migrator.__new__(Migrator)
    migrator.guard, migrator.model = DEFAULT_GUARD, SMALL.migration

    def destination(state=InstanceState.LIVE, migrations_in=0, free=800, waiting=0) -> SimpleNamespace:
        scheduler = SimpleNamespace(block_manager=SimpleNamespace(num_free=free),
                                    config=SimpleNamespace(num_blocks=1000), waiting=[object()] * waiting,
                                    committed_blocks=lambda: 0)
        return SimpleNamespace(state=state, migrations_in=migrations_in, scheduler=scheduler)

    assert migrator.destination_grants(destination(), 10)
    assert not migrator.destination_grants(destination(state=InstanceState.DRAINING), 10)
    assert not migrator.destination_grants(destination(migrations_in=SMALL.migration.max_in), 10)
    assert not migrator.destination_grants(destination(waiting=1), 10)  # a queue there now
    assert not migrator.destination_grants(destination(free=100), 50)  # under 10 % left now

    at_limit = [0]
    refused_by = Migrator.refused_by

    def recording(self, src, dst):
        at_limit[0] += dst.migrations_in >= self.model.max_in
        refused_by(self, src, dst)

    monkeypatch.setattr(Migrator, "refused_by", recording)
    # (slow copies: a round pairs a source with a destination whose last migration in still runs)
    config = replace(SMALL, migration=replace(SMALL.migration, max_in=1, bandwidth_gbps=0.1))
    result = simulate(config, "corral", synthetic("synthetic:L-L", 200, rate=12.0, seed=0))
    assert result.migrations.committed > 0 and len(result.finished) == 200
    assert at_limit[0] > 0
