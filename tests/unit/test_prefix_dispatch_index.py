"""The prefix dispatch index answers exactly as the scan (`choose_by_predicted_ttft`) on random
fleets and prefix holdings, and walks few instances when some have room."""

from __future__ import annotations

import math
import random

import pytest
from msgspec.structs import replace

from shared.messages import DispatchRequest, Refusal
from shared.policy import PolicyConfig, account_dispatch
from shared.policy.prefix_dispatch import DEFAULT_SATURATION_WEIGHT, PrefixContext, choose_by_predicted_ttft
from shared.policy.prefix_dispatch_index import PrefixDispatchIndex
from tests.unit.policy_helpers import make_load


class StubIndex:
    """The prefix index's answer, set per request (instance -> leading blocks held)."""

    def __init__(self) -> None:
        self.answer: dict[str, int] = {}
        self.asked = 0

    def matches(self, block_hashes):
        self.asked += 1
        return self.answer


def _context(index: StubIndex, tie_s: float = 1e-3, room_wait_weight: float = 1.0,
             saturation_weight: float = DEFAULT_SATURATION_WEIGHT, cached_queue_weight: float = 1.0,
             held_request_tokens: float = 0.0) -> PrefixContext:
    return PrefixContext(index, prefill_s=lambda n: 0.255e-3 * n + 8.2e-3 if n > 0 else 0.0, ttft_tie_s=tie_s,
                         room_wait_weight=room_wait_weight, saturation_weight=saturation_weight,
                         cached_queue_weight=cached_queue_weight, held_request_tokens=held_request_tokens)


def _random_load(rng: random.Random, instance_id: str):
    total = rng.choice([64, 100, 1000])
    running = {0: (rng.randint(0, 4), rng.randint(0, total // 3))} if rng.random() < 0.8 else {}
    waiting = [rng.choice([1, 2, 8, 40]) for _ in range(rng.choice([0, 0, 1, 3]))]  # few values: exact ties
    load = make_load(instance_id, total=total, running=running, waiting=waiting, draining=rng.random() < 0.15,
                     max_model_len=rng.choice([0, 2048, 8192]), reserved=rng.choice([0, 0, 5]))
    # Some instances tell their waiting prefill in tokens (cached prefixes left out), some do not.
    prefill = rng.choice([None, None, 0, 16 * sum(waiting), 200, 5000]) if waiting else rng.choice([None, 0])
    return replace(load, committed_blocks=rng.choice([0, 0, 3, 30]), waiting_prefill_tokens=prefill)


def _random_request(rng: random.Random, ids: list[str], i: int) -> DispatchRequest:
    exclude = rng.sample(ids, min(len(ids), rng.choice([0, 0, 1, 3])))
    return DispatchRequest(request_id=f"r{i}", num_prompt_tokens=rng.choice([1, 10, 600, 3000]), max_tokens=16,
                           exclude=exclude, block_hashes=[1, 2, 3], prefix_block_size=16)


@pytest.mark.parametrize("saturation_weight", [DEFAULT_SATURATION_WEIGHT, 0.0, 20.0])
@pytest.mark.parametrize("room_wait_weight", [1.0, 0.0, 5.0, math.inf])
@pytest.mark.parametrize("seed", range(40))
def test_index_equals_scan_on_random_fleets(seed, room_wait_weight, saturation_weight):
    rng = random.Random(seed)
    config = PolicyConfig(tie_epsilon=rng.choice([1e-6, 0.5, 5.0]))
    prefixes = StubIndex()
    context = _context(prefixes, tie_s=rng.choice([1e-3, 0.0, 0.05]), room_wait_weight=room_wait_weight,
                       saturation_weight=saturation_weight, cached_queue_weight=rng.choice([1.0, 0.0, 0.3]),
                       held_request_tokens=rng.choice([0.0, 0.0, 37.0, 256.0]))
    index = PrefixDispatchIndex(config, context)
    loads = {}
    ids = [f"i{k}" for k in range(rng.randint(0, 30))]
    for iid in ids:
        _put(index, loads, rng, iid)
    for step in range(200):
        action = rng.random()
        if action < 0.3 and ids:  # a fresh report
            iid = rng.choice(ids)
            _put(index, loads, rng, iid)
        elif action < 0.35 and ids:  # an instance leaves
            gone = rng.choice(ids)
            index.remove(gone)
            ids.remove(gone)
            del loads[gone]
        elif action < 0.4:
            ids.append(f"j{step}")
            _put(index, loads, rng, ids[-1])
        holders = rng.sample(ids + ["unknown"], min(len(ids) + 1, rng.choice([0, 1, 2, 6])))
        prefixes.answer = {iid: rng.choice([0, 1, 2, 200]) for iid in holders}
        request = _random_request(rng, ids, step)
        expected = choose_by_predicted_ttft(list(loads.values()), request, config, context)
        assert index.choose(request) == expected
        if expected.instance_id is not None:  # the scheduler accounts what it dispatched
            _put(index, loads, rng, expected.instance_id, account_dispatch(loads[expected.instance_id], request))


def _put(index, loads, rng, iid, load=None):
    loads[iid] = load if load is not None else _random_load(rng, iid)
    index.put(loads[iid])
    return loads[iid]


def test_refusals_are_the_scans():
    index = PrefixDispatchIndex(PolicyConfig(), _context(StubIndex()))
    request = DispatchRequest(request_id="r", num_prompt_tokens=5000, max_tokens=16)
    assert index.choose(request).reason is Refusal.NO_INSTANCE
    index.put(make_load("a", max_model_len=4096))
    assert index.choose(request).reason is Refusal.TOO_LONG


def test_with_room_to_spare_a_decision_predicts_the_holders_and_a_few_of_the_rest():
    prefixes = StubIndex()
    context = _context(prefixes)
    index = PrefixDispatchIndex(PolicyConfig(), context)
    loads = [make_load(f"i{k:04d}", total=1000, running={0: (2, 100)}, waiting=[k % 50]) for k in range(1000)]
    for load in loads:
        index.put(load)
    prefixes.answer = {"i0700": 180, "i0333": 20}
    request = DispatchRequest(request_id="r", num_prompt_tokens=3000, max_tokens=16, block_hashes=[1],
                              prefix_block_size=16)
    predicted = []
    real = context.prefill_s
    counting = PrefixContext(prefixes, prefill_s=lambda n: predicted.append(n) or real(n))
    index.context = counting
    decision = index.choose(request)
    assert decision == choose_by_predicted_ttft(loads, request, PolicyConfig(), context)
    assert decision.instance_id == "i0700"  # its 2,880 cached tokens outweigh a queue of 0-49 blocks
    assert len(predicted) < 2 * 60, len(predicted)  # 2 holders + the shortest queues, not 1,000 instances
