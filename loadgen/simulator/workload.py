"""The requests a simulation replays: lengths from a dataset, arrival times, priority flags.

All of it comes from loadgen's own dataset, arrival and priority code, so a simulated workload
is the one `loadgen run` would send for the same arguments and seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loadgen.arrivals import arrival_times, priority_flags
from loadgen.datasets import load_dataset, parse_dataset_spec
from loadgen.errors import LoadgenError
from shared.policy.config import HIGH_PRIORITY, NORMAL_PRIORITY


@dataclass(frozen=True)
class SimArrival:
    index: int
    time_s: float
    prompt_len: int
    output_len: int
    priority: int  # as labelled (HIGH_PRIORITY or NORMAL_PRIORITY); a policy may ignore it
    hash_ids: tuple[int, ...] = ()  # the trace's prefix blocks (loadgen.datasets.PREFIX_BLOCK_TOKENS)


@dataclass(frozen=True)
class Workload:
    arrivals: list[SimArrival]
    description: str
    num_truncated: int = 0  # prompts cut to fit the instances' maximum sequence length

    @property
    def duration_s(self) -> float:
        return self.arrivals[-1].time_s if self.arrivals else 0.0


@dataclass(frozen=True)
class WorkloadSpec:
    dataset: str
    num_requests: int | None = None
    rate: float | None = None  # requests/s; with trace timestamps: rescale the trace to this mean
    cv: float = 1.0
    trace_timestamps: bool = False
    time_scale: float = 1.0
    priority_fraction: float = 0.0
    default_output_len: int = 256  # for datasets without output lengths
    seed: int = 0

    def with_rate(self, rate: float) -> WorkloadSpec:
        return replace(self, rate=rate)


def build_workload(spec: WorkloadSpec, max_seq_len: int) -> Workload:
    """Raises LoadgenError on bad input (unknown dataset, no way to time the arrivals, ...)."""
    dataset = parse_dataset_spec(spec.dataset)
    if spec.default_output_len < 1:
        raise LoadgenError("default output length must be >= 1")
    if spec.rate is not None and not spec.rate > 0:
        raise LoadgenError(f"request rate must be > 0, got {spec.rate}")
    if not spec.cv > 0:
        raise LoadgenError(f"CV must be > 0, got {spec.cv}")
    if spec.trace_timestamps and not dataset.has_timestamps:
        raise LoadgenError(f"dataset {spec.dataset!r} has no timestamps to replay")
    if not spec.trace_timestamps and spec.rate is None:
        raise LoadgenError("give a request rate (--rate/--rates) or replay the trace's timestamps")
    requests = load_dataset(dataset, num_requests=spec.num_requests, seed=spec.seed)
    n = len(requests)
    times = _times(spec, [r.timestamp_s for r in requests], n)
    try:
        flags = priority_flags(n, spec.priority_fraction, spec.seed)
    except ValueError as exc:
        raise LoadgenError(str(exc)) from None
    arrivals, truncated = [], 0
    for i, (request, time_s, high) in enumerate(zip(requests, times, flags)):
        prompt = request.input_len
        if prompt + 1 > max_seq_len:  # the engine refuses a prompt that leaves no room for a token
            prompt, truncated = max_seq_len - 1, truncated + 1
        output = request.output_len if request.output_len else spec.default_output_len
        arrivals.append(SimArrival(i, time_s, prompt, output, HIGH_PRIORITY if high else NORMAL_PRIORITY,
                                   tuple(request.hash_ids)))
    # Simultaneous arrivals: higher scheduling priority is dispatched first.
    arrivals.sort(key=lambda a: (a.time_s, a.priority, a.index))
    description = _describe(spec)
    if truncated:
        description += f" ({truncated} prompts cut to {max_seq_len - 1} tokens)"
    return Workload(arrivals, description, truncated)


def _times(spec: WorkloadSpec, stamps: list[float | None], n: int) -> list[float]:
    try:
        if spec.trace_timestamps:
            times = arrival_times("trace", n, trace_timestamps=stamps, time_scale=spec.time_scale)
            if spec.rate is not None and n > 1 and times[-1] > 0:
                # Keep the trace's burstiness, rescaled to the requested mean rate.
                factor = (n / spec.rate) / times[-1]
                times = [t * factor for t in times]
            return times
        kind = "poisson" if spec.cv == 1.0 else "gamma"
        return arrival_times(kind, n, rate=spec.rate, cv=spec.cv, seed=spec.seed)
    except ValueError as exc:
        raise LoadgenError(str(exc)) from None


def _describe(spec: WorkloadSpec) -> str:
    if spec.trace_timestamps:
        timing = "trace timestamps" + (f" rescaled to {spec.rate:g} req/s" if spec.rate else "")
    else:
        timing = f"{'Poisson' if spec.cv == 1.0 else f'Gamma CV {spec.cv:g}'} at {spec.rate:g} req/s"
    return f"{spec.dataset}, {timing}, {spec.priority_fraction:.0%} high priority"
