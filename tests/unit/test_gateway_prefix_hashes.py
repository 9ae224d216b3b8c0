"""The gateway hashes prompts for prefix-aware dispatch at the instances' block size."""

from __future__ import annotations

import argparse

from services.gateway.config import add_arguments, config_from_args
from services.gateway.instances import GatewayInstances
from services.gateway.prefix_hashes import prompt_block_hashes
from shared.messages import MAX_BLOCK_HASHES
from shared.prefix_hash import block_hashes
from tests.unit.policy_helpers import make_load


def test_prompt_hashes_are_the_engines_chain_at_the_reported_block_size():
    prompt = list(range(1, 70))
    assert prompt_block_hashes(prompt, 16) == (block_hashes(prompt, 16), 16)
    assert prompt_block_hashes(prompt, None) == ([], 0)
    hashes, _ = prompt_block_hashes([1] * (MAX_BLOCK_HASHES + 3) * 2, 2)
    assert len(hashes) == MAX_BLOCK_HASHES  # bounded as the wire field is


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
