"""Pure policy functions over instance snapshots, shared by the services, the simulator and tests."""

from shared.policy.config import HIGH_PRIORITY, NORMAL_PRIORITY, PolicyConfig, ScalingConfig
from shared.policy.dispatch import DispatchDecision, account_dispatch, blocks_for_tokens, choose_instance
from shared.policy.freeness import QueueDemand, freeness, request_virtual_usage, total_virtual_usage
from shared.policy.migration import MigrationCandidate, MigrationPair, pair_migrations, select_request_to_migrate
from shared.policy.scaling import ScaleAction, ScalingDecision, ScalingState, scaling_decision

# Last: the named policies build on the modules above.
from shared.policy.baselines import (  # noqa: E402
    POLICIES, POLICY_NAMES, DispatchRule, MigrationGuard, SchedulingPolicy, get_policy,
    guarded_pairs,
)

__all__ = [
    "HIGH_PRIORITY", "NORMAL_PRIORITY", "PolicyConfig", "ScalingConfig", "DispatchDecision",
    "account_dispatch", "blocks_for_tokens", "choose_instance", "QueueDemand", "freeness",
    "request_virtual_usage", "total_virtual_usage", "MigrationCandidate", "MigrationPair",
    "pair_migrations", "select_request_to_migrate", "ScaleAction", "ScalingDecision",
    "ScalingState", "scaling_decision", "POLICIES", "POLICY_NAMES", "DispatchRule", "MigrationGuard",
    "SchedulingPolicy", "get_policy", "guarded_pairs",
]
