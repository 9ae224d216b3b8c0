"""The scheduler's dispatch by policy name: the simulator's rules over the live loads, prefix-aware
ones reading the KV-event index, and their decisions counted by reason."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from services.global_scheduler.dispatcher import NamedDispatch
from shared.messages import DispatchRequest, KvCacheSnapshot
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import account_dispatch
from shared.policy.prefix_dispatch import (
    DEFAULT_CACHED_QUEUE_WEIGHT,
    DEFAULT_HELD_REQUEST_TOKENS,
    DEFAULT_SATURATION_WEIGHT,
)
from shared.prefix_index import GlobalPrefixIndex
from tests.unit.policy_helpers import make_load

CHAIN = list(range(1, 21))  # 20 blocks of 16 tokens


def request(rid: str, hashes=CHAIN) -> DispatchRequest:
    return DispatchRequest(rid, num_prompt_tokens=len(CHAIN) * 16 + 5, max_tokens=16,
                           block_hashes=list(hashes), prefix_block_size=16)


def reasons(dispatch: NamedDispatch) -> dict[str, float]:
    return {r: dispatch.prefix_decisions.labels(r)._value.get() for r in ("cache_hit", "load_over_cache", "no_cache_hit")}


def test_corral_prefix_sends_a_request_where_its_prefix_is_and_spreads_a_burst():
    loads = {iid: make_load(iid, total=400) for iid in ("a", "b", "c")}
    index = GlobalPrefixIndex()
    index.restore(KvCacheSnapshot("b", 0, 16, CHAIN))
    dispatch = NamedDispatch("corral-prefix", PolicyConfig(), lambda: list(loads.values()), index, "A10",
                             CollectorRegistry())
    chosen = []
    for i in range(6):  # a burst: each choice is accounted before the next, as the scheduler does
        req = request(f"r{i}")
        decision = dispatch.choose(req)
        chosen.append(decision.instance_id)
        loads[decision.instance_id] = account_dispatch(loads[decision.instance_id], req)
    assert chosen[0] == "b"
    assert set(chosen) == {"a", "b", "c"}, chosen  # the holder's queue grows: affinity does not pile
    counted = reasons(dispatch)
    assert counted["cache_hit"] == chosen.count("b") and counted["load_over_cache"] == 6 - chosen.count("b")
    dispatch.choose(request("cold", hashes=[99, 98]))
    assert reasons(dispatch)["no_cache_hit"] == 1


def test_round_robin_by_name_takes_the_instances_in_turn():
    loads = [make_load(iid) for iid in ("a", "b", "c")]
    dispatch = NamedDispatch("round-robin", PolicyConfig(), lambda: loads, GlobalPrefixIndex(), "A10",
                             CollectorRegistry())
    assert [dispatch.choose(request(f"r{i}")).instance_id for i in range(4)] == ["a", "b", "c", "a"]
    assert sum(reasons(dispatch).values()) == 0  # not a prefix-aware rule: nothing counted


def test_an_unknown_policy_name_is_refused():
    with pytest.raises(ValueError):
        NamedDispatch("fastest", PolicyConfig(), list, GlobalPrefixIndex(), "A10", CollectorRegistry())


def test_corral_prefix_on_a_load_table_answers_as_the_scan_over_it():
    import random

    from shared.instance_table import InstanceTable

    rng = random.Random(3)
    now = [0.0]
    table = InstanceTable(timeout_s=3.0, clock=lambda: now[0])
    index = GlobalPrefixIndex()
    for k in range(8):
        index.restore(KvCacheSnapshot(f"i{k}", 0, 16, CHAIN[: rng.randint(0, 20)]))
    indexed = NamedDispatch("corral-prefix", PolicyConfig(), table.live, index, "A10", CollectorRegistry(), table=table)
    scan = NamedDispatch("corral-prefix", PolicyConfig(), table.live, index, "A10", CollectorRegistry())
    assert indexed.ttft_index is not None and scan.ttft_index is None
    for step in range(300):
        now[0] += rng.choice([0.0, 0.1, 1.0])
        table.update(make_load(f"i{rng.randint(0, 9)}", total=400, running={0: (2, rng.randint(0, 300))},
                               waiting=[rng.choice([5, 21, 60]) for _ in range(rng.randint(0, 3))]))
        table.expire()
        req = request(f"r{step}", hashes=CHAIN[: rng.randint(0, 20)])
        decision = indexed.choose(req)
        assert decision == scan.choose(req)
        if decision.instance_id is not None:
            table.replace_load(account_dispatch(table.get(decision.instance_id), req))


def decided_with_flags(flags: list[str], loads, holder: str | None = "b"):
    """A scheduler built from `corral scheduler --dispatch-policy corral-prefix *flags`, its prefix
    index told that `holder` holds CHAIN and its table those loads: (its config, the instance its
    decision picks for a request on CHAIN, or on no hashes without a holder)."""
    from services.cli import build_parser
    from services.global_scheduler.config import config_from_args
    from services.global_scheduler.service import GlobalScheduler

    args = build_parser().parse_args(["scheduler", "--dispatch-policy", "corral-prefix", *flags])
    scheduler = GlobalScheduler(config_from_args(args))
    if holder is not None:
        scheduler.prefixes.index.restore(KvCacheSnapshot(holder, 0, 16, CHAIN))
    for load in loads:
        scheduler.table.update(load)
    return scheduler.config, scheduler.decide(request("r", hashes=CHAIN if holder else [])).instance_id


def refused_flag(flag: str, bad: str) -> int:
    from services.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["scheduler", flag, bad])
    return exit_info.value.code


def test_the_schedulers_recompute_weight_flag_reaches_corral_prefix():
    """`corral scheduler --dispatch-policy corral-prefix --prefix-recompute-weight W`: the scheduler
    built from those flags decides by that weight. With 0 a request leaves a holder whose queue
    outweighs its cached prefill; charged (the default), the prefill it would do again elsewhere
    keeps it there."""
    chosen = {}
    for weight in (["--prefix-recompute-weight", "0"], []):
        # The holder's queue: 400 tokens (110 ms on A10), more than its 320 cached tokens save (82 ms)
        # (its queued request counted by its blocks alone: no held-request tokens).
        flags = [*weight, "--prefix-held-request-tokens", "0"]
        config, chosen_id = decided_with_flags(flags, [make_load("a", total=400),
                                                        make_load("b", total=400, waiting=[25])])
        chosen[config.prefix_recompute_weight] = chosen_id
    assert chosen == {0.0: "a", 1.0: "b"}


def test_the_schedulers_room_wait_weight_flag_reaches_corral_prefix():
    """`--prefix-room-wait-weight W`: an instance a few blocks short of room with no queue takes
    the request by default (its wait for those blocks is charged), and `inf` keeps every instance
    with room first, behind whatever queue it has. A bad value is a clear usage error."""
    chosen = {}
    for weight in (["--prefix-room-wait-weight", "inf"], []):
        # "short": 21 blocks needed, 10 free and the headroom short; "roomy": 3,200 tokens queued.
        config, chosen_id = decided_with_flags(weight, [make_load("short", total=400, running={0: (4, 390)}),
                                                        make_load("roomy", total=4000, waiting=[200])], holder=None)
        chosen[config.prefix_room_wait_weight] = chosen_id
    assert chosen == {float("inf"): "roomy", 1.0: "short"}
    assert all(refused_flag("--prefix-room-wait-weight", bad) == 2 for bad in ("-1", "nan", "x"))


def test_the_schedulers_saturation_weight_flag_reaches_corral_prefix():
    """`--prefix-saturation-weight K`: with every instance queued, the recompute charge rises and
    a request stays with its prefix behind a queue it would leave with 0. A bad value is a clear
    usage error."""
    chosen = {}
    for weight in (["--prefix-saturation-weight", "0"], []):
        # The holder's queue is 800 tokens longer than a's 208: more than twice its cached prefill.
        config, chosen_id = decided_with_flags(weight, [make_load("a", total=4000, waiting=[13]),
                                                        make_load("b", total=4000, waiting=[13, 50])])
        chosen[config.prefix_saturation_weight] = chosen_id
    assert chosen == {0.0: "a", DEFAULT_SATURATION_WEIGHT: "b"}
    assert all(refused_flag("--prefix-saturation-weight", bad) == 2 for bad in ("-1", "nan", "inf", "x"))


def test_the_schedulers_cached_queue_weight_flag_reaches_corral_prefix():
    """`--prefix-cached-queue-weight B`: the holder's queue is ten prompts of its cached prefix
    (4,000 tokens in blocks, 250 to compute): counted whole the request goes to the idle
    instance; counting only what they compute (the default), it stays with its prefix (no held
    request counted). A bad value is a clear usage error."""
    import msgspec

    holder = msgspec.structs.replace(make_load("b", total=4000, waiting=[25] * 10), waiting_prefill_tokens=250)
    chosen = {}
    for weight in (["--prefix-cached-queue-weight", "1"], []):
        config, chosen_id = decided_with_flags([*weight, "--prefix-held-request-tokens", "0"],
                                               [make_load("a", total=4000), holder])
        chosen[config.prefix_cached_queue_weight] = chosen_id
    assert chosen == {0.0: "b", 1.0: "a"} and DEFAULT_CACHED_QUEUE_WEIGHT == 0.0
    assert all(refused_flag("--prefix-cached-queue-weight", bad) == 2 for bad in ("-1", "2", "nan", "x"))


def test_the_schedulers_held_request_tokens_flag_reaches_corral_prefix():
    """`--prefix-held-request-tokens R`: the holder queues ten prompts of its cached prefix (250
    tokens to compute). Counting only those, the request stays with its prefix; counting each
    queued request as 400 tokens more, it goes to the idle instance. A bad value is a clear
    usage error."""
    import msgspec

    holder = msgspec.structs.replace(make_load("b", total=4000, waiting=[25] * 10), waiting_prefill_tokens=250)
    idle = msgspec.structs.replace(make_load("a", total=4000), waiting_prefill_tokens=0)
    chosen = {}
    for tokens in ("0", "400"):
        flags = ["--prefix-cached-queue-weight", "0", "--prefix-held-request-tokens", tokens]
        config, chosen_id = decided_with_flags(flags, [idle, holder])
        chosen[config.prefix_held_request_tokens] = chosen_id
    assert chosen == {0.0: "b", 400.0: "a"}
    assert decided_with_flags([], [idle])[0].prefix_held_request_tokens == DEFAULT_HELD_REQUEST_TOKENS
    assert all(refused_flag("--prefix-held-request-tokens", bad) == 2 for bad in ("-1", "nan", "inf", "x"))
