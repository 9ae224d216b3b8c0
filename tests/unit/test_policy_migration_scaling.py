"""Migration pairing, request selection and the auto-scaling band."""

from __future__ import annotations

from shared.policy.config import PolicyConfig, ScalingConfig
from shared.policy.migration import MigrationCandidate, MigrationPair, pair_migrations, select_request_to_migrate
from shared.policy.scaling import ScaleAction, ScalingState, scaling_decision
from tests.unit.policy_helpers import make_load

CONFIG = PolicyConfig(headroom_blocks={}, migrate_out_freeness=1.0, migrate_in_freeness=10.0)


def test_pairs_lowest_source_with_highest_destination():
    loads = [
        make_load("busy", total=100, running={0: (10, 95)}),  # F = 0.5
        make_load("fragmented", total=100, running={0: (2, 50)}, waiting=[60]),  # F = -5
        make_load("idle", total=100),  # F = 100
        make_load("light", total=100, running={0: (2, 40)}),  # F = 30
    ]
    assert pair_migrations(loads, CONFIG, None) == [MigrationPair("fragmented", "idle"), MigrationPair("busy", "light")]


def test_no_pairs_inside_the_band():
    loads = [make_load("a", running={0: (10, 50)}), make_load("b", running={0: (10, 60)})]  # F = 5, 4
    assert pair_migrations(loads, CONFIG, None) == []


def test_draining_instance_is_a_source_never_a_destination():
    loads = [make_load("drain", running={0: (1, 1)}, draining=True), make_load("idle")]
    assert pair_migrations(loads, CONFIG, None) == [MigrationPair("drain", "idle")]


def test_selection_prefers_low_priority_then_short_sequences():
    candidates = [
        MigrationCandidate("high-short", priority=-1, num_tokens=10),
        MigrationCandidate("normal-long", priority=0, num_tokens=900),
        MigrationCandidate("normal-short", priority=0, num_tokens=100),
    ]
    assert select_request_to_migrate(candidates).request_id == "normal-short"
    assert select_request_to_migrate([]) is None


SCALING = ScalingConfig(scale_out_below=2.0, scale_in_above=40.0, sustain_s=5.0, cooldown_s=10.0,
                        min_instances=1, max_instances=3)


def test_scale_out_only_after_the_sustain_window():
    loads = [make_load("a", total=100, running={0: (10, 99)})]  # F = 0.1
    decision, state = scaling_decision(loads, ScalingState(), SCALING, now=0.0)
    assert decision.action is ScaleAction.NONE
    decision, state = scaling_decision(loads, state, SCALING, now=5.0)
    assert decision.action is ScaleAction.OUT
    decision, _ = scaling_decision(loads, state, SCALING, now=6.0)
    assert decision.action is ScaleAction.NONE  # cooling down


def test_scale_in_picks_the_instance_with_fewest_requests():
    loads = [make_load("a", running={0: (3, 10)}), make_load("b", running={0: (1, 1)})]
    decision, state = scaling_decision(loads, ScalingState(), SCALING, now=0.0)
    decision, _ = scaling_decision(loads, state, SCALING, now=5.0)
    assert (decision.action, decision.victim) == (ScaleAction.IN, "b")


def test_limits_bound_the_instance_count():
    full = [make_load(n, total=100, running={0: (10, 99)}) for n in "abc"]
    _, state = scaling_decision(full, ScalingState(), SCALING, now=0.0)
    assert scaling_decision(full, state, SCALING, now=5.0)[0].action is ScaleAction.NONE
    idle = [make_load("a")]
    _, state = scaling_decision(idle, ScalingState(), SCALING, now=0.0)
    assert scaling_decision(idle, state, SCALING, now=5.0)[0].action is ScaleAction.NONE


def test_leaving_the_band_resets_the_window():
    low = [make_load("a", total=100, running={0: (10, 99)})]
    mid = [make_load("a", total=100, running={0: (10, 50)})]
    _, state = scaling_decision(low, ScalingState(), SCALING, now=0.0)
    _, state = scaling_decision(mid, state, SCALING, now=3.0)
    decision, state = scaling_decision(low, state, SCALING, now=6.0)
    assert decision.action is ScaleAction.NONE
