from __future__ import annotations

import random

import pytest

from shared.engine_model.block_manager import BlockManager, blocks_for_tokens


def test_allocate_and_free_return_blocks_to_the_pool() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    blocks = bm.allocate("a", 3)
    assert len(blocks) == 3 and bm.num_free == 7 and bm.num_used == 3
    assert bm.blocks_of("a") == blocks
    assert bm.free("a") == 3
    assert bm.num_free == 10 and bm.num_used == 0
    bm.check_invariants()


def test_append_slots_grows_table_to_ceil_of_tokens() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", 1)
    assert bm.blocks_needed("a", 4) == 0
    assert bm.blocks_needed("a", 5) == 1
    bm.append_slots("a", 9)
    assert bm.num_blocks_of("a") == blocks_for_tokens(9, 4) == 3
    bm.append_slots("a", 6)  # never shrinks
    assert bm.num_blocks_of("a") == 3
    bm.check_invariants()


def test_can_allocate_and_can_append_respect_free_count() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    assert bm.can_allocate(4) and not bm.can_allocate(5)
    bm.allocate("a", 3)
    assert bm.can_append("a", 8) and not bm.can_append("a", 9)


def test_illegal_transitions_are_rejected() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 1)
    with pytest.raises(AssertionError):
        bm.allocate("a", 1)
    with pytest.raises(AssertionError):
        bm.allocate("b", 4)
    with pytest.raises(KeyError):
        bm.free("unknown")
    with pytest.raises(KeyError):
        bm.adopt("no-such-lease", "c")


def test_reserve_release_is_idempotent() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first = bm.reserve("lease", 3)
    second = bm.reserve("lease", 2)  # a lease grows stage by stage
    assert first is not None and second is not None
    assert bm.reserved_blocks("lease") == first + second
    assert bm.num_free == 3 and bm.num_reserved == 5 and bm.num_used == 0
    assert bm.reserve("other", 4) is None and bm.num_free == 3  # nothing taken on refusal
    assert bm.release("lease") == 5
    assert bm.release("lease") == 0
    assert bm.num_free == 8 and bm.num_reserved == 0
    bm.check_invariants()


def test_adopt_turns_reservation_into_block_table() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    reserved = bm.reserve("lease", 3)
    assert bm.adopt("lease", "req") == reserved
    assert bm.blocks_of("req") == reserved
    assert bm.num_reserved == 0 and bm.num_used == 3
    assert bm.release("lease") == 0  # already adopted
    bm.check_invariants()


def test_check_invariants_detects_a_duplicated_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    table = bm.allocate("a", 2)
    bm._free.append(table[0])  # corrupt on purpose
    with pytest.raises(AssertionError):
        bm.check_invariants()


@pytest.mark.parametrize("seed", range(5))
def test_random_walk_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=64, block_size=4)
    tokens: dict[str, int] = {}
    leases: set[str] = set()
    for step in range(1500):
        op = rng.random()
        if op < 0.25:
            owner, n = f"o{step}", rng.randint(0, 6)
            if bm.can_allocate(n):
                bm.allocate(owner, n)
                tokens[owner] = n * 4
        elif op < 0.5 and tokens:
            owner = rng.choice(sorted(tokens))
            total = tokens[owner] + rng.randint(1, 9)
            if bm.can_append(owner, total):
                bm.append_slots(owner, total)
                tokens[owner] = total
                assert bm.num_blocks_of(owner) >= blocks_for_tokens(total, 4)
        elif op < 0.65 and tokens:
            owner = rng.choice(sorted(tokens))
            bm.free(owner)
            del tokens[owner]
        elif op < 0.8:
            lease = f"l{rng.randint(0, 5)}"
            if bm.reserve(lease, rng.randint(0, 5)) is not None:
                leases.add(lease)
        elif op < 0.9:
            lease = f"l{rng.randint(0, 5)}"
            bm.release(lease)
            leases.discard(lease)
        elif leases:
            lease = rng.choice(sorted(leases))
            owner = f"m{step}"
            n = len(bm.adopt(lease, owner))
            leases.discard(lease)
            tokens[owner] = n * 4
        bm.check_invariants()
        assert bm.num_free + bm.num_used + bm.num_reserved == 64
