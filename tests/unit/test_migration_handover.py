"""The destination's handover line (migration/handover.py): logged once per migrated-in request,
from the step that computed its first token there, and read back by the benchmarks."""

from __future__ import annotations

import logging

from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.migration.handover import (
    log_commit_frame,
    log_first_step,
    parse_commit_frames,
    parse_handovers,
)
from tests.unit.migration_helpers import sim_config
from tests.unit.test_sim_engine import FAST, gen

LOGGER = "services.llumlet.engines.sim.migration"


def logged(write) -> str:
    """What `write(logger)` logs at INFO, a line per record, after a line of noise."""
    log = logging.getLogger("test.handover")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        write(log)
    finally:
        log.removeHandler(handler)
    return "noise\n" + "\n".join(records)


def test_a_logged_line_reads_back() -> None:
    text = logged(lambda log: log_first_step(log, "req-1-ab12", 100.25, 100.5, 100.75, 101.125))
    assert parse_handovers(text) == {"req-1-ab12": {
        "committed_at": 100.25, "in_engine_at": 100.5, "first_step_started_at": 100.75,
        "first_step_ended_at": 101.125}}


def test_a_commit_frame_line_reads_back_by_migration_id() -> None:
    text = logged(lambda log: log_commit_frame(log, "0f3a9c", 200.125, 200.5))
    assert parse_commit_frames(text) == {
        "0f3a9c": {"frame_header_at": 200.125, "frame_in_at": 200.5}}


async def test_sim_destination_logs_the_migrated_requests_first_step_once(caplog) -> None:
    src, dst = SimEngine(sim_config(**FAST)), SimEngine(sim_config(**FAST))
    src.add_request(gen("moved", 10, 40))
    dst.add_request(gen("local", 10, 40))
    for _ in range(3):
        await src.step()
        await dst.step()
    assert await src.migration_ops().suspend("moved")
    blocks = len(src.block_ids_of("moved"))
    await dst.migration_ops().reserve_blocks("m", blocks)
    caplog.set_level(logging.INFO, logger=LOGGER)
    dst.migration_ops().add_migrated(src.migration_ops().migration_commit("moved", "m"), "m")
    for _ in range(3):
        await dst.step()
    lines = parse_handovers(caplog.text)
    assert list(lines) == ["moved"]  # once, and not for the request that started here
    stamps = lines["moved"]
    assert stamps["committed_at"] <= stamps["in_engine_at"] <= stamps["first_step_started_at"]
    assert stamps["first_step_started_at"] <= stamps["first_step_ended_at"]
