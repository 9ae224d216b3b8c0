"""How long a heartbeat sender's silence must last before it is taken for dead: a limit that grows
with the gaps seen from that sender lately.

Heartbeats (a gateway's, a llumlet's load reports) come late when their process is starved of CPU,
not only when it died: at load 10-12 on 2 cores live gateways and llumlets went 1-3 s between
beats, and a fixed limit took them for dead again and again — each false death aborting or
resuming every request they held, which loaded the machine further (the 30-minute soak). A sender
killed while its gaps were short is still judged at the base limit; one that has just been slow is
given `GAP_FACTOR` times its worst recent gap, that memory fading with `MEMORY_S`, and never more
than the cap.
"""

from __future__ import annotations

import math
from collections.abc import Callable

GAP_FACTOR = 2.0  # silent for twice its worst recent gap: a starved sender is slow, not gone
MEMORY_S = 10.0  # how fast a slow spell is forgotten (the worst gap decays by e every MEMORY_S)
WARM_UP_BEATS = 3  # a sender's first gaps (its start-up) say nothing of how late it runs


class SilenceLimits:
    def __init__(self, clock: Callable[[], float], factor: float = GAP_FACTOR, memory_s: float = MEMORY_S) -> None:
        assert factor > 0 and memory_s > 0
        self._clock = clock
        self.factor = factor
        self.memory_s = memory_s
        self._last: dict[str, float] = {}  # sender -> when it was last heard
        self._beats: dict[str, int] = {}  # sender -> beats heard, up to WARM_UP_BEATS
        self._worst: dict[str, tuple[float, float]] = {}  # sender -> (worst gap, when it was that)

    def heard(self, sender: str) -> None:
        now = self._clock()
        last = self._last.get(sender)
        self._last[sender] = now
        beats = self._beats.get(sender, 0)
        if beats < WARM_UP_BEATS:
            self._beats[sender] = beats + 1
        elif last is not None:
            gap = now - last
            if gap >= self._worst_gap(sender, now):
                self._worst[sender] = (gap, now)

    def restart(self) -> None:
        """Every clock from now (this side was away: a gap across it says nothing of the senders)."""
        now = self._clock()
        self._last = dict.fromkeys(self._last, now)

    def limit(self, sender: str, base_s: float, cap_s: float) -> float:
        """The silence after which `sender` is taken for dead: `base_s`, or more after slow beats."""
        assert 0 < base_s <= cap_s
        last = self._last.get(sender)  # (as of its last beat: the silence itself does not shorten it)
        worst = 0.0 if last is None else self._worst_gap(sender, last)
        return min(cap_s, max(base_s, self.factor * worst))

    def forget(self, sender: str) -> None:
        self._last.pop(sender, None)
        self._beats.pop(sender, None)
        self._worst.pop(sender, None)

    def _worst_gap(self, sender: str, now: float) -> float:
        worst = self._worst.get(sender)
        if worst is None:
            return 0.0
        gap, at = worst
        return gap * math.exp(-(now - at) / self.memory_s)
