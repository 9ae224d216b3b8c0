"""When a built load report goes out: reports only on change, with a heartbeat (issue 17 §3);
and when one is built ahead of the interval: after a step that moved the free blocks by a share
of the capacity (`blocks_moved`, the llumlet and the fleet simulator alike).

A llumlet builds a report every interval (50 ms). At 1,000 instances sending every one is 20,000
reports a second that each scheduler replica and gateway decodes, most of them, on a fleet with
idle or steady instances, saying again what the last one said. A report is sent when it says
something new (any field but its number and time), and otherwise once `heartbeat_s` has passed
since the last one sent: the receivers' sign that the instance lives (a gateway takes an instance
silent for 0.8 s for dead, `services.gateway.instances`; the schedulers' table drops one after
3 s). The same rule runs in the llumlet and in the control-plane benchmark's impersonated fleet.
"""

from __future__ import annotations

from msgspec.structs import replace

from shared.messages import LoadReport

DEFAULT_CHANGE_FRACTION = 0.05  # of the capacity: free blocks moved this much are reported at once
DEFAULT_HEARTBEAT_S = 0.25  # a fifth of the gateways' 0.8 s death limit: four lost beats in a row before it
MAX_HEARTBEAT_S = 0.5  # the most `--report-heartbeat-s` may be
# A receiver that has just subscribed (a scheduler, an autoscaler starting) has heard every live
# instance once this long has passed: before, an empty or partial table says nothing of the fleet.
RECEIVER_WARM_UP_S = MAX_HEARTBEAT_S + 0.1


def says_the_same(last_sent: LoadReport, report: LoadReport) -> bool:
    """Whether `report` carries nothing `last_sent` did not (its seq and time aside)."""
    return replace(report, seq=last_sent.seq, sent_at=last_sent.sent_at) == last_sent


def report_due(last_sent: LoadReport | None, report: LoadReport, since_sent_s: float, heartbeat_s: float) -> bool:
    """Whether to send `report`. `since_sent_s`: time since the last one sent (a monotonic clock's,
    so a wall-clock step cannot silence an instance); `heartbeat_s` 0 sends every report."""
    if heartbeat_s <= 0 or last_sent is None or since_sent_s >= heartbeat_s:
        return True
    return not says_the_same(last_sent, report)


def blocks_moved(last: LoadReport | None, num_free_blocks: int, num_blocks_total: int, fraction: float) -> bool:
    """After a step that produced tokens: whether the free blocks moved by `fraction` of the
    capacity since the last report built (then one is built and sent at once, not at the interval)."""
    return last is None or abs(last.num_blocks_free - num_free_blocks) >= max(1, int(num_blocks_total * fraction))
