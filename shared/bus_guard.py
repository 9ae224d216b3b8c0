"""What a service does with a bus message it refuses: count it by subject and reason, and say so
in the log without letting a flood of them flood the log.

The refusal itself happens in `shared.messages.decode` (the schema and its bounds); this module is
the bookkeeping around it, shared by every service. The counter lives outside any one registry:
each service's metrics registry adds it (`register`), so `/metrics` of the gateway, scheduler and
llumlet all show `corral:bus_rejected_messages_total{subject, reason}`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from shared import subjects

BUS_REJECTED = Counter(
    "corral:bus_rejected_messages", "Bus messages refused at decode, by subject pattern and reason",
    ["subject", "reason"], registry=None,
)


def register(registry: CollectorRegistry) -> None:
    """Expose the counter on a service's registry (once per registry)."""
    try:
        registry.register(BUS_REJECTED)
    except ValueError:  # already there
        pass


class RateLimitedLog:
    """At most one record per key every `interval_s`; the next one says how many were held back."""

    def __init__(self, interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def allow(self, key: str) -> int | None:
        """None: stay quiet; else the number of records held back since the last one."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            if len(self._last) > 10_000:  # keys are subject patterns; bounded anyway
                self._last.clear()
            self._last[key] = now
            return self._held.pop(key, 0)

    def warning(self, log: logging.Logger, key: str, message: str, *args: object) -> None:
        held = self.allow(key)
        if held is None:
            return
        if held:
            log.warning(message + " (%d more like it not logged)", *args, held)
        else:
            log.warning(message, *args)


_log_limit = RateLimitedLog()


def rejected(subject: str, reason: str, detail: str, log: logging.Logger, what: str) -> None:
    """Count one refused message and log it (rate-limited per subject pattern and reason)."""
    pattern = subjects.pattern_of(subject)
    BUS_REJECTED.labels(subject=pattern, reason=reason).inc()
    _log_limit.warning(log, f"{pattern}/{reason}", "dropping a bad %s on %s (%s): %s", what, pattern, reason,
                       detail[:300])


def rejected_count(subject_pattern: str, reason: str | None = None) -> float:
    """The counter's value (tests, and anyone reading it without scraping)."""
    total = 0.0
    for metric in BUS_REJECTED.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("subject") == subject_pattern and (
                    reason is None or sample.labels.get("reason") == reason):
                total += sample.value
    return total
