"""A timed wait on an event never loses a cancellation (`shared/cancellation.py`): Python 3.11's
`asyncio.wait_for` returns instead when the event is set in the iteration the cancellation
arrives, and a service loop cancelled at stop would run on. The migrate-out loop hung a test
run that way (its cancel swallowed as a refused migration woke it)."""

from __future__ import annotations

import asyncio
import pathlib
import re

from services.llumlet.migration.departures import Departures
from services.llumlet.migration.protocol import MigrationLimits
from services.llumlet.migration.source import MigrationCoordinator
from shared.cancellation import wait_set
from shared.messages import MigrateOrder
from shared.nats_client import request as nats_request
from tests.unit.test_migration_guards import NoHooks, RefusingLink, ResidenceOps

REPO = pathlib.Path(__file__).resolve().parents[2]


async def test_wait_set_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, None) is True
    assert await wait_set(event, 0) is True  # already set: no wait


async def parked_then_woken_and_cancelled(task: asyncio.Task, wake) -> bool:
    """Let `task` park on its wait, then wake it and cancel it in one iteration; True if it ends."""
    for _ in range(5):
        await asyncio.sleep(0)
    wake()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2.0)
    task.cancel()  # (a swallowed cancellation: stop the loop so the test can end)
    return bool(done)


async def test_a_cancellation_that_arrives_as_the_event_is_set_ends_the_loop() -> None:
    async def service_loop(event: asyncio.Event) -> None:
        while True:
            event.clear()
            await wait_set(event, 10.0)

    for _ in range(20):  # (with wait_for every one of these is swallowed)
        event = asyncio.Event()
        assert await parked_then_woken_and_cancelled(asyncio.create_task(service_loop(event)), event.set)


async def test_the_migrate_out_loop_stops_when_cancelled_as_an_order_wakes_it() -> None:
    """Paired, it waits with a timeout (to look again soon); the cancellation must still end it."""
    limits = MigrationLimits(min_residence_s=0.0, refused_backoff_s=60.0, idle_poll_s=10.0)
    link = RefusingLink()
    coordinator = MigrationCoordinator("src", ResidenceOps({"old": 5.0, "young": 5.0}), None, link, None,
                                       limits, NoHooks(), departures=Departures())
    loop = asyncio.create_task(coordinator.run())
    coordinator.on_order(MigrateOrder("p", "dst"))
    async with asyncio.timeout(5):
        while not link.asked or coordinator.num_active:  # one refused: backing off, the pair kept
            await asyncio.sleep(0.001)
    assert await parked_then_woken_and_cancelled(loop, lambda: coordinator.on_order(MigrateOrder("q", "other")))


class WaitForClient:
    """nats-py's `request`, as far as this matters: the reply future awaited with `wait_for`."""

    def __init__(self) -> None:
        self.reply: asyncio.Future[str] | None = None

    async def request(self, subject: str, payload: bytes, timeout: float, headers: dict | None = None) -> str:
        self.reply = asyncio.get_running_loop().create_future()
        return await asyncio.wait_for(self.reply, timeout)


async def test_a_nats_request_cancelled_as_its_reply_lands_ends_the_loop() -> None:
    client = WaitForClient()

    async def asking_loop() -> None:
        while True:
            await nats_request(client, "subject", b"", 10.0)

    for _ in range(20):
        task = asyncio.create_task(asking_loop())
        assert await parked_then_woken_and_cancelled(task, lambda: client.reply.set_result("reply"))


async def test_a_nats_request_not_cancelled_returns_its_reply() -> None:
    client = WaitForClient()
    asking = asyncio.create_task(nats_request(client, "subject", b"", 10.0))
    await asyncio.sleep(0)
    client.reply.set_result("reply")
    assert await asking == "reply"


def sources() -> list[pathlib.Path]:
    return [path for top in ("services", "shared", "loadgen", "benchmarks") for path in (REPO / top).rglob("*.py")]


def test_no_service_waits_with_asyncio_wait_for() -> None:
    """The one rule for timed waits: `wait_set` or `asyncio.timeout`, never `wait_for`."""
    assert [str(path.relative_to(REPO)) for path in sources() if "asyncio.wait_for(" in path.read_text()] == []


def test_every_nats_request_keeps_its_cancellation() -> None:
    """Through `shared.nats_client.request`, never a client's own `request`."""
    direct = re.compile(r"\b(nc|client)\.request\(")
    offenders = [str(path.relative_to(REPO)) for path in sources()
                 if path != REPO / "shared" / "nats_client.py" and direct.search(path.read_text())]
    assert offenders == []
