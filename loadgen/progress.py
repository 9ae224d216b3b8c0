"""Progress of a long phase (preparing prompts, sending requests) on stderr.

On a terminal it is a tqdm bar; elsewhere (a pipe, a log file, CI) a plain line every
`interval_s` seconds and one when the phase ends, so a log shows the run is alive without
carriage-return noise. "off" prints nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Literal

from tqdm import tqdm

ProgressMode = Literal["bar", "lines", "off"]
PROGRESS_MODES: tuple[ProgressMode, ...] = ("bar", "lines", "off")
DEFAULT_INTERVAL_S = 10.0


def choose_mode(disabled: bool, stream: IO[str] | None = None) -> ProgressMode:
    """A bar when progress goes to a terminal, periodic lines when it does not."""
    if disabled:
        return "off"
    stream = stream or sys.stderr
    return "bar" if stream.isatty() else "lines"


def note(mode: ProgressMode, text: str, stream: IO[str] | None = None) -> None:
    """A one-off status line ("loading tokenizer ...") unless progress is off."""
    if mode != "off":
        print(f"loadgen: {text}", file=stream or sys.stderr, flush=True)


class Progress:
    """Counts finished items of one phase; `counts` (e.g. failed, rejected) ride along."""

    def __init__(
        self,
        phase: str,
        total: int,
        mode: ProgressMode,
        *,
        unit: str = "req",
        interval_s: float = DEFAULT_INTERVAL_S,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert mode in PROGRESS_MODES, mode
        self.phase, self.total, self.mode, self.unit = phase, total, mode, unit
        self.done = 0
        self.counts: dict[str, int] = {}
        self._stream = stream or sys.stderr
        self._clock = clock
        self._interval_s = interval_s
        self._started = self._last_line = clock()
        self._bar = tqdm(total=total, desc=phase, unit=unit, file=self._stream) if mode == "bar" else None

    def advance(self, n: int = 1, **counts: int) -> None:
        self.done += n
        for name, add in counts.items():
            self.counts[name] = self.counts.get(name, 0) + add
        if self._bar is not None:
            self._bar.update(n)
            if counts:
                self._bar.set_postfix(self._nonzero_counts(), refresh=False)
        self.tick()

    def tick(self) -> None:
        """In "lines" mode, a line when `interval_s` has passed since the last one: call it from a
        timer too, so a phase whose items take long still shows it is alive."""
        if self.mode == "lines" and self._clock() - self._last_line >= self._interval_s:
            self._print_line()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines":
            self._print_line(final=True)

    def line(self, final: bool = False) -> str:
        """`loadgen: sending: 120/1000 req (12%), 3 failed, after 14 s`."""
        percent = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        extras = "".join(f", {count} {name}" for name, count in self._nonzero_counts().items())
        when = "done in" if final else "after"
        elapsed = self._clock() - self._started
        return f"loadgen: {self.phase}: {self.done}/{self.total} {self.unit}{percent}{extras}, {when} {elapsed:.0f} s"

    def _print_line(self, final: bool = False) -> None:
        print(self.line(final), file=self._stream, flush=True)
        self._last_line = self._clock()

    def _nonzero_counts(self) -> dict[str, int]:
        return {name: count for name, count in self.counts.items() if count}
