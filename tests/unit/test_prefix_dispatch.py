"""Prefix-aware dispatch: predicted TTFT under the freeness guard, and the affinity baselines."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from msgspec.structs import replace

from shared.messages import DispatchRequest
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import account_dispatch, dispatch_score
from shared.policy.prefix_dispatch import (
    DEFAULT_HELD_REQUEST_TOKENS,
    DEFAULT_SATURATION_WEIGHT,
    PrefixContext,
    choose_by_predicted_ttft,
    choose_longest_prefix,
    choose_min_kv_cost,
    kv_cost,
    least_prefill_s,
    matched_blocks,
    missing_blocks,
    predicted_ttft_s,
    queued_prefill_tokens,
    recompute_weight_for,
    ttft_rank,
)
from shared.prefix_hash import block_hashes
from tests.unit.policy_helpers import make_load

CONFIG = PolicyConfig(headroom_blocks={})
BS = 16
SYSTEM = list(range(1000, 1000 + 40 * BS))  # a 640-token system prompt


class DictIndex:
    """Instance -> the set of block hashes it holds (what KV events would have told the index)."""

    def __init__(self, held: dict[str, set[int]]) -> None:
        self.held = held

    def matches(self, hashes) -> dict[str, int]:
        found = {}
        for instance_id, held in self.held.items():
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n:
                found[instance_id] = n
        return found


def prefill_s(tokens: int) -> float:  # a linear prefill model: 0.1 ms per token
    return tokens * 1e-4


def request(i: int, suffix_len: int = 32) -> DispatchRequest:
    tokens = SYSTEM + [i % 997 + 1] * suffix_len
    return DispatchRequest(f"req-{i}", len(tokens), 16, block_hashes=block_hashes(tokens, BS), prefix_block_size=BS)


def context(held: dict[str, set[int]], recompute_weight: float = 1.0, room_wait_weight: float = 1.0,
            saturation_weight: float = DEFAULT_SATURATION_WEIGHT,
            held_request_tokens: float = DEFAULT_HELD_REQUEST_TOKENS) -> PrefixContext:
    return PrefixContext(DictIndex(held), prefill_s, recompute_weight=recompute_weight,
                         room_wait_weight=room_wait_weight, saturation_weight=saturation_weight,
                         held_request_tokens=held_request_tokens)


SYSTEM_HASHES = set(block_hashes(SYSTEM, BS))


def dispatch_burst(choose, loads: dict, ctx: PrefixContext, num_requests: int) -> Counter:
    """Requests `request(0..n-1)` chosen one after another, each dispatch accounted on the
    chosen instance's load before the next (as the scheduler and simulator do): picks per instance."""
    picks = Counter()
    for i in range(num_requests):
        req = request(i)
        decision = choose(list(loads.values()), req, CONFIG, ctx)
        picks[decision.instance_id] += 1
        loads[decision.instance_id] = account_dispatch(loads[decision.instance_id], req, decision.cached_tokens)
    return picks


def test_equal_loads_go_to_the_instance_holding_the_prefix():
    loads = [make_load(n, total=1000) for n in ("a", "b", "c")]
    ctx = context({"b": SYSTEM_HASHES})
    assert {choose_by_predicted_ttft(loads, request(i), CONFIG, ctx).instance_id for i in range(50)} == {"b"}
    ttft_a, ttft_b = (predicted_ttft_s(load, request(0), ctx) for load in loads[:2])
    assert ttft_b < ttft_a and abs((ttft_a - ttft_b) - 640 * 1e-4) < 1e-9  # the cached prefill saved


def test_a_queue_ahead_outweighs_the_cached_prefix():
    cached = make_load("a", total=1000, waiting=[200])  # 3,200 tokens of prefill queued ahead
    empty = make_load("b", total=1000)
    ctx = context({"a": SYSTEM_HASHES})
    assert choose_by_predicted_ttft([cached, empty], request(1), CONFIG, ctx).instance_id == "b"
    assert choose_longest_prefix([cached, empty], request(1), CONFIG, ctx).instance_id == "a"  # affinity piles


def test_prefill_done_again_elsewhere_is_charged_once_more_than_the_requests_own_ttft():
    # The holder's queue (800 tokens, 80 ms) costs more than its cached prefix saves (640 tokens,
    # 64 ms): on its own TTFT the request would go to the idle instance and compute the prefix
    # again there, work that also delays whoever queues behind it. Charged once more, it stays.
    holder = make_load("a", total=1000, waiting=[50])
    idle = make_load("b", total=1000)
    for weight, chosen in ((0.0, "b"), (1.0, "a")):
        ctx = context({"a": SYSTEM_HASHES}, recompute_weight=weight)
        assert choose_by_predicted_ttft([holder, idle], request(3), CONFIG, ctx).instance_id == chosen, weight
    # A queue past the prefix's prefill counted twice (1,600 tokens) sends it away again.
    busier = make_load("a", total=1000, waiting=[110])
    assert choose_by_predicted_ttft([busier, idle], request(3), CONFIG, context({"a": SYSTEM_HASHES})).instance_id == "b"


def test_the_charge_is_what_an_instance_computes_beyond_the_best_holder():
    half = set(list(block_hashes(SYSTEM, BS))[:20])
    ctx = context({"a": SYSTEM_HASHES, "b": half})
    loads = {n: make_load(n, total=1000) for n in "abc"}
    req = request(4)
    matched = matched_blocks(req, ctx.index)
    least = least_prefill_s(req, ctx, matched)
    cost = {n: ttft_rank(load, req, CONFIG, ctx, matched, least).cost_s for n, load in loads.items()}
    own = {n: predicted_ttft_s(load, req, ctx) for n, load in loads.items()}
    assert cost["a"] == own["a"]  # the best holder pays nothing more
    assert abs((cost["b"] - own["b"]) - 320 * 1e-4) < 1e-9  # the 320 tokens it lacks, once more
    assert abs((cost["c"] - own["c"]) - 640 * 1e-4) < 1e-9
    # Without a cached prefix anywhere nobody is charged.
    cold = request(5)
    nothing = context({})
    assert ttft_rank(loads["c"], cold, CONFIG, nothing, {}, least_prefill_s(cold, nothing, {})).cost_s == \
        predicted_ttft_s(loads["c"], cold, nothing)


def test_a_recompute_weight_that_is_not_a_finite_non_negative_number_is_refused():
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            context({}, recompute_weight=bad)


def test_under_the_strict_tier_an_instance_without_room_loses_to_one_with_room_whatever_it_caches():
    full = make_load("a", total=100, running={0: (4, 98)})  # holds the prefix, two blocks free
    roomy = make_load("b", total=200, running={0: (4, 60)}, waiting=[30])  # room for all 43 blocks
    ctx = context({"a": SYSTEM_HASHES}, room_wait_weight=math.inf)
    assert predicted_ttft_s(full, request(2), ctx) < predicted_ttft_s(roomy, request(2), ctx)
    assert choose_by_predicted_ttft([full, roomy], request(2), CONFIG, ctx).instance_id == "b"


def test_an_instance_without_room_is_charged_the_prefill_of_the_tokens_its_missing_blocks_hold():
    # "a" lacks blocks for the 672-token prompt (43 blocks needed, 10 free); "b" has room.
    short = make_load("a", total=100, running={0: (4, 90)})
    roomy = make_load("b", total=200, running={0: (4, 60)})
    for weight in (0.0, 1.0, 2.5):
        ctx = context({}, room_wait_weight=weight)
        least = least_prefill_s(request(2), ctx, {})
        rank_a, rank_b = (ttft_rank(load, request(2), CONFIG, ctx, {}, least) for load in (short, roomy))
        assert missing_blocks(short, dispatch_score(short, CONFIG.headroom_blocks), 43) == 33
        assert rank_a.cost_s == pytest.approx(predicted_ttft_s(short, request(2), ctx) + weight * prefill_s(33 * BS))
        assert rank_b.cost_s == pytest.approx(predicted_ttft_s(roomy, request(2), ctx))
        assert not rank_a.behind_rooms and not rank_b.behind_rooms
    # With room, a queue that costs more than the missing blocks' wait loses; one that costs less wins
    # (the queue counted by its blocks alone: no held-request tokens).
    ctx = context({}, held_request_tokens=0)
    assert choose_by_predicted_ttft([short, make_load("b", total=2000, waiting=[40])], request(2), CONFIG,
                                    ctx).instance_id == "a"  # 640 queued tokens against 528 missing
    assert choose_by_predicted_ttft([short, make_load("b", total=2000, waiting=[30])], request(2), CONFIG,
                                    ctx).instance_id == "b"


def test_the_recompute_charge_rises_only_while_every_instance_has_a_queue():
    req = request(0)  # 672 tokens (67.2 ms of prefill), 640 of them cached where the prefix is
    ctx = context({})
    assert recompute_weight_for(req, ctx, 0) == ctx.recompute_weight == 1.0  # an idle instance: as before
    # The shortest queue, 336 tokens, is half the request's own prefill.
    assert recompute_weight_for(req, ctx, 336) == pytest.approx(1.0 + DEFAULT_SATURATION_WEIGHT * 0.5)
    assert recompute_weight_for(req, context({}, recompute_weight=2.0), 336) == pytest.approx(
        2.0 * (1.0 + DEFAULT_SATURATION_WEIGHT * 0.5))
    assert recompute_weight_for(req, context({}, saturation_weight=0.0), 336) == 1.0
    assert recompute_weight_for(req, context({}, recompute_weight=0.0), 336) == 0.0
    with pytest.raises(ValueError, match="saturation weight"):
        context({}, saturation_weight=-1.0)
    # The holder's queue is 200 ms longer than the other instance's (51.2 ms): unraised, the
    # prefill done again there (64 ms, charged twice) costs less, and the request leaves its
    # prefix; with every instance queued the charge rises and keeps it there. An idle instance
    # anywhere takes it at the charge as before.
    holder, other = make_load("h", total=2000, waiting=[32, 125]), make_load("o", total=2000, waiting=[32])
    held = {"h": SYSTEM_HASHES}
    assert choose_by_predicted_ttft([holder, other], req, CONFIG, context(held, saturation_weight=0.0)).instance_id \
        == "o"
    assert choose_by_predicted_ttft([holder, other], req, CONFIG, context(held)).instance_id == "h"
    assert choose_by_predicted_ttft([holder, other, make_load("c", total=2000)], req, CONFIG,
                                    context(held)).instance_id == "c"


@pytest.mark.parametrize("weight", [1.0, math.inf])
def test_a_burst_is_not_piled_onto_the_last_instance_with_room(weight):
    # Seven instances a few blocks short, with short queues; one with room and a long queue (the
    # simulated A100 fleet at saturation). The strict tier sends the whole burst behind that
    # queue; the room wait's charge spreads it, and each instance's missing blocks grow with what
    # it is sent, so the short ones are not piled either.
    loads = {f"i{k}": make_load(f"i{k}", total=1000, running={0: (20, 995)}) for k in range(7)}
    loads["roomy"] = make_load("roomy", total=4000, running={0: (20, 900)}, waiting=[200] * 3)
    picks = dispatch_burst(choose_by_predicted_ttft, loads, context({}, room_wait_weight=weight), 16)
    if math.isinf(weight):
        assert picks == {"roomy": 16}
    else:
        assert len(picks) >= 6 and max(picks.values()) <= 4, picks


def test_one_dominant_system_prompt_is_spread_not_piled():
    # Every request shares the system prompt; one instance holds it. Dispatches between two
    # reports are accounted (as the scheduler and simulator do): corral-prefix spreads the burst
    # once the holder's queue costs more than the cached prefill saves, prefix-only piles it all.
    ctx = context({"i0": SYSTEM_HASHES})
    for choose, piles in ((choose_by_predicted_ttft, False), (choose_longest_prefix, True)):
        loads = {n: make_load(n, total=2000) for n in (f"i{k}" for k in range(8))}
        picks = dispatch_burst(choose, loads, ctx, 64)
        if piles:
            assert picks == {"i0": 64}
        else:
            assert len(picks) == 8 and max(picks.values()) <= 2 * 64 / 8, picks


def test_kv_cost_is_dynamos_prefill_plus_decode_blocks():
    load = make_load("a", total=1000, running={0: (3, 120)}, waiting=[10])
    req = request(3, suffix_len=32)  # 672 tokens = 42 blocks, 40 of them cached
    assert kv_cost(load, req, context({"a": SYSTEM_HASHES})) == (10 + 2) + 120
    assert kv_cost(load, req, context({})) == (10 + 42) + 120
    busy_cached = make_load("a", total=1000, running={0: (3, 120)})
    idle = make_load("b", total=1000, running={0: (1, 100)})
    assert choose_min_kv_cost([busy_cached, idle], req, CONFIG, context({"a": SYSTEM_HASHES})).instance_id == "a"
    assert choose_min_kv_cost([busy_cached, idle], req, CONFIG, context({})).instance_id == "b"


def test_requests_without_hashes_fall_back_to_load():
    loads = [make_load("a", total=100, running={0: (2, 80)}), make_load("b", total=100, running={0: (2, 20)})]
    plain = DispatchRequest("r", 100, 16)
    ctx = context({"a": SYSTEM_HASHES})
    assert choose_by_predicted_ttft(loads, plain, CONFIG, ctx).instance_id == "b"
    assert choose_longest_prefix(loads, plain, CONFIG, ctx).instance_id == "b"


def test_a_queue_of_cached_prompts_counts_only_their_uncached_prefill():
    # Ten prompts queued on the holder, each the 640-token system prompt and 32 tokens more: in
    # blocks that is 430 blocks, 6,880 tokens, 0.69 s ahead; in the tokens they will prefill with
    # the prompt cached there, 330 (33 ms). Counting only those (cached queue weight 0, no held
    # requests counted), the holder keeps the request; counting the cached prefixes whole (all an
    # instance that does not tell the tokens allows), it goes to the idle instance.
    blocks_only = make_load("a", total=10_000, waiting=[43] * 10)
    told = replace(blocks_only, waiting_prefill_tokens=10 * 33)
    idle = make_load("b", total=10_000)
    assert queued_prefill_tokens(blocks_only) == queued_prefill_tokens(told) == 430 * BS
    assert queued_prefill_tokens(blocks_only, 0.0) == 430 * BS  # untold: whole blocks whatever the weight
    assert queued_prefill_tokens(told, 0.0) == 330 and queued_prefill_tokens(told, 0.5) == 330 + 3275
    for weight, chosen in ((1.0, "b"), (0.0, "a")):
        ctx = PrefixContext(DictIndex({"a": SYSTEM_HASHES}), prefill_s, cached_queue_weight=weight,
                            held_request_tokens=0)
        assert choose_by_predicted_ttft([blocks_only, idle], request(5), CONFIG, ctx).instance_id == "b"
        assert choose_by_predicted_ttft([told, idle], request(5), CONFIG, ctx).instance_id == chosen, weight
    # Admitted prompts' prefill still to do counts beside it (in blocks: it is uncached already).
    assert queued_prefill_tokens(replace(told, committed_blocks=2), 0.0) == 330 + 2 * BS
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError):
            PrefixContext(DictIndex({}), prefill_s, cached_queue_weight=bad)


def test_each_request_held_or_queued_counts_as_prefill_whether_the_instance_tells_tokens_or_not():
    # Two running and ten queued on the holder: at 256 tokens each, 3,072 more than their 330
    # uncached tokens; an instance that does not tell its waiting prefill keeps whole blocks, and
    # its requests count alike (else a mixed fleet reads the untold ones as emptier whenever they
    # hold more than they queue: 1.17x P99 TTFT on simulated A100s, 2026-12-02).
    blocks_only = make_load("a", total=10_000, running={0: (2, 100)}, waiting=[43] * 10)
    told = replace(blocks_only, waiting_prefill_tokens=10 * 33)
    assert queued_prefill_tokens(told, 0.0, 256) == 330 + 12 * 256
    assert queued_prefill_tokens(told, 1.0, 256) == 430 * BS + 12 * 256
    assert queued_prefill_tokens(blocks_only, 0.0, 256) == 430 * BS + 12 * 256
    assert queued_prefill_tokens(blocks_only, 0.0, 0) == queued_prefill_tokens(blocks_only) == 430 * BS
    ctx = PrefixContext(DictIndex({}), prefill_s, cached_queue_weight=0.0, held_request_tokens=256)
    assert ctx.queue_tokens(told) == 330 + 12 * 256
    with pytest.raises(ValueError):
        PrefixContext(DictIndex({}), prefill_s, held_request_tokens=-1)


def test_counting_held_requests_spreads_a_burst_that_uncached_prefill_alone_piles():
    # A burst onto the one holder of a system prompt, no report between: counting only what the
    # queued prompts compute (32 tokens each), the holder takes every request; counting each
    # request it holds as prefill too, the others take a share. Fewer still with no rise of the
    # recompute charge (a held request makes an instance count as queued, and the charge rises).
    def holder_picks(tokens: float, saturation_weight: float = DEFAULT_SATURATION_WEIGHT) -> int:
        loads = {n: replace(make_load(n, total=1000), waiting_prefill_tokens=0) for n in "abcdefgh"}
        ctx = PrefixContext(DictIndex({"a": SYSTEM_HASHES}), prefill_s, cached_queue_weight=0.0,
                            held_request_tokens=tokens, saturation_weight=saturation_weight)
        return dispatch_burst(choose_by_predicted_ttft, loads, ctx, 24)["a"]

    assert holder_picks(0) == 24
    assert holder_picks(256) <= 17
    assert holder_picks(256, saturation_weight=0.0) <= 10


def test_a_mixed_fleet_of_told_and_untold_instances_shares_a_burst():
    # Four instances tell their waiting prefill, four do not (no prefix cache, an older llumlet);
    # each runs 6 requests, none holds the prompt. Requests held count alike on both, so neither
    # kind reads emptier and a burst spreads over all eight; had they counted only where told,
    # the untold four would take the first 8 of 8 (12 of 16).
    for num_requests in (8, 16):
        loads = {n: make_load(n, total=1000, running={0: (6, 300)}) for n in "abcdefgh"}
        for n in "abcd":
            loads[n] = replace(loads[n], waiting_prefill_tokens=0)
        picks = dispatch_burst(choose_by_predicted_ttft, loads, context({}), num_requests)
        assert sum(picks[n] for n in "abcd") == sum(picks[n] for n in "efgh") == num_requests // 2, picks


def test_a_dispatch_counts_into_the_queue_the_prefill_it_will_do_there():
    holder = replace(make_load("a", total=1000), waiting_prefill_tokens=0)
    idle = replace(make_load("b", total=1000), waiting_prefill_tokens=0)
    ctx = context({"a": SYSTEM_HASHES})
    req = request(6)  # 640 cached tokens on "a", 32 more
    for choose in (choose_by_predicted_ttft, choose_longest_prefix, choose_min_kv_cost):
        decision = choose([holder, idle], req, CONFIG, ctx)
        assert (decision.instance_id, decision.cached_tokens) == ("a", 640), choose.__name__
    after = account_dispatch(holder, req, 640)
    assert after.waiting_prefill_tokens == 32 and after.waiting_demand_blocks == 43  # every block is claimed
    assert account_dispatch(idle, req).waiting_prefill_tokens == 672
    # An instance that does not tell it stays untold (its demand's blocks stand in).
    assert account_dispatch(make_load("c", total=1000), req, 640).waiting_prefill_tokens is None
    # At least the last token is prefilled, however much is cached (as the engines do).
    assert account_dispatch(idle, req, 10_000).waiting_prefill_tokens == 1
    # A dispatch to an instance holding none of the prompt counts the whole prompt there.
    assert choose_by_predicted_ttft([idle], req, CONFIG, ctx).cached_tokens == 0
