"""Where admission's late TTFT predictions come from: the accepted requests whose TTFT exceeded
their prediction the most, each beside what its instance really held when it was admitted.

    .venv/bin/python -m benchmarks.admission_late [--dataset synthetic:L-M] [--instances 8 --prefill 4 --decode 4]
        [--rate-x 1.5] [--saturation 17] [--seed 0] [--priority-fraction 0.1] [--slo-ttft-s 2] [--slo-tbt-s 0.1]
        [--worst 8]

The simulator, `predicted` admission and corral dispatch as `benchmarks/admission.py` runs them
(P/D L-M 4:4 by default, at `--rate-x` times `--saturation` req/s: that benchmark's saturating rate
for this workload). Per late request: the prediction and the TTFT, split into the wait for its
first step (arrival to first scheduled) and its own step(s) (first scheduled to first token), and,
at its admission, the prefill the chosen instance's report showed queued against what was really
ahead of it (waiting prompts, and what running prompts had still to prefill) and the prefill tokens
of the step then in flight. Then the error's P50/P99 over every accepted request.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

import numpy as np

from loadgen.simulator.admission import AdmissionModel
from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from loadgen.simulator.workload import WorkloadSpec, build_workload
from shared.policy.admission import AdmissionPolicy, Slo, SloConfig
from shared.policy.baselines import get_policy
from shared.policy.prefix_dispatch import queued_prefill_tokens


@dataclass(frozen=True)
class AtAdmission:
    """The chosen instance when a request was admitted there."""

    instance_id: str
    reported_queue_tokens: int  # the report's queued prefill (what the prediction read)
    ahead_tokens: int  # really ahead: waiting prompts + running prompts' prefill left
    in_flight_prefill_tokens: int  # prefill tokens of the step running then (0: idle or decode only)


class WatchedCluster(ClusterSimulator):
    """The simulator, remembering each admitted request's instance as it really was."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.at_admission: dict[str, AtAdmission] = {}

    def _dispatch(self, arrival) -> None:
        super()._dispatch(arrival)
        request_id = f"r{arrival.index}"
        if request_id not in self.predicted_ttft_s:
            return
        for instance in self.instances.values():
            held = [*instance.scheduler.waiting, *instance.scheduler.running]
            if not any(r.request_id == request_id for r in held):
                continue  # not this instance
            ahead = sum(max(r.prompt_len - r.num_computed_tokens, 0) for r in held if r.request_id != request_id)
            step = instance.step
            self.at_admission[request_id] = AtAdmission(
                instance.instance_id, queued_prefill_tokens(instance.report) if instance.report else 0, ahead,
                step.prefill_tokens if step is not None else 0)
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="synthetic:L-M")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--saturation", type=float, default=17.0, help="req/s (benchmarks/admission.py prints it)")
    parser.add_argument("--rate-x", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--priority-fraction", type=float, default=0.1)
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-tbt-s", type=float, default=0.1)
    parser.add_argument("--worst", type=int, default=8, help="late requests listed")
    args = parser.parse_args(argv)
    slo = SloConfig(Slo(args.slo_ttft_s, args.slo_tbt_s))
    config = SimConfig(num_instances=args.instances, num_prefill=args.prefill, num_decode=args.decode)
    spec = WorkloadSpec(args.dataset, num_requests=args.requests, priority_fraction=args.priority_fraction,
                        seed=args.seed)
    workload = build_workload(spec.with_rate(args.rate_x * args.saturation), config.max_seq_len)
    cluster = WatchedCluster(replace(config, admission=AdmissionModel(AdmissionPolicy.PREDICTED, slo)),
                             get_policy("corral"), workload)
    result = cluster.run()
    late = []
    for request in result.finished:
        predicted = result.predicted_ttft_s.get(request.request_id)
        if predicted is None:
            continue
        ttft = request.first_token_time - request.arrival_time
        late.append((ttft - predicted, predicted, ttft, request))
    late.sort(key=lambda row: -row[0])
    errors = np.array([row[0] for row in late])
    print(f"{workload.description}; {len(late)} accepted; TTFT - prediction P50 {np.percentile(errors, 50):+.2f} s, "
          f"P99 {np.percentile(errors, 99):+.2f} s; priority fraction {args.priority_fraction:g}")
    print(f"{'request':>8} {'late s':>7} {'pred s':>7} {'TTFT s':>7} {'wait s':>7} {'own s':>6} {'prompt':>6} "
          f"{'prio':>4}  {'instance':>8} {'reported':>8} {'ahead':>7} {'in flight':>9}")
    for error, predicted, ttft, request in late[:args.worst]:
        seen = cluster.at_admission[request.request_id]
        print(f"{request.request_id:>8} {error:>+7.2f} {predicted:>7.2f} {ttft:>7.2f} "
              f"{request.first_scheduled_time - request.arrival_time:>7.2f} "
              f"{request.first_token_time - request.first_scheduled_time:>6.2f} {request.prompt_len:>6} "
              f"{result.labels[request.request_id]:>4}  {seen.instance_id:>8} {seen.reported_queue_tokens:>8} "
              f"{seen.ahead_tokens:>7} {seen.in_flight_prefill_tokens:>9}")
    print("reported: the report's queued prefill tokens; ahead: really ahead (waiting + prefill left of running "
          "prompts, the step in flight's included); in flight: prefill tokens of the step running at admission")
    return 0


if __name__ == "__main__":
    sys.exit(main())
