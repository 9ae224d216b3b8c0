"""What runs in a child process between fork and exec (`preexec_fn`), for every Corral service that
starts others: `corral up` (services/supervisor.py) and the autoscaler's local provider."""

from __future__ import annotations

import ctypes
import signal
from collections.abc import Callable

from services.cpu_layout import keep_to

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the kernel sends the child SIGTERM when its parent dies, so a killed supervisor
    leaves no orphaned services (elsewhere: nothing, the child outlives it)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    """Between fork and exec: die with the parent, and keep to `cpus` (None: wherever)."""

    keep = keep_to(cpus)

    def setup() -> None:
        die_with_parent()
        if keep is not None:
            keep()

    return setup
