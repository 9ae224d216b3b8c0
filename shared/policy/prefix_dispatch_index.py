"""Predicted-TTFT dispatch (`corral-prefix`) without predicting every instance per request: the
answer of `prefix_dispatch.choose_by_predicted_ttft` from loads kept sorted by the prefill queued
on them (issue 17 §3's "not a scan of every instance", for issue 18's rule).

An instance holding none of the request's prefix is ranked by `prefill_s(queued) +
prefill_s(prompt)` plus a recompute charge that is the same for all of them: among those, the
order is their queues' (`prefill_s` never decreases; the recompute charge's weight, raised while
every instance is queued, is one per decision: the pool's shortest queue). So a
decision ranks the holders the prefix index names (O(holders)), then walks the rest from the
shortest queue and stops at the first whose cost before any room wait's charge is past the tie
band of the best ranked so far (in the first class): nothing further can tie with it, since a
charge only adds. Under the strict tier (`PrefixContext.rooms_first`) instances without room rank
after any with room whatever their prediction, so with every instance short of room the walk is
the whole fleet, as the scan. The
walk passes over what the scan leaves out (excluded, too short a context, draining while another
serves). tests/unit/test_prefix_dispatch_index.py checks it against the scan on random fleets.
"""

from __future__ import annotations

from sortedcontainers import SortedList

from shared.messages import DispatchRequest, LoadReport
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import DispatchDecision, dispatchable, fits_model
from shared.policy.prefix_dispatch import (
    PrefixContext,
    TtftRank,
    least_prefill_s,
    matched_blocks,
    pick_predicted,
    recompute_weight_for,
    ttft_rank,
)


class PrefixDispatchIndex:
    def __init__(self, config: PolicyConfig, context: PrefixContext) -> None:
        self.config = config
        self.context = context
        self._loads: dict[str, LoadReport] = {}
        self._keys: dict[str, tuple[int, str]] = {}  # (queued prefill tokens, instance id)
        self._serving: SortedList = SortedList()  # instances not draining, shortest queue first
        self._draining: SortedList = SortedList()

    def __len__(self) -> int:
        return len(self._loads)

    def put(self, load: LoadReport) -> None:
        """An instance's new load (a report, or a dispatch accounted): O(log N)."""
        self.remove(load.instance_id)
        key = (self.context.queue_tokens(load), load.instance_id)
        self._keys[load.instance_id] = key
        self._loads[load.instance_id] = load
        (self._draining if load.draining else self._serving).add(key)

    def remove(self, instance_id: str) -> None:
        key = self._keys.pop(instance_id, None)
        if key is not None:
            load = self._loads.pop(instance_id)
            (self._draining if load.draining else self._serving).remove(key)

    def choose(self, request: DispatchRequest) -> DispatchDecision:
        excluded = set(request.exclude)

        def eligible(load: LoadReport) -> bool:
            return load.instance_id not in excluded and fits_model(load, request)

        pool = self._pool(eligible)
        if pool is None:  # none may take it: the scan's refusal (rare; O(N) is fine)
            refusal = dispatchable(list(self._loads.values()), request)
            assert isinstance(refusal, DispatchDecision), "the pool and the scan disagree on a candidate"
            return refusal
        draining = pool is self._draining
        matched = matched_blocks(request, self.context.index)
        least_s = least_prefill_s(request, self.context, matched)
        # The shortest queue the scan's min finds: the first instance of the pool it may take.
        shortest = next(queued for queued, iid in pool if eligible(self._loads[iid]))
        weight = recompute_weight_for(request, self.context, shortest)
        holders = {iid for iid, blocks in matched.items() if blocks > 0}
        ranked: list[TtftRank] = []
        best_first_class = float("inf")  # lowest cost among instances not behind the rooms
        for iid in holders:
            load = self._loads.get(iid)
            if load is not None and load.draining == draining and eligible(load):
                rank = ttft_rank(load, request, self.config, self.context, matched, least_s, weight)
                ranked.append(rank)
                if not rank.behind_rooms:
                    best_first_class = min(best_first_class, rank.cost_s)
        tie_s = self.context.ttft_tie_s
        for _, iid in pool:
            if iid in holders:
                continue
            load = self._loads[iid]
            if not eligible(load):
                continue
            rank = ttft_rank(load, request, self.config, self.context, matched, least_s, weight)
            if rank.uncharged_s > best_first_class + tie_s:
                break  # every later one costs more still: none ties with the best
            ranked.append(rank)
            if not rank.behind_rooms:
                best_first_class = min(best_first_class, rank.cost_s)
        return pick_predicted(ranked, request, self.config, self.context, matched)

    def _pool(self, eligible) -> SortedList | None:
        """The instances the scan would rank: those serving, or the draining ones when none serving may take it."""
        for ranking in (self._serving, self._draining):
            if any(eligible(self._loads[iid]) for _, iid in ranking):
                return ranking
        return None
