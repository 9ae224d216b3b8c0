"""The dispatch index answers exactly as the scan (`choose_instance`) on random tables."""

from __future__ import annotations

import random

import pytest

from shared.messages import DispatchRequest, Refusal
from shared.policy import PolicyConfig, account_dispatch, choose_instance
from shared.policy.dispatch_index import DispatchIndex
from tests.unit.policy_helpers import make_load


def _random_load(rng: random.Random, instance_id: str):
    total = rng.choice([64, 100, 1000])
    running = {}
    for priority in rng.sample([-1, 0, 1], rng.randint(0, 3)):
        running[priority] = (rng.randint(0, 4), rng.randint(0, total // 4))
    # Few distinct values, so that exact ties and ties within epsilon are common.
    waiting = [rng.choice([1, 2, 8]) for _ in range(rng.randint(0, 3))]
    return make_load(instance_id, total=total, running=running, waiting=waiting, draining=rng.random() < 0.2,
                     max_model_len=rng.choice([0, 512, 4096]), reserved=rng.choice([0, 0, 5]))


def _random_request(rng: random.Random, ids: list[str], i: int) -> DispatchRequest:
    exclude = rng.sample(ids, min(len(ids), rng.choice([0, 0, 1, 3])))
    return DispatchRequest(request_id=f"r{i}", num_prompt_tokens=rng.choice([10, 600, 5000]), max_tokens=16,
                           priority=rng.choice([-1, 0, 0]), exclude=exclude)


@pytest.mark.parametrize("seed", range(40))
def test_index_equals_scan_on_random_tables(seed):
    rng = random.Random(seed)
    config = PolicyConfig(tie_epsilon=rng.choice([1e-6, 0.5, 5.0]),
                          reject_below_freeness=rng.choice([None, None, 0.0, 3.0]))
    index = DispatchIndex(config)
    ids = [f"i{k}" for k in range(rng.randint(0, 30))]
    for iid in ids:
        index.put(_random_load(rng, iid))
    for step in range(200):
        action = rng.random()
        if action < 0.3 and ids:  # a fresh report
            index.put(_random_load(rng, rng.choice(ids)))
        elif action < 0.35 and ids:  # an instance leaves, another may come back later
            gone = rng.choice(ids)
            index.remove(gone)
            ids.remove(gone)
        elif action < 0.4:
            ids.append(f"j{step}")
            index.put(_random_load(rng, ids[-1]))
        request = _random_request(rng, ids, step)
        expected = choose_instance(index.loads_in_arrival_order(), request, config)
        assert index.choose(request) == expected
        if expected.instance_id is not None:  # the scheduler accounts what it dispatched
            chosen = next(l for l in index.loads_in_arrival_order() if l.instance_id == expected.instance_id)
            index.put(account_dispatch(chosen, request))


def test_empty_index_has_no_instance_and_too_long_is_named():
    index = DispatchIndex(PolicyConfig())
    request = DispatchRequest(request_id="r", num_prompt_tokens=5000, max_tokens=16)
    assert index.choose(request).reason is Refusal.NO_INSTANCE
    index.put(make_load("a", max_model_len=4096))
    assert index.choose(request).reason is Refusal.TOO_LONG


def test_draining_instance_only_when_no_other_may_take_it():
    index = DispatchIndex(PolicyConfig())
    index.put(make_load("busy", total=100, running={0: (4, 90)}))
    index.put(make_load("leaving", total=1000, draining=True))
    assert index.choose(DispatchRequest(request_id="r", num_prompt_tokens=10, max_tokens=1)).instance_id == "busy"
    only_leaving = DispatchRequest(request_id="r", num_prompt_tokens=10, max_tokens=1, exclude=["busy"])
    assert index.choose(only_leaving).instance_id == "leaving"
    index.remove("leaving")
    assert len(index) == 1


def test_table_keeps_the_index_in_step_through_reports_dispatches_and_expiry():
    from shared.instance_table import InstanceTable

    now = [0.0]
    rng = random.Random(7)
    index = DispatchIndex(PolicyConfig())
    table = InstanceTable(timeout_s=3.0, clock=lambda: now[0], listener=index)
    for step in range(300):
        now[0] += rng.choice([0.0, 0.1, 0.5, 1.0])
        table.update(_random_load(rng, f"i{rng.randint(0, 12)}"))
        request = _random_request(rng, [], step)
        table.expire()
        expected = choose_instance(table.live(), request, index.config)
        assert index.choose(request) == expected
        assert [l.instance_id for l in index.loads_in_arrival_order()] == [l.instance_id for l in table.live()]
        if expected.instance_id is not None:
            table.replace_load(account_dispatch(table.get(expected.instance_id), request))


def test_explicit_order_decides_which_of_equal_scores_is_the_best():
    """Equal dispatch scores, unequal freeness: the scan checks the rejection threshold on the
    first of the best in its list, so the index must rank ties in the caller's list order even
    when the instances first report in another (the simulator's instances that start serving)."""
    crowded = make_load("crowded", total=100, running={0: (2, 40)})  # room 60 over 2 requests
    queued = make_load("queued", total=100, running={0: (1, 30)}, waiting=[10])  # room 60 over 1 + 1 queued
    config = PolicyConfig(reject_below_freeness=45.0)  # crowded's freeness 30, queued's 60
    request = DispatchRequest(request_id="r", num_prompt_tokens=10, max_tokens=1)
    for listed in ([crowded, queued], [queued, crowded]):
        index = DispatchIndex(config)
        for load in reversed(listed):  # first put last
            index.put(load, order=listed.index(load))
        assert [l.instance_id for l in index.loads_in_arrival_order()] == [l.instance_id for l in listed]
        assert index.choose(request) == choose_instance(listed, request, config)
    assert choose_instance([crowded, queued], request, config).reason is Refusal.OVERLOADED
    assert choose_instance([queued, crowded], request, config).instance_id is not None
