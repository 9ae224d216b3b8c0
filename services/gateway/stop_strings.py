"""Stop strings, matched on the detokenized text (the engine only knows stop token ids).

While streaming, the last `longest stop - 1` characters are held back: they may be the start of a
stop string, and text once sent cannot be taken back (vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include_stop_str_in_output
        longest = max((len(s) for s in self._stops), default=0)
        self._holdback = 0 if include_stop_str_in_output else max(longest - 1, 0)
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def append(self, delta: str) -> str:
        """Add new text; return what can be sent now. Sets `stopped` when a stop string appears."""
        assert not self.stopped, "no text after a stop string"
        searched_from = len(self.text)
        self.text += delta
        cut = self._first_stop(searched_from)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback)

    def finish(self) -> str:
        """Release the held-back text at the end of the request."""
        return self._take(len(self.text))

    def _first_stop(self, searched_from: int) -> int | None:
        """End of the output if a stop string occurs in the new text (or straddles into it)."""
        best: tuple[int, int] | None = None
        for stop in self._stops:
            at = self.text.find(stop, max(0, searched_from - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(stop))
        if best is None:
            return None
        return best[1] if self._include else best[0]

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out
