"""`benchmarks/admission_live.py`'s request schedule: seeded bursts, and with
`--shared-prefix-tokens` every prompt opening with the same tokens."""

from __future__ import annotations

import argparse

from benchmarks.admission_live import square_wave


def args(shared: int) -> argparse.Namespace:
    return argparse.Namespace(seed=0, bursts=2, burst_size=5, gap_s=3.0, prompt_tokens=40, shared_prefix_tokens=shared)


def test_bursts_are_seeded_and_spaced_by_the_gap():
    schedule = square_wave(args(0), vocab=384)
    assert schedule == square_wave(args(0), vocab=384) and len(schedule) == 10
    assert all(0 <= t <= 0.2 for _, t in schedule[:5]) and all(3.0 <= t <= 3.2 for _, t in schedule[5:])
    assert len({tuple(p[:8]) for p, _ in schedule}) == 10  # unique prompts


def test_a_shared_prefix_opens_every_prompt():
    schedule = square_wave(args(32), vocab=384)
    prefixes = {tuple(p[:32]) for p, _ in schedule}
    assert len(prefixes) == 1 and all(len(p) == 40 for p, _ in schedule)
    assert len({tuple(p[32:]) for p, _ in schedule}) == 10
