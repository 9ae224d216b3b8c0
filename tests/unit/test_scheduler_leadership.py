"""Scheduler replicas: the live one with the lowest id pairs migrations, one at a time; a leader
that steps down cancels its standing pairs."""

from __future__ import annotations

from services.global_scheduler.leadership import Leadership
from services.global_scheduler.migration_loop import MigrationLoop, MigrationPairer
from shared.messages import MigrateOrder, decode
from shared.policy.migration import DEFAULT_GUARD
from tests.unit.test_migration_loop import POLICY, busy, idle


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_new_replica_waits_one_lease_before_it_leads():
    clock = Clock()
    alone = Leadership("b", lease_s=1.0, clock=clock)
    assert not alone.leads()  # it may not have heard the others yet
    clock.now = 1.0
    assert alone.leads()


def test_the_lowest_live_id_leads_and_the_next_takes_over_one_lease_after_it_dies():
    clock = Clock()
    a, b = Leadership("a", 1.0, clock), Leadership("b", 1.0, clock)
    for _ in range(6):  # heartbeats every 0.2 s
        clock.now += 0.2
        a.heard("b"), b.heard("a")
    assert a.leads() and not b.leads()
    # a dies: b keeps deferring while a's last heartbeat is within the lease.
    clock.now += 0.9
    assert not b.leads()
    clock.now += 0.2
    assert b.leads() and b.live_peers() == []


def test_a_leader_steps_down_at_once_when_a_lower_id_appears():
    clock = Clock()
    b = Leadership("b", 1.0, clock)
    clock.now = 2.0
    assert b.leads()
    b.heard("a")
    assert not b.leads() and b.leader() == "a"


def test_no_two_replicas_lead_at_any_moment_of_a_join():
    clock = Clock()
    b = Leadership("b", 1.0, clock)
    clock.now = 5.0
    a = Leadership("a", 1.0, clock)  # joins later with the lower id
    leaders_over_time = []
    for _ in range(20):
        clock.now += 0.1
        a.heard("b"), b.heard("a")
        leaders_over_time.append([r.my_id for r in (a, b) if r.leads()])
    assert all(len(leaders) <= 1 for leaders in leaders_over_time)
    assert leaders_over_time[-1] == ["a"]


async def test_only_the_leading_loop_pairs_and_a_leader_stepping_down_cancels_its_pairs():
    sent: list[tuple[str, MigrateOrder]] = []

    async def publish(subject: str, payload: bytes) -> None:
        sent.append((subject, decode(payload, MigrateOrder)))

    leading = True
    loop = MigrationLoop(MigrationPairer(POLICY, DEFAULT_GUARD), lambda: [busy("a"), idle("b")], publish, 0.1,
                         leads=lambda: leading)
    await loop.round()
    assert [(o.dst_instance_id, o.cancel) for _, o in sent] == [("b", False)]
    pair_id = sent[0][1].pair_id
    leading = False
    sent.clear()
    await loop.round()
    await loop.round()
    assert [(o.pair_id, o.cancel) for _, o in sent] == [(pair_id, True)]  # once, then silence
    assert loop.pairer.pairs == {}
