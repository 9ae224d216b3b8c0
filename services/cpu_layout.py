"""Which CPU cores each local process of `corral up` may run on, on a host whose engines run on CPU.

vLLM's CPU backend binds its worker to cores of its own and reserves a core for its front end
(`VLLM_CPU_OMP_THREADS_BIND=auto`, `reserved_cpus`): a busy engine that shares its core with the
front end loses a slice of every step to wake-ups. Corral's llumlet runs vLLM in process, so the
same rule applies per llumlet: each gets a contiguous slice of cores to itself, and the control
plane (gateway, scheduler, NATS) runs on the reserved rest. On a 2-core host it took the light-load
time per output token from 4.08 to 3.37 ms (`benchmarks/vllm_overhead.py`, same run; issue 3).

`plan_cpu_layout` is pure; `cpu_layout_decision` says whether `corral up` applies it and why not.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.config import env

LAYOUT_MODES = ("auto", "off")


@dataclass(frozen=True)
class CpuLayout:
    engines: tuple[frozenset[int], ...]  # one slice per llumlet, in launch order
    control: frozenset[int]  # gateway, scheduler, NATS (and anything else corral up starts)


def plan_cpu_layout(cpus: Sequence[int], num_engines: int, reserve: int = 1) -> CpuLayout | None:
    """Lowest cores to the engines in equal contiguous slices, the rest (at least `reserve`) to the
    control plane; None when the host has fewer than one core per engine plus `reserve`."""
    if num_engines < 1 or reserve < 1:
        raise ValueError(f"need at least one engine and one reserved core, got {num_engines} and {reserve}")
    ordered = sorted(set(cpus))
    per_engine = (len(ordered) - reserve) // num_engines
    if per_engine < 1:
        return None
    engines = tuple(frozenset(ordered[i * per_engine:(i + 1) * per_engine]) for i in range(num_engines))
    return CpuLayout(engines, frozenset(ordered[num_engines * per_engine:]))


def has_nvidia_gpu() -> bool:
    """The install script's test (`scripts/install_vllm.sh`): nvidia-smi lists a GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def resolve_engine(engine: str | None) -> str:
    """The engine a llumlet started without `--engine` picks (`CORRAL_ENGINE`, else vLLM when
    installed), without importing vLLM."""
    chosen = engine or env("ENGINE", None)
    if chosen:
        return chosen
    return "vllm" if importlib.util.find_spec("vllm") is not None else "sim"


@dataclass(frozen=True)
class LayoutDecision:
    layout: CpuLayout | None
    reason: str  # what was decided, for the log


def cpu_layout_decision(
    mode: str,
    engine: str,
    num_engines: int,
    autoscale: bool,
    cpus: Sequence[int],
    gpu: Callable[[], bool] = has_nvidia_gpu,
) -> LayoutDecision:
    if mode not in LAYOUT_MODES:
        raise ValueError(f"cpu layout must be one of {', '.join(LAYOUT_MODES)}, got {mode!r}")
    if mode == "off":
        return LayoutDecision(None, "cpu layout off")
    if engine != "vllm":
        return LayoutDecision(None, f"no cpu layout: the {engine} engine does not compute on the CPU")
    if autoscale:
        return LayoutDecision(None, "no cpu layout: the autoscaler changes the number of llumlets")
    layout = plan_cpu_layout(cpus, num_engines)
    if layout is None:
        return LayoutDecision(None, f"no cpu layout: {len(set(cpus))} cores for {num_engines} llumlets and the "
                                    "control plane (one core each at least)")
    if gpu():
        return LayoutDecision(None, "no cpu layout: the engines run on the GPU")
    slices = ", ".join(format_cpus(s) for s in layout.engines)
    return LayoutDecision(layout, f"cpu layout: llumlets on cores {slices}; control plane on {format_cpus(layout.control)}")


def format_cpus(cpus: frozenset[int]) -> str:
    """`taskset -c` notation for a contiguous slice (`0-3`), else a list (`0,2`)."""
    ordered = sorted(cpus)
    if len(ordered) > 1 and ordered[-1] - ordered[0] == len(ordered) - 1:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def keep_to(cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` that keeps a child to `cpus` (set before exec, so every thread it starts
    inherits them); None for None (the child runs anywhere)."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)
