"""A stage's frames by token (`kv_plan.plan_tokens`): every position once, in order, whole blocks
wherever a block is all in the range and starts on its boundary."""

from __future__ import annotations

import itertools

import pytest

from services.llumlet.migration.kv_plan import plan_tokens

TABLE = [7, 3, 9, 1, 4]  # a request's blocks; block size 4: positions 0-19
BS = 4


def positions(plan) -> list[int]:
    """The request positions the plan's frames write, in frame order."""
    head = list(range(plan.head.start, plan.head.stop)) if plan.head else []
    blocks = [p for i, _ in enumerate(plan.block_ids) for p in range((plan.first_block + i) * BS,
                                                                     (plan.first_block + i + 1) * BS)]
    return head + blocks + list(range(plan.tail.start, plan.tail.stop))


@pytest.mark.parametrize("sent,stop", [(s, e) for s, e in itertools.combinations_with_replacement(range(21), 2)])
def test_every_position_once_in_order(sent, stop) -> None:
    plan = plan_tokens(TABLE, sent, stop, BS)
    assert positions(plan) == list(range(sent, stop))
    assert list(plan.block_ids) == TABLE[plan.first_block : plan.first_block + len(plan.block_ids)]
    assert plan.num_tokens == (stop - sent) - BS * len(plan.block_ids) and plan.is_empty == (sent == stop)
    assert plan.head is None or plan.head.stop - plan.head.start < BS  # by token: only a block's part
    if not plan.block_ids:  # nothing whole: one run, one frame
        assert plan.head is None and (plan.tail.start, plan.tail.stop) == (sent, stop)


def test_the_last_stage_sends_only_the_tokens_since_the_one_before() -> None:
    plan = plan_tokens(TABLE, 10, 12, BS)  # two tokens decoded since positions 0-9 went
    assert (plan.tail.start, plan.tail.stop, list(plan.block_ids), plan.num_tokens) == (10, 12, [], 2)
    across = plan_tokens(TABLE, 11, 13, BS)  # across a block boundary: still one token frame
    assert across.head is None and (across.tail.start, across.tail.stop) == (11, 13)
    whole = plan_tokens(TABLE, 0, 18, BS)  # a hand-off: everything in one stage
    assert whole.head is None and list(whole.block_ids) == TABLE[:4]
    assert (whole.tail.start, whole.tail.stop) == (16, 18)
    with pytest.raises(AssertionError):
        plan_tokens(TABLE, 0, 21, BS)  # past the blocks
