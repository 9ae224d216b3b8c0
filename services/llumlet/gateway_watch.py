"""Which gateways went silent: their requests' tokens have no reader any more.

Every gateway publishes a heartbeat (services/gateway/control_channel.py). A gateway heard once and
then silent for `MISSED_BEATS` of its intervals (at least `MIN_SILENCE_S`) is gone: a killed
gateway never sends the aborts its clients' disconnects would have, so the llumlet aborts its
requests itself instead of decoding orphans. A gateway never heard (an older one, a test's
stand-in) is never judged. Silence while this llumlet is itself away from NATS means nothing:
`pause` restarts every clock when it reconnects.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MISSED_BEATS = 4
MIN_SILENCE_S = 1.5  # a busy gateway's event loop may be late a beat or two: never abort a live one


class GatewayWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heard: dict[str, tuple[float, float]] = {}  # gateway id -> (last heartbeat, its interval)

    def heard(self, gateway_id: str, interval_s: float) -> None:
        self._heard[gateway_id] = (self._clock(), interval_s)

    def pause(self) -> None:
        """We hear nobody (NATS away): count silence only from now."""
        now = self._clock()
        self._heard = {g: (now, interval) for g, (_at, interval) in self._heard.items()}

    def gone(self) -> list[str]:
        """Gateways silent past their limit since the last call (each reported once, then forgotten
        until it beats again)."""
        now = self._clock()
        gone = [g for g, (at, interval) in self._heard.items() if now - at > max(MISSED_BEATS * interval, MIN_SILENCE_S)]
        for gateway_id in gone:
            del self._heard[gateway_id]
        return sorted(gone)
