"""When a built load report goes out: reports only on change, with a heartbeat (issue 17 §3).

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
