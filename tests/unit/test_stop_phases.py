"""A service's stop goes on past a phase that hangs or fails, and says which one and where."""

from __future__ import annotations

import asyncio
import logging

from services.stop_phases import StopPhases


async def test_a_hanging_phase_is_cut_at_its_bound_and_named_with_where_it_waits(caplog):
    phases = StopPhases("svc", logging.getLogger("test.stop"))
    stuck = asyncio.Event()

    async def waits_forever_on_an_event() -> None:
        await stuck.wait()

    helper = asyncio.create_task(waits_forever_on_an_event(), name="helper")
    with caplog.at_level(logging.INFO, logger="test.stop"):
        assert await phases.run("draining", asyncio.shield(helper), 0.05) is False
        assert await phases.run("closing", asyncio.sleep(0), 1) is True
    text = caplog.text
    assert "svc stopping: draining did not finish within 0.1 s" in text
    assert "waits_forever_on_an_event" in text  # the pending task's stack
    assert "closing" not in text  # a quick phase says nothing
    helper.cancel()


async def test_a_failing_phase_is_logged_and_the_next_still_runs(caplog):
    phases = StopPhases("svc", logging.getLogger("test.stop"))
    ran = []

    async def fails() -> None:
        raise RuntimeError("broken pipe")

    async def next_phase() -> None:
        ran.append(True)

    with caplog.at_level(logging.WARNING, logger="test.stop"):
        assert await phases.run("failing", fails(), 1) is False
        assert await phases.run("next", next_phase(), 1) is True
    assert "svc stopping: failing failed: RuntimeError('broken pipe')" in caplog.text
    assert ran == [True]
