"""The gateway hashes prompts for prefix-aware dispatch at the instances' block size."""

from __future__ import annotations

import argparse
import asyncio

from services.gateway import prefix_hashes
from services.gateway.config import add_arguments, config_from_args
from services.gateway.instances import GatewayInstances
from services.gateway.prefix_hashes import PromptHasher, prompt_block_hashes
from shared.messages import MAX_BLOCK_HASHES
from shared.prefix_hash import block_hashes
from tests.unit.policy_helpers import make_load


async def test_prompt_hashes_are_the_engines_chain_at_the_reported_block_size():
    prompt = list(range(1, 70))
    assert await prompt_block_hashes(prompt, 16) == (block_hashes(prompt, 16), 16)
    assert await prompt_block_hashes(prompt, None) == ([], 0)
    assert await prompt_block_hashes(prompt[:15], 16) == ([], 16)  # no full block
    hashes, _ = await prompt_block_hashes([1] * (MAX_BLOCK_HASHES + 3) * 2, 2)
    assert len(hashes) == MAX_BLOCK_HASHES  # bounded as the wire field is


async def test_a_long_prompt_is_hashed_in_turns_that_let_other_clients_run(monkeypatch):
    monkeypatch.setattr(prefix_hashes, "BLOCKS_PER_TURN", 3)
    prompt = list(range(1000, 1000 + 16 * 10 + 5))  # 10 full blocks: turns of 3, 3, 3 and 1
    ticks = 0

    async def other_client():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_client())
    await asyncio.sleep(0)
    before = ticks
    assert await prompt_block_hashes(prompt, 16) == (block_hashes(prompt, 16), 16)  # one chain across the turns
    other.cancel()
    assert ticks - before >= 3  # it ran between the turns (once hashed whole, it ran after only)


async def test_the_choices_of_one_request_are_hashed_once(monkeypatch):
    calls = []

    async def counted(ids, block_size):
        calls.append(len(ids))
        return block_hashes(ids, block_size), block_size

    monkeypatch.setattr(prefix_hashes, "prompt_block_hashes", counted)
    hasher = PromptHasher(remembered=2)
    prompt = list(range(1, 70))
    for _choice in range(4):
        assert await hasher.hashes(prompt, 16) == (block_hashes(prompt, 16), 16)
    assert calls == [69]
    resumed = [*prompt, 7]  # a resume's longer prompt: a new list, hashed anew
    assert await hasher.hashes(resumed, 16) == (block_hashes(resumed, 16), 16)
    assert await hasher.hashes(list(prompt), 16) == (block_hashes(prompt, 16), 16)  # equal but not the same list
    assert calls == [69, 70, 69]
    assert await hasher.hashes(prompt, 16) == (block_hashes(prompt, 16), 16)  # forgotten: two remembered
    assert calls == [69, 70, 69, 69]
    assert await hasher.hashes(prompt, None) == ([], 0)


def test_the_block_size_most_instances_report():
    now = [0.0]
    instances = GatewayInstances(3.0, clock=lambda: now[0])
    assert instances.prefix_block_size() is None
    for iid, size in (("a", 16), ("b", 32), ("c", 16)):
        instances.update(make_load(iid, block_size=size))
    assert instances.prefix_block_size() == 16


def test_the_flag_is_off_by_default():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert not config_from_args(parser.parse_args(["--model", "m"]), env={}).dispatch_prefix_hashes
    args = parser.parse_args(["--model", "m", "--dispatch-prefix-hashes", "true"])
    assert config_from_args(args, env={}).dispatch_prefix_hashes
