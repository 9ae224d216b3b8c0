"""Virtual usage and freeness: each rule of Llumnix Algorithm 1."""

from __future__ import annotations

import math

import pytest

from shared.policy.config import HIGH_PRIORITY, NORMAL_PRIORITY
from shared.policy.freeness import QueueDemand, freeness, request_virtual_usage, total_virtual_usage
from tests.unit.policy_helpers import make_load

NO_HEADROOM: dict[int, int] = {}


def test_running_requests_count_their_physical_blocks():
    load = make_load(total=100, running={NORMAL_PRIORITY: (4, 40)})
    assert total_virtual_usage(load, NO_HEADROOM, QueueDemand.HEAD) == 40
    assert freeness(load, NO_HEADROOM) == pytest.approx((100 - 40) / 4)


def test_only_head_of_line_counts_for_migration_freeness():
    load = make_load(total=100, running={NORMAL_PRIORITY: (2, 20)}, waiting=[30, 50])
    assert total_virtual_usage(load, NO_HEADROOM, QueueDemand.HEAD) == 20 + 30
    assert total_virtual_usage(load, NO_HEADROOM, QueueDemand.ALL) == 20 + 30 + 50


def test_queued_request_behind_head_has_zero_virtual_usage():
    head = request_virtual_usage(queuing=True, is_head=True, demand_blocks=7, physical_blocks=0,
                                 priority=0, num_requests_at_priority=0, headroom_blocks=NO_HEADROOM)
    behind = request_virtual_usage(queuing=True, is_head=False, demand_blocks=7, physical_blocks=0,
                                   priority=0, num_requests_at_priority=0, headroom_blocks=NO_HEADROOM)
    assert (head, behind) == (7, 0)


def test_headroom_is_split_among_requests_of_the_level():
    headroom = {HIGH_PRIORITY: 60}
    per_request = [
        request_virtual_usage(queuing=False, is_head=False, demand_blocks=0, physical_blocks=5,
                              priority=HIGH_PRIORITY, num_requests_at_priority=3, headroom_blocks=headroom)
        for _ in range(3)
    ]
    assert per_request == [25, 25, 25]
    load = make_load(total=200, running={HIGH_PRIORITY: (3, 15)})
    # The aggregate form over a report agrees with the per-request sum.
    assert total_virtual_usage(load, headroom, QueueDemand.HEAD) == pytest.approx(sum(per_request))


def test_normal_priority_has_no_headroom():
    load = make_load(total=100, running={NORMAL_PRIORITY: (2, 10)})
    assert total_virtual_usage(load, {HIGH_PRIORITY: 60}, QueueDemand.HEAD) == 10


def test_freeness_goes_negative_when_virtual_usage_exceeds_capacity():
    load = make_load(total=100, running={NORMAL_PRIORITY: (4, 90)}, waiting=[30])
    assert freeness(load, NO_HEADROOM) == pytest.approx((100 - 120) / 4)
    assert freeness(load, NO_HEADROOM) < 0


def test_idle_instance_divides_by_a_batch_of_one():
    assert freeness(make_load(total=100), NO_HEADROOM) == 100


def test_draining_instance_has_infinite_usage():
    load = make_load(total=100, running={NORMAL_PRIORITY: (1, 1)}, draining=True)
    assert math.isinf(total_virtual_usage(load, NO_HEADROOM, QueueDemand.HEAD))
    assert freeness(load, NO_HEADROOM) == -math.inf


def test_blocks_reserved_for_incoming_migrations_are_used():
    load = make_load(total=100, running={NORMAL_PRIORITY: (1, 10)}, reserved=20)
    assert freeness(load, NO_HEADROOM) == 70
