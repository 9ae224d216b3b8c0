"""The live llumlet runs the simulator's per-request rules: a request in prefill is never a
candidate, the destination guard counts the blocks admitted prompts still claim, and a request
does not go back soon to an instance it left (its departures travel in the commit)."""

from __future__ import annotations

import asyncio
import contextlib

from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.migration.departures import Departures
from services.llumlet.migration.leases import guard_refusal
from services.llumlet.migration.ops import IntakeLoad
from services.llumlet.migration.protocol import MigrationLimits
from services.llumlet.migration.source import MigrationCoordinator
from shared.messages import MigrateOrder
from tests.unit.migration_helpers import FakeClock, decode_steps, gen, sim_config
from tests.unit.test_migration_guards import NoHooks, RefusingLink, ResidenceOps


async def test_a_request_in_chunked_prefill_is_not_a_candidate_and_its_claim_is_reported() -> None:
    engine = SimEngine(sim_config(num_blocks=128, max_model_len=512, max_num_batched_tokens=64))
    ops = engine.migration_ops()
    engine.add_request(gen("long", 300, 8))  # 75 blocks of 4 tokens; 16 in the first 64-token chunk
    await decode_steps(engine, 1)
    assert engine.get_request("long").num_computed_tokens == 64
    assert ops.migration_candidates() == []
    assert engine.num_committed_blocks() == 75 - 16
    assert ops.intake_load().num_blocks_committed == 59
    await decode_steps(engine, 4)  # the rest of the prompt, and a first token
    assert [c.request_id for c in ops.migration_candidates()] == ["long"]
    assert engine.num_committed_blocks() == 0


def test_the_destination_guard_counts_committed_blocks() -> None:
    limits = MigrationLimits(dest_min_free_fraction=0.1, dest_max_waiting=0)
    assert guard_refusal(IntakeLoad(50, 100, 0), 40, limits) is None
    refusal = guard_refusal(IntakeLoad(50, 100, 0, num_blocks_committed=5), 40, limits)
    assert refusal is not None and "5 of them owed to admitted prompts" in refusal


async def picks(departures: Departures, count: int = 2) -> list[str]:
    link = RefusingLink()
    limits = MigrationLimits(min_residence_s=1.0, min_return_s=30.0, refused_backoff_s=0.01, idle_poll_s=0.005)
    coordinator = MigrationCoordinator("src", ResidenceOps({"old": 5.0, "young": 5.0}), None, link, None, limits,
                                       NoHooks(), departures=departures)
    loop = asyncio.create_task(coordinator.run())
    try:
        coordinator.on_order(MigrateOrder("p", "dst"))
        async with asyncio.timeout(5):
            while len(link.asked) < count:
                await asyncio.sleep(0.002)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    return link.asked[:count]


async def test_a_request_does_not_go_back_soon_to_an_instance_it_left() -> None:
    clock = FakeClock()
    departures = Departures(clock)
    assert await picks(departures) == ["young", "young"]  # the shorter one, by the policy
    departures.arrived("young", {"dst": clock() - 10.0, "elsewhere": clock() - 1.0})
    assert await picks(departures) == ["old", "old"]  # "young" left dst 10 s ago
    clock.advance(25.0)
    assert await picks(departures) == ["young", "young"]  # 35 s ago: it may return


def test_departures_accumulate_along_the_way() -> None:
    clock = FakeClock(100.0)
    departures = Departures(clock)
    departures.arrived("r", {"a": 90.0})
    assert departures.leaving("r", "b") == {"a": 90.0, "b": 100.0}
    assert departures.left_s_ago("r", "a") == 10.0 and departures.left_s_ago("r", "c") is None
    departures.forget("r")
    assert departures.leaving("r", "b") == {"b": 100.0}
