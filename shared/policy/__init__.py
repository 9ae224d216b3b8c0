"""Pure policy functions over instance snapshots, shared by the services, the simulator and tests."""

from shared.policy.config import HIGH_PRIORITY, NORMAL_PRIORITY, PolicyConfig, ScalingConfig
from shared.policy.dispatch import DispatchDecision, account_dispatch, blocks_for_tokens, choose_instance
from shared.policy.freeness import QueueDemand, freeness, request_virtual_usage, total_virtual_usage
from shared.policy.migration import (
    MigrationCandidate, MigrationGuard, MigrationPair, StageRule, may_migrate_into, next_stage, pair_migrations,
    select_request_to_migrate,
)
from shared.policy.scaling import ScaleAction, ScalingDecision, ScalingState, scaling_decision

# Last: the named policies build on the modules above.
from shared.policy.baselines import POLICIES, POLICY_NAMES, DispatchRule, SchedulingPolicy, get_policy  # noqa: E402

__all__ = [
    "HIGH_PRIORITY", "NORMAL_PRIORITY", "PolicyConfig", "ScalingConfig", "DispatchDecision",
    "account_dispatch", "blocks_for_tokens", "choose_instance", "QueueDemand", "freeness",
    "request_virtual_usage", "total_virtual_usage", "MigrationCandidate", "MigrationGuard", "MigrationPair",
    "StageRule", "may_migrate_into", "next_stage", "pair_migrations", "select_request_to_migrate",
    "ScaleAction", "ScalingDecision", "ScalingState", "scaling_decision", "POLICIES", "POLICY_NAMES",
    "DispatchRule", "SchedulingPolicy", "get_policy",
]
