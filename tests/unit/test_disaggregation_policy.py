"""P/D disaggregation policy: who takes new requests, who hands off, and where a request decodes
after its prefill (freest decode instance under the one migration guard, else mixed, else stay)."""

from __future__ import annotations

import msgspec
import pytest

from shared.messages import InstanceRole, LoadReport, WireError, decode
from shared.policy.config import PolicyConfig
from shared.policy.disaggregation import (
    account_handoff, dispatch_pool, handoff_destination, rebalancing_pairs, wants_handoff,
)
from shared.policy.migration import MigrationGuard, MigrationPair, pair_migrations
from tests.unit.policy_helpers import make_load

P, D, M = InstanceRole.PREFILL, InstanceRole.DECODE, InstanceRole.MIXED
GUARD = MigrationGuard()  # the defaults the services and the simulator run
NO_HEADROOM: dict[int, int] = {}


def load(instance_id: str, role: InstanceRole, **kw) -> LoadReport:
    return msgspec.structs.replace(make_load(instance_id, **kw), role=role)


def ids(loads: list[LoadReport]) -> list[str]:
    return [l.instance_id for l in loads]


def dest(source: LoadReport, loads: list[LoadReport], blocks: int = 10) -> str | None:
    return handoff_destination(source, loads, blocks, GUARD, NO_HEADROOM)


# -- roles and the dispatch pool ------------------------------------------------------------------


def test_only_prefill_instances_hand_off():
    assert wants_handoff(P)
    assert not wants_handoff(D)
    assert not wants_handoff(M)


def test_new_requests_avoid_decode_instances_while_a_prefill_instance_lives():
    loads = [load("p", P), load("d", D), load("m", M)]
    assert ids(dispatch_pool(loads)) == ["p", "m"]


def test_fleet_without_prefill_dispatches_to_everyone():
    loads = [load("d", D), load("m", M), load("m2", M)]
    assert ids(dispatch_pool(loads)) == ["d", "m", "m2"]
    assert dispatch_pool([]) == []


def test_draining_prefill_instances_do_not_keep_decode_out_of_the_pool():
    # The only prefill instance is leaving: new requests must still find a home.
    loads = [load("p", P, draining=True), load("d", D)]
    assert ids(dispatch_pool(loads)) == ["p", "d"]


# -- hand-off destination -------------------------------------------------------------------------


def test_freest_decode_instance_is_chosen():
    source = load("p", P, running={0: (1, 10)})
    loads = [source, load("d1", D, running={0: (2, 60)}), load("d2", D, running={0: (2, 20)})]
    assert dest(source, loads) == "d2"



def test_a_decode_instance_at_its_limit_of_migrations_in_is_passed_over_and_accounting_fills_it():
    # was: chosen, and it refused the PRE-ALLOC (the hand-off's attempt spent)
    source = load("p", P, running={0: (1, 10)})
    full = msgspec.structs.replace(load("d2", D, running={0: (2, 20)}), num_migrating=2, num_migrating_in=2,
                                   max_migrations_in=2)
    loads = [source, load("d1", D, running={0: (2, 60)}), full]
    assert dest(source, loads) == "d1"
    untold = msgspec.structs.replace(full, max_migrations_in=0)  # an older llumlet: no limit known
    assert dest(source, [source, loads[1], untold]) == "d2"
    one_short = msgspec.structs.replace(full, num_migrating=1, num_migrating_in=1)
    assert dest(source, [source, loads[1], one_short]) == "d2"
    accounted = account_handoff(one_short, 10)  # the scheduler's answer, as its table keeps it
    assert (accounted.num_migrating_in, accounted.num_migrating) == (2, 2)
    assert dest(source, [source, loads[1], accounted]) == "d1"


def test_a_report_cannot_have_more_migrations_in_than_migrations():
    with pytest.raises(ValueError, match="migrations in"):
        msgspec.structs.replace(make_load("d"), num_migrating=1, num_migrating_in=2)
    wire = msgspec.msgpack.encode({**msgspec.structs.asdict(make_load("d")), "num_migrating_in": 1})
    with pytest.raises(WireError, match="migrations in"):  # (what a llumlet sends is checked too)
        decode(wire, LoadReport)

def test_decode_instances_come_before_a_freer_mixed_one():
    source = load("p", P, running={0: (1, 10)})
    loads = [source, load("m", M), load("d", D, running={0: (4, 50)})]
    assert dest(source, loads) == "d"


def test_mixed_instance_takes_it_when_no_decode_instance_has_room():
    source = load("p", P, running={0: (1, 10)})
    loads = [source, load("d", D, running={0: (4, 85)}), load("m", M, running={0: (1, 30)})]
    assert dest(source, loads, blocks=10) == "m"


def test_no_room_anywhere_keeps_the_request_where_it_is():
    source = load("p", P, running={0: (1, 10)})
    loads = [source, load("d", D, running={0: (4, 85)}), load("p2", P)]
    assert dest(source, loads, blocks=10) is None


def test_guard_margin_decides_room():
    # 100 blocks, guard keeps 10 % free: 40 used + 50 moved leaves exactly 10 -> fits; 51 does not.
    source = load("p", P)
    loads = [source, load("d", D, running={0: (2, 40)})]
    assert dest(source, loads, blocks=50) == "d"
    assert dest(source, loads, blocks=51) is None


def test_destination_with_a_queue_or_draining_is_refused():
    source = load("p", P)
    loads = [source, load("d1", D, waiting=[3]), load("d2", D, draining=True)]
    assert dest(source, loads) is None


def test_prefill_instances_never_take_a_hand_off():
    source = load("p", P, running={0: (1, 10)})
    loads = [source, load("p2", P)]
    assert dest(source, loads) is None


def test_committed_blocks_are_not_room():
    source = load("p", P)
    busy = msgspec.structs.replace(load("d", D, running={0: (1, 20)}), committed_blocks=60)
    assert dest(source, [source, busy], blocks=20) is None
    assert dest(source, [source, busy], blocks=5) == "d"


def test_ties_go_to_the_smaller_id_whatever_the_order():
    source = load("p", P)
    loads = [load("d2", D), load("d1", D), source]
    assert dest(source, loads) == "d1"
    assert dest(source, list(reversed(loads))) == "d1"


def test_headroom_counts_in_freeness():
    # d1 is emptier but runs a high-priority request whose headroom reserves 50 blocks.
    source = load("p", P)
    loads = [source, load("d1", D, running={-1: (1, 10)}), load("d2", D, running={0: (1, 30)})]
    assert handoff_destination(source, loads, 5, GUARD, {-1: 50}) == "d2"
    assert handoff_destination(source, loads, 5, GUARD, NO_HEADROOM) == "d1"


# -- load-balancing rounds ------------------------------------------------------------------------


def test_rebalancing_never_moves_a_request_into_a_prefill_instance():
    config = PolicyConfig(headroom_blocks={})
    full_decode = load("d", D, running={0: (10, 100)})
    idle_prefill, idle_mixed = load("p", P), load("m", M)
    assert pair_migrations([full_decode, idle_prefill], config, GUARD) == [MigrationPair("d", "p")]
    assert rebalancing_pairs([full_decode, idle_prefill], config, GUARD) == []
    # a prefill instance short of memory (requests degraded there) is still a source
    full_prefill = load("p", P, running={0: (10, 100)})
    assert rebalancing_pairs([full_prefill, idle_mixed], config, GUARD) == [MigrationPair("p", "m")]
    # no prefill instance: exactly the ordinary pairing
    loads = [load("m1", M, running={0: (10, 100)}), idle_mixed]
    assert rebalancing_pairs(loads, config, GUARD) == pair_migrations(loads, config, GUARD)


def test_a_freer_prefill_instance_does_not_take_a_sources_pair_from_a_decode_instance():
    # was: prefill destinations were dropped after pairing, so the source the freest (idle
    # prefill) instance was paired with got no pair at all, though a decode instance had room
    config = PolicyConfig(headroom_blocks={})
    full_decode = load("d1", D, running={0: (10, 100)})
    idle_prefill = load("p", P)
    roomy_decode = load("d2", D, running={0: (1, 10)})
    assert rebalancing_pairs([full_decode, idle_prefill, roomy_decode], config, GUARD) == [MigrationPair("d1", "d2")]


def test_a_decode_instance_whose_context_is_too_short_is_passed_over():
    source = msgspec.structs.replace(load("p", P), max_model_len=8192)
    short = msgspec.structs.replace(load("d1", D), max_model_len=2048)
    long = msgspec.structs.replace(load("d2", D, running={0: (1, 40)}), max_model_len=8192)  # busier, but fits
    loads = [source, short, long]
    assert handoff_destination(source, loads, 5, GUARD, NO_HEADROOM, request_max_tokens=3000) == "d2"
    assert handoff_destination(source, loads, 5, GUARD, NO_HEADROOM, request_max_tokens=2000) == "d1"
    assert handoff_destination(source, loads, 5, GUARD, NO_HEADROOM) == "d1"  # a length not said: not checked
    # The source's own context bounds it: a request allowed 100k tokens still stops at 2,048 there.
    short_source = msgspec.structs.replace(source, max_model_len=2048)
    assert handoff_destination(short_source, [short_source, short, long], 5, GUARD, NO_HEADROOM,
                               request_max_tokens=100_000) == "d1"
    assert handoff_destination(source, [source, short], 5, GUARD, NO_HEADROOM, request_max_tokens=3000) is None
