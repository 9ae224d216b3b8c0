"""A source whose destination refused a migration starts none to it for a while, as a llumlet
(`MigrationLimits.refused_backoff_s`, one default: `shared.policy.migration.REFUSED_BACKOFF_S`)."""

from __future__ import annotations

from dataclasses import replace

import loadgen.simulator.migration as migration_module
from shared.policy.migration import REFUSED_BACKOFF_S
from tests.simulator.helpers import SMALL, simulate, synthetic


def test_a_refused_pair_is_tried_again_only_after_the_back_off(monkeypatch):
    # was: every pairing round (0.1 s) and every commit tried the refusing destination again
    refusals: list[float] = []

    def refusing(**kwargs) -> bool:
        refusals.append(0.0)
        return False  # (every destination busy: nothing ever moves)

    monkeypatch.setattr(migration_module, "may_migrate_into", refusing)
    workload = synthetic("synthetic:L-L", 60, rate=20.0, seed=1)

    def tries(backoff_s: float) -> int:
        refusals.clear()
        config = replace(SMALL, migration=replace(SMALL.migration, refused_backoff_s=backoff_s))
        result = simulate(config, "corral", workload)
        assert result.migrations.started == 0 and len(result.finished) == 60
        return len(refusals)

    assert SMALL.migration.refused_backoff_s == REFUSED_BACKOFF_S
    with_back_off, without = tries(REFUSED_BACKOFF_S), tries(0.0)
    assert 0 < with_back_off < without / 3
