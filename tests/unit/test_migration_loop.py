"""The global scheduler's pairing rounds: standing pairs are re-confirmed with the same id and
cancelled when they stop qualifying."""

from __future__ import annotations

import argparse

from services.global_scheduler.config import add_arguments, config_from_args
from services.global_scheduler.migration_loop import MigrationLoop, MigrationPairer
from shared import subjects
from shared.messages import MigrateOrder, decode
from shared.policy.config import PolicyConfig
from shared.policy.migration import DEFAULT_GUARD
from tests.unit.policy_helpers import make_load

POLICY = PolicyConfig(migrate_out_freeness=1.0, migrate_in_freeness=10.0)


def migratable(load):
    load.kv_address = f"127.0.0.1:{abs(hash(load.instance_id)) % 50000 + 1024}"
    return load


def busy(iid: str):
    return migratable(make_load(iid, total=100, running={0: (10, 98)}))  # freeness 0.2: a source


def idle(iid: str):
    return migratable(make_load(iid, total=100, running={0: (1, 5)}))  # freeness 95: a destination


def middling(iid: str):
    return migratable(make_load(iid, total=100, running={0: (10, 50)}))  # freeness 5: neither


def by_source(orders):
    return {o.src: o.message for o in orders}


def test_a_pair_is_ordered_and_reconfirmed_with_the_same_id() -> None:
    pairer = MigrationPairer(POLICY, DEFAULT_GUARD)
    first = by_source(pairer.plan([busy("a"), idle("b")]))
    second = by_source(pairer.plan([busy("a"), idle("b")]))
    assert set(first) == {"a"} and first["a"].dst_instance_id == "b" and not first["a"].cancel
    assert second["a"].pair_id == first["a"].pair_id and second["a"].round > first["a"].round


def test_a_pair_that_no_longer_qualifies_is_cancelled_once() -> None:
    pairer = MigrationPairer(POLICY, DEFAULT_GUARD)
    standing = by_source(pairer.plan([busy("a"), idle("b")]))["a"]
    cancel = by_source(pairer.plan([middling("a"), idle("b")]))["a"]
    assert cancel.cancel and cancel.pair_id == standing.pair_id
    assert pairer.plan([middling("a"), idle("b")]) == []


def test_a_new_destination_cancels_the_old_pair_first() -> None:
    pairer = MigrationPairer(POLICY, DEFAULT_GUARD)
    old = by_source(pairer.plan([busy("a"), idle("b")]))["a"]
    orders = pairer.plan([busy("a"), idle("c")])  # b vanished from the table, c is free
    assert [(o.src, o.message.cancel) for o in orders] == [("a", True), ("a", False)]
    assert orders[0].message.pair_id == old.pair_id
    assert orders[1].message.dst_instance_id == "c" and orders[1].message.pair_id != old.pair_id


def test_each_source_and_destination_is_paired_once_per_round() -> None:
    pairer = MigrationPairer(POLICY, DEFAULT_GUARD)
    orders = by_source(pairer.plan([busy("a"), busy("b"), busy("c"), idle("x"), idle("y")]))
    assert len(orders) == 2 and {o.dst_instance_id for o in orders.values()} == {"x", "y"}


async def test_the_loop_publishes_orders_on_the_source_subject() -> None:
    sent: list[tuple[str, MigrateOrder]] = []

    async def publish(subject: str, data: bytes) -> None:
        sent.append((subject, decode(data, MigrateOrder)))

    loop = MigrationLoop(MigrationPairer(POLICY, DEFAULT_GUARD), lambda: [busy("a"), idle("b")], publish, interval_s=0.1)
    await loop.round()
    assert [(subject, order.dst_instance_id) for subject, order in sent] == [(subjects.llumlet("a", "migrate"), "b")]
    assert loop.orders_sent == 1


def test_instances_without_a_kv_receiver_take_no_part() -> None:
    pairer = MigrationPairer(POLICY, DEFAULT_GUARD)
    no_receiver = make_load("v", total=100, running={0: (1, 5)})  # idle, but migration is off there
    assert pairer.plan([busy("a"), no_receiver]) == []


def test_the_pairing_guard_comes_from_the_schedulers_own_flags_and_env(monkeypatch) -> None:
    def config(*argv: str):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return config_from_args(parser.parse_args(argv))

    assert config().guard == DEFAULT_GUARD
    monkeypatch.setenv("CORRAL_MIGRATION_DEST_MAX_WAITING", "2")
    guard = config("--migration-min-freeness-gap", "50").guard
    assert (guard.dest_max_waiting, guard.min_freeness_gap) == (2, 50.0)
    # busy → idle has a freeness gap of 94.8: the default guard pairs them, a gap of 100 does not.
    assert MigrationPairer(POLICY, DEFAULT_GUARD).plan([busy("a"), idle("b")])
    strict = config("--migration-min-freeness-gap", "100").guard
    assert MigrationPairer(POLICY, strict).plan([busy("a"), idle("b")]) == []
    queued = idle("q")
    queued.num_waiting = 1  # (as the llumlets' --migration-dest-max-waiting: 0 refuses a queue, 2 takes it)
    assert MigrationPairer(POLICY, guard).plan([busy("a"), queued])
    assert MigrationPairer(POLICY, DEFAULT_GUARD).plan([busy("a"), queued]) == []
