"""The vLLM adapter's per-request status: every transition it takes is asserted (no engine needed)."""

from __future__ import annotations

import pytest

from services.llumlet.engines.vllm.state import Suspended, Tracked, TrackedStatus


def _suspended() -> Suspended:
    return Suspended("r-internal", (1, 2), 40, 0, (7, 8))


def test_a_request_lives_queued_in_vllm_suspended_then_gone() -> None:
    tracked = Tracked("r", 0, 10)
    assert tracked.status is TrackedStatus.QUEUED and tracked.suspended is None
    tracked.move(TrackedStatus.IN_VLLM)
    tracked.move(TrackedStatus.SUSPENDED, _suspended())
    assert tracked.suspended is not None
    tracked.move(TrackedStatus.QUEUED)  # resumed after a failed last stage: re-added
    assert tracked.suspended is None
    tracked.move(TrackedStatus.IN_VLLM)
    tracked.move(TrackedStatus.GONE)


@pytest.mark.parametrize("path", [
    (TrackedStatus.SUSPENDED,),  # never added to vLLM
    (TrackedStatus.IN_VLLM, TrackedStatus.QUEUED),  # only a suspended request is re-queued
    (TrackedStatus.GONE, TrackedStatus.IN_VLLM),  # nothing comes back
])
def test_transitions_assert_where_they_start(path) -> None:
    tracked = Tracked("r", 0, 10)
    *allowed, refused = path
    for status in allowed:
        tracked.move(status, _suspended() if status is TrackedStatus.SUSPENDED else None)
    with pytest.raises(AssertionError):
        tracked.move(refused, _suspended() if refused is TrackedStatus.SUSPENDED else None)


def test_suspended_goes_with_its_record() -> None:
    tracked = Tracked("r", 0, 10)
    tracked.move(TrackedStatus.IN_VLLM)
    with pytest.raises(AssertionError):
        tracked.move(TrackedStatus.SUSPENDED)
