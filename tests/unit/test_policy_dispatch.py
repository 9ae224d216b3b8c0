"""Dispatch: highest freeness, whole-queue demand, fair deterministic tie-break."""

from __future__ import annotations

from collections import Counter

from shared.messages import DispatchRequest
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import account_dispatch, choose_instance
from tests.unit.policy_helpers import make_load

CONFIG = PolicyConfig(headroom_blocks={})


def request(i: int = 0, prompt: int = 100, **kw) -> DispatchRequest:
    return DispatchRequest(request_id=f"req-{i}", num_prompt_tokens=prompt, max_tokens=16, **kw)


def test_picks_highest_freeness():
    loads = [make_load("a", running={0: (2, 80)}), make_load("b", running={0: (2, 20)})]
    assert choose_instance(loads, request(), CONFIG).instance_id == "b"


def test_whole_waiting_queue_counts_for_dispatch():
    # a's head is small but a burst waits behind it; b is busier in running terms only.
    a = make_load("a", total=100, running={0: (1, 10)}, waiting=[2, 30, 30, 30])
    b = make_load("b", total=100, running={0: (1, 40)})
    assert choose_instance([a, b], request(), CONFIG).instance_id == "b"


def test_ties_are_deterministic_and_spread_evenly():
    loads = [make_load(name) for name in ("a", "b", "c", "d")]
    picks = [choose_instance(loads, request(i), CONFIG).instance_id for i in range(4000)]
    counts = Counter(picks)
    assert set(counts) == {"a", "b", "c", "d"}
    assert max(counts.values()) < 1.15 * min(counts.values())
    assert picks == [choose_instance(list(reversed(loads)), request(i), CONFIG).instance_id for i in range(4000)]


def test_draining_instances_are_avoided_while_others_live():
    loads = [make_load("a", draining=True), make_load("b", running={0: (8, 90)})]
    assert choose_instance(loads, request(), CONFIG).instance_id == "b"


def test_no_instances_is_a_rejection():
    decision = choose_instance([], request(), CONFIG)
    assert decision.instance_id is None and decision.rejected


def test_prompt_longer_than_every_model_is_rejected():
    decision = choose_instance([make_load("a", max_model_len=64)], request(prompt=100), CONFIG)
    assert decision.instance_id is None and "max_model_len" in decision.rejected


def test_excluded_instances_are_skipped():
    loads = [make_load("a"), make_load("b", running={0: (2, 90)})]
    assert choose_instance(loads, request(exclude=["a"]), CONFIG).instance_id == "b"


def test_accounting_spreads_a_burst_between_reports():
    loads = {name: make_load(name, total=200) for name in ("a", "b", "c")}
    picks = []
    for i in range(30):
        decision = choose_instance(list(loads.values()), request(i, prompt=160), CONFIG)
        loads[decision.instance_id] = account_dispatch(loads[decision.instance_id], request(i, prompt=160))
        picks.append(decision.instance_id)
    assert Counter(picks) == {"a": 10, "b": 10, "c": 10}


def test_rejects_below_threshold_when_configured():
    config = PolicyConfig(headroom_blocks={}, reject_below_freeness=0.0)
    loads = [make_load("a", total=100, running={0: (1, 90)}, waiting=[50])]
    assert choose_instance(loads, request(), config).rejected == "all instances are overloaded"
