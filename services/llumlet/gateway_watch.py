"""Which gateways went silent: their requests' tokens have no reader any more.

Every gateway publishes a heartbeat (services/gateway/control_channel.py). A gateway heard once and
then silent for `MISSED_BEATS` of its intervals (at least `MIN_SILENCE_S`) is gone: a killed
gateway never sends the aborts its clients' disconnects would have, so the llumlet aborts its
requests itself instead of decoding orphans. A gateway never heard (an older one, a test's
stand-in) is never judged. Silence while this llumlet is itself away from NATS means nothing:
`pause` restarts every clock when it reconnects. A gateway whose beats came late lately (starved
of CPU, not killed) is given longer (`shared.silence`), up to `MAX_SILENCE_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.silence import SilenceLimits

MISSED_BEATS = 4
MIN_SILENCE_S = 1.5  # a busy gateway's event loop may be late a beat or two: never abort a live one
MAX_SILENCE_S = 10.0  # however slow its beats were, a gateway silent this long is gone


class GatewayWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heard: dict[str, tuple[float, float]] = {}  # gateway id -> (last heartbeat, its interval)
        self._limits = SilenceLimits(clock)

    def heard(self, gateway_id: str, interval_s: float) -> None:
        self._heard[gateway_id] = (self._clock(), interval_s)
        self._limits.heard(gateway_id)

    def pause(self) -> None:
        """We hear nobody (NATS away): count silence only from now."""
        now = self._clock()
        self._heard = {g: (now, interval) for g, (_at, interval) in self._heard.items()}
        self._limits.restart()

    def limit_s(self, gateway_id: str, interval_s: float) -> float:
        base = max(MISSED_BEATS * interval_s, MIN_SILENCE_S)
        return self._limits.limit(gateway_id, base, max(base, MAX_SILENCE_S))

    def gone(self) -> list[str]:
        """Gateways silent past their limit since the last call (each reported once, then forgotten
        until it beats again)."""
        now = self._clock()
        gone = [g for g, (at, interval) in self._heard.items() if now - at > self.limit_s(g, interval)]
        for gateway_id in gone:
            del self._heard[gateway_id]
            self._limits.forget(gateway_id)
        return sorted(gone)
