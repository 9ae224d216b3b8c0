"""The dispatch rule of a policy asked for by name (`--dispatch-policy`), over the live loads.

`corral` (the default) is not built here: the scheduler answers it from its ranked
`DispatchIndex`. Every other name of `shared.policy.baselines.POLICIES` runs the simulator's own
function (`baselines.dispatch`) over the load table, the prefix-aware ones (`corral-prefix`,
`prefix-only`, `kv-cost`) with the prefix index the llumlets' KV events keep
(`prefix_tracker`) and the latency model's prefill time; `corral-prefix` from a
`PrefixDispatchIndex` the load table keeps in step (the same answers, without predicting every
instance per request). Only the dispatch rule is taken from the name: migration stays as
`--enable-migration` says.

Prefix decisions are counted by reason: `cache_hit` (sent where the longest cached prefix is),
`load_over_cache` (a longer prefix is cached elsewhere, but the queue and room there lost),
`no_cache_hit` (no instance holds any of the prompt, or the prompt came without hashes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter

from shared.engine_model.latency import LatencyModel
from shared.instance_table import InstanceTable
from shared.messages import DispatchRequest, LoadReport
from shared.policy.baselines import POLICIES, DispatchRule, dispatch, get_policy
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import DispatchDecision
from shared.policy.prefix_dispatch import (
    DEFAULT_CACHED_QUEUE_WEIGHT, DEFAULT_HELD_REQUEST_TOKENS, DEFAULT_RECOMPUTE_WEIGHT, DEFAULT_ROOM_WAIT_WEIGHT,
    DEFAULT_SATURATION_WEIGHT,
    PrefixContext, PrefixIndex,
    matched_blocks,
)
from shared.policy.prefix_dispatch_index import PrefixDispatchIndex

DEFAULT_POLICY = "corral"
DISPATCH_POLICY_NAMES = tuple(POLICIES)
PREFIX_REASONS = ("cache_hit", "load_over_cache", "no_cache_hit")


class NamedDispatch:
    def __init__(self, name: str, base: PolicyConfig, loads: Callable[[], Sequence[LoadReport]],
                 index: PrefixIndex, gpu: str, registry: CollectorRegistry, table: InstanceTable | None = None,
                 recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT,
                 room_wait_weight: float = DEFAULT_ROOM_WAIT_WEIGHT,
                 saturation_weight: float = DEFAULT_SATURATION_WEIGHT,
                 cached_queue_weight: float = DEFAULT_CACHED_QUEUE_WEIGHT,
                 held_request_tokens: float = DEFAULT_HELD_REQUEST_TOKENS) -> None:
        self.policy = get_policy(name)
        self.config = self.policy.policy_config(base)
        self._loads = loads
        self._turn = 0
        model = LatencyModel(gpu)
        self.prefix = PrefixContext(index, prefill_s=lambda n: model.prefill_ms(n) / 1e3 if n > 0 else 0.0,
                                    recompute_weight=recompute_weight, room_wait_weight=room_wait_weight,
                                    saturation_weight=saturation_weight, cached_queue_weight=cached_queue_weight,
                                    held_request_tokens=held_request_tokens)
        # corral-prefix from loads kept by queued prefill, in step with `table` (without one: the scan).
        self.ttft_index: PrefixDispatchIndex | None = None
        if table is not None and self.policy.dispatch is DispatchRule.PREDICTED_TTFT:
            self.ttft_index = PrefixDispatchIndex(self.config, self.prefix)
            table.add_listener(self.ttft_index)
        self.prefix_decisions = Counter("corral:scheduler_prefix_dispatch_decisions",
                                        "Prefix-aware dispatch decisions by reason (cache_hit, load_over_cache, "
                                        "no_cache_hit)", ["reason"], registry=registry)
        for reason in PREFIX_REASONS:
            self.prefix_decisions.labels(reason)

    def choose(self, request: DispatchRequest) -> DispatchDecision:
        if self.ttft_index is not None:  # = dispatch(...) over self._loads()
            decision = self.ttft_index.choose(request)
        else:
            decision = dispatch(self.policy, self._loads(), request, self.config, self._turn, self.prefix)
        self._turn += 1
        if decision.instance_id is not None and self.policy.dispatch.uses_prefix_index:
            self.prefix_decisions.labels(self.reason(request, decision.instance_id)).inc()
        return decision

    def reason(self, request: DispatchRequest, chosen: str) -> str:
        matched = matched_blocks(request, self.prefix.index)
        best = max(matched.values(), default=0)
        if best == 0:
            return "no_cache_hit"
        return "cache_hit" if matched.get(chosen, 0) == best else "load_over_cache"
