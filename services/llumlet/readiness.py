"""When a llumlet should be counted as ready (its metrics port's `/ready`, a Kubernetes readiness
probe): its engine is loaded and its load reports reach NATS, and it is not draining. A draining
llumlet reports not ready on purpose: a ReplicaSet scaling in deletes not-ready pods first, so the
drained pod is the one that goes."""

from __future__ import annotations

from shared.messages import LoadReport


def not_ready_reason(last_report: LoadReport | None, draining: bool, nats_connected: bool,
                     report_interval_s: float, now: float) -> str | None:
    """None when ready; else why not, in words. `now` is wall-clock time, as `sent_at` is."""
    if last_report is None:
        return "starting: no load report yet (engine loading or NATS not reached)"
    if draining:
        return "draining"
    if not nats_connected:
        return "disconnected from NATS: load reports do not reach the scheduler"
    silent_s = now - last_report.sent_at
    if silent_s > max(2.0, 20 * report_interval_s):
        return f"last load report {silent_s:.1f} s ago"
    return None
