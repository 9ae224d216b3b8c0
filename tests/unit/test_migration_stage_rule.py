"""One stage rule: the live source coordinator and the simulator's Migrator plan the same stages
(blocks per stage, which one is last) for the same request growing the same way.

The simulator runs the scenario first, in virtual time: a decoding request migrates over a slow
link, so it keeps generating while stages copy. The live coordinator then migrates the same
request on real simulated engines, with the source stepped (inside each PRE-ALLOC) to exactly
the token counts the simulator's request had at each of its stage decisions."""

from __future__ import annotations

import pytest

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import MigrationModel, SimConfig
from loadgen.simulator.migration_state import MigrationStatus as SimMigrationStatus
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus
from shared.engine_model.request import RequestStatus
from shared.policy.baselines import get_policy
from shared.policy.migration import DEFAULT_STAGES, StageRule
from tests.simulator.helpers import workload_of
from tests.unit.migration_helpers import gen
from tests.unit.migration_source_harness import Harness

BLOCK_SIZE = 16
PROMPT, MAX_TOKENS = 300, 3000
_STEPPING = (RequestStatus.WAITING, RequestStatus.RUNNING)  # (not once suspended for the last stage)
MIGRATE_AT_S = 1.0  # virtual time: the request decodes ~35 tokens first


def simulated(rule: StageRule) -> tuple[list[tuple[int, bool]], list[int]]:
    """The simulator's stages, and the request's computed tokens at each stage decision."""
    # (A notice one step ahead: the live harness steps its source by hand, with no step clock,
    # so its source notices nothing and suspends after the step in flight, as this does.)
    config = SimConfig(num_instances=2, guard=None,  # (nothing pairs by itself: one light request)
                       migration=MigrationModel(bandwidth_gbps=0.05, stages=rule, notice_steps=1))
    assert config.scheduler.block_size == BLOCK_SIZE
    sim = ClusterSimulator(config, get_policy("llumnix-base"), workload_of([(0.0, PROMPT, MAX_TOKENS, 0)]))
    migrator, instances = sim.migrator, list(sim.instances.values())
    src = dst = None
    stages: list[tuple[int, bool]] = []
    tokens: list[int] = []
    start_stage, next_stage = migrator._start_stage, migrator._next_stage

    def recording(migration, num_blocks, overhead_s):
        stages.append((num_blocks, migration.status is SimMigrationStatus.STOPPED))
        return start_stage(migration, num_blocks, overhead_s)

    def deciding(migration):  # (the last stage's suspend waits for the step in flight: a token later)
        tokens.append(migration.src.scheduler.get(migration.request_id).num_computed_tokens)
        next_stage(migration)

    def migrate(_) -> None:
        nonlocal src, dst
        src, dst = sorted(instances, key=lambda i: not i.scheduler.requests)  # from the one holding it
        assert migrator._try_start(src, dst)

    migrator._start_stage, migrator._next_stage = recording, deciding
    sim.events.push(MIGRATE_AT_S, migrate)
    result = sim.run()
    assert result.migrations.committed == 1 and [r.request_id for r in result.finished] == ["r0"]
    return stages, tokens


async def live(rule: StageRule, tokens: list[int]) -> list[tuple[int, bool]]:
    """The live coordinator's stages, the source reaching `tokens[k]` before its decision k."""
    h = Harness(MigrationLimits(stage_limit=rule.stage_limit, last_stage_blocks=rule.last_stage_blocks),
                block_size=BLOCK_SIZE)
    h.incoming.kv_address = await h.receiver.start()  # (no step loops: the test steps the source)
    try:
        h.src.add_request(gen("r0", PROMPT, MAX_TOKENS))

        async def step_to(target: int) -> None:
            while (r := h.src.get_request("r0")).num_computed_tokens < target and r.status in _STEPPING:
                await h.src.step()
            assert r.num_computed_tokens == target

        await step_to(tokens[0])
        preallocs = 0

        async def grow(_msg) -> None:  # between decision k and k + 1: the next stage's PRE-ALLOC
            nonlocal preallocs
            preallocs += 1
            await step_to(tokens[min(preallocs, len(tokens) - 1)])

        h.link.before["prealloc"] = grow
        m = await h.coordinator.migrate("r0", "dst")
        assert m.status is MigrationStatus.FINISHED, m.reason
        return [(stage.num_blocks, stage.final) for stage in m.stages]
    finally:
        await h.close()


@pytest.mark.parametrize("rule", [DEFAULT_STAGES, StageRule(stage_limit=3), StageRule(last_stage_blocks=2),
                                  StageRule(stage_limit=1)], ids=str)
async def test_live_and_simulated_migration_take_the_same_stages(rule: StageRule) -> None:
    stages, tokens = simulated(rule)
    assert stages[-1][1] and not any(last for _, last in stages[:-1])
    if rule.stage_limit > 1:
        assert len(stages) >= 3, stages  # (the scenario grows across stages: the rule is exercised)
    assert await live(rule, tokens) == stages
