"""`loadgen simulate`: compare scheduling policies on a simulated cluster in virtual time.

Wire it into `loadgen` with `register(subparsers)`, or build your own parser with
`add_arguments(parser)` and call `run(args)`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

from loadgen.datasets import SPEC_HELP
from loadgen.errors import LoadgenError
from loadgen.simulator.admission import AdmissionModel
from loadgen.simulator.config import AutoscaleModel, MigrationModel, SimConfig
from loadgen.simulator.report import format_table, results_document, write_json, write_plots
from loadgen.simulator.slo import SLO_HEADER, slo_metrics, slo_row
from loadgen.simulator.sweep import run_sweep
from loadgen.simulator.workload import Workload, WorkloadSpec
from shared.config import non_negative_number, non_negative_or_inf, share_of_one
from shared.engine_model.config import STEP_MODES, SchedulerConfig
from shared.policy.commit_hold import CommitHoldRule
from shared.policy.baselines import POLICIES, POLICY_NAMES, PREFIX_POLICY_NAMES, SchedulingPolicy, get_policy
from shared.policy.admission import ADMISSION_POLICY_NAMES, AdmissionPolicy, Slo, SloConfig, priority_slos
from shared.policy.config import HIGH_PRIORITY, PolicyConfig, ScalingConfig
from shared.policy.migration import DEFAULT_GUARD

_DESCRIPTION = "Simulate a cluster of LLM instances in virtual time and compare scheduling policies."
_EPILOG = "policies:\n" + "".join(f"  {p.name:<13} {p.description}\n" for p in POLICIES.values()) + f"""
dataset SPEC:
{SPEC_HELP}
Lengths come from the dataset; arrivals are Poisson at --rate (Gamma with --cv), or the trace's
own timestamps with --trace-timestamps (rescaled to --rate when one is given). Every policy at a
load point sees the same requests.

examples:
  loadgen simulate --dataset synthetic:L-L --rates 4,5,5.5 --num-requests 5000 --step-mode v0
  loadgen simulate --dataset synthetic:sharegpt --rate 10 --priority-fraction 0.1 --policy corral,infaas++
  loadgen simulate --dataset azure:../shared/data/traces/AzureLLMInferenceTrace_conv.csv \\
      --trace-timestamps --autoscale --min-instances 4 --plot plots/
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="compare scheduling policies on a simulated cluster",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults_policy, defaults_sim, engine = PolicyConfig(), SimConfig(), SchedulerConfig()
    work = parser.add_argument_group("workload")
    work.add_argument("--dataset", required=True, metavar="SPEC", help="see 'dataset SPEC' below")
    work.add_argument("--num-requests", type=int, metavar="N",
                      help="requests per run (default: the whole file; 1000 for synthetic)")
    rate = work.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, metavar="R", help="requests per second")
    rate.add_argument("--rates", metavar="R1,R2,..", help="sweep these request rates")
    work.add_argument("--cv", type=float, default=1.0, help="CV of the gaps (Gamma; 1 = Poisson, the default)")
    work.add_argument("--trace-timestamps", action="store_true", help="replay the dataset's own arrival times")
    work.add_argument("--time-scale", type=float, default=1.0, metavar="F",
                      help="multiply trace times by F (without --rate)")
    work.add_argument("--priority-fraction", type=float, default=0.0, metavar="F",
                      help="fraction of requests marked high priority (-1)")
    work.add_argument("--default-output-len", type=int, default=256, metavar="N",
                      help="output length where the dataset has none (default 256)")
    work.add_argument("--seed", type=int, default=0)

    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--policy", default=",".join(POLICY_NAMES), metavar="P1,P2,..",
                         help=f"policies to compare (default: {','.join(POLICY_NAMES)}; prefix-aware: "
                              f"{','.join(PREFIX_POLICY_NAMES)}, with --prefix-caching)")
    cluster.add_argument("--instances", type=int, default=defaults_sim.num_instances)
    cluster.add_argument("--gpu", default=defaults_sim.gpu, help="latency profile: A10 (default), A100, H100")
    cluster.add_argument("--fine-latency", action="store_true", help="the operator-level A10 latency form")
    cluster.add_argument("--step-mode", choices=STEP_MODES, default=engine.step_mode,
                         help="v1: mixed token-budget steps (default); v0: the paper's testbed, prefill stalls decode")
    cluster.add_argument("--num-blocks", type=int, default=engine.num_blocks, help="KV blocks per instance")
    cluster.add_argument("--block-size", type=int, default=engine.block_size)
    cluster.add_argument("--prefix-caching", action="store_true",
                         help="vLLM's automatic prefix caching in every instance: prompts with trace hash_ids "
                              "(mooncake:, conversation:) reuse cached prefix blocks")
    cluster.add_argument("--prefix-recompute-weight", type=non_negative_number,
                         default=defaults_sim.prefix_recompute_weight, metavar="W",
                         help="corral-prefix: prefill done again away from a prefix's best holder counts W times "
                              "more (default %(default)s; 0: the request's own TTFT only)")
    cluster.add_argument("--prefix-room-wait-weight", type=non_negative_or_inf,
                         default=defaults_sim.prefix_room_wait_weight, metavar="W",
                         help="corral-prefix: an instance without room is charged W times the prefill of the "
                              "tokens its missing blocks hold (default %(default)s; inf: instances with room first)")
    cluster.add_argument("--prefix-saturation-weight", type=non_negative_number,
                         default=defaults_sim.prefix_saturation_weight, metavar="K",
                         help="corral-prefix: while every instance has prefill queued, the recompute charge's weight "
                              "rises, up to (1 + K)-fold once the shortest queue is as long as the request's own "
                              "prefill (default %(default)s; 0: never)")
    cluster.add_argument("--prefix-cached-queue-weight", type=share_of_one,
                         default=defaults_sim.prefix_cached_queue_weight, metavar="B",
                         help="corral-prefix: a waiting prompt's cached prefix counts B of its prefill in the queue "
                              "ahead (default %(default)s: only what it will compute; 1: counted whole)")
    cluster.add_argument("--prefix-held-request-tokens", type=non_negative_number,
                         default=defaults_sim.prefix_held_request_tokens, metavar="R",
                         help="corral-prefix: each request an instance holds or queues counts as R tokens of "
                              "prefill in the queue ahead (default %(default)s)")
    cluster.add_argument("--max-model-len", type=int, default=engine.max_model_len,
                         help="longer prompts are cut to fit (a warning says how many)")
    cluster.add_argument("--max-num-batched-tokens", type=int, default=engine.max_num_batched_tokens, metavar="N",
                         help=f"token budget of a step: prefill chunks and decodes (default {engine.max_num_batched_tokens})")
    cluster.add_argument("--kv-bytes-per-token", type=int, default=defaults_sim.kv_bytes_per_token,
                         help="KV bytes per token (default 0.5 MiB: LLaMA-7B fp16)")
    cluster.add_argument("--prefill", type=int, default=0, metavar="N",
                         help="P/D disaggregation: the first N instances prefill only and hand each request, at its "
                              "first token, to a decode instance by live migration (KV copied at "
                              "--migration-bandwidth-gbps); default 0: all mixed")
    cluster.add_argument("--decode", type=int, default=0, metavar="M",
                         help="the next M instances decode only (the rest of --instances are mixed)")
    cluster.add_argument("--handoff-concurrency", type=int, default=MigrationModel().handoff_concurrency, metavar="K",
                         help="hand-offs a prefill instance runs at once (default %(default)s, as the llumlet's)")

    policy = parser.add_argument_group("policy")
    policy.add_argument("--migration-bandwidth-gbps", type=float, default=MigrationModel().bandwidth_gbps,
                        metavar="GBPS", help="KV copy bandwidth in GB/s (gigabytes; default 15, as the Llumnix "
                        "artifact; its simulator used 1)")
    policy.add_argument("--migrate-out-freeness", type=float, default=defaults_policy.migrate_out_freeness)
    policy.add_argument("--migrate-in-freeness", type=float, default=defaults_policy.migrate_in_freeness)
    policy.add_argument("--cache-aware-migration", action=argparse.BooleanOptionalAction, default=True,
                        help="with --prefix-caching: pairing prefers a destination holding the moving request's "
                             "prefix, and only the blocks the destination's cache lacks are copied (default: on, "
                             "as the services run it; --no-cache-aware-migration measures without it)")
    policy.add_argument("--migration-hold-max-ms", type=float, default=1e3 * MigrationModel().hold.hold_max_s,
                        help="a destination holds its next step up to this long for a commit due (the llumlets' "
                             "flag of the same name; 0: never)")
    policy.add_argument("--migration-hold-step-share", type=float, default=MigrationModel().hold.step_share,
                        help="and at most this share of its latest step")
    policy.add_argument("--migration-notice-steps", type=int, default=MigrationModel().notice_steps, metavar="N",
                        help="a source notices its commit this many of its steps ahead and the destination paces "
                             "its steps to meet it (the llumlets' flag of the same name; 1: a step ahead, no pacing)")
    policy.add_argument("--migration-max-out", type=int, default=MigrationModel().max_out, metavar="N",
                        help="migrations out of an instance at once (default %(default)s, as the llumlets')")
    policy.add_argument("--migration-max-in", type=int, default=MigrationModel().max_in, metavar="N",
                        help="migrations into an instance at once (default %(default)s, as the llumlets')")
    policy.add_argument("--no-migration-guard", action="store_true",
                        help="pair on the threshold bands only (no anti-thrash rules)")
    policy.add_argument("--headroom-blocks", type=int,
                        default=defaults_policy.headroom_blocks.get(HIGH_PRIORITY, 0),
                        help="execution-priority headroom of high priority, in blocks (corral)")
    policy.add_argument("--report-interval-s", type=float, default=defaults_sim.report_interval_s)
    policy.add_argument("--migration-interval-s", type=float, default=defaults_sim.migration_interval_s)

    scale = parser.add_argument_group("auto-scaling")
    scaling = ScalingConfig()
    scale.add_argument("--autoscale", action="store_true", help="scale on the average normal-priority freeness")
    scale.add_argument("--min-instances", type=int, default=scaling.min_instances)
    scale.add_argument("--max-instances", type=int, help="default: --instances")
    scale.add_argument("--scale-band", default=f"{scaling.scale_out_below:g},{scaling.scale_in_above:g}",
                       metavar="X,Y", help="scale out below freeness X, in above Y")
    scale.add_argument("--startup-s", type=float, default=AutoscaleModel().startup_s,
                       help="a new instance serves after this long (billed from launch)")

    gate = parser.add_argument_group("admission control (early rejection against an SLO)")
    gate.add_argument("--admission", choices=ADMISSION_POLICY_NAMES, default="none",
                      help="none (admit all), current-load (reject on the load now), predicted (on the decode "
                           "batch when the prefill would finish); needs --slo-ttft-s and --slo-tbt-s")
    gate.add_argument("--slo-ttft-s", type=float, metavar="S", help="TTFT target; with --slo-tbt-s adds the SLO table")
    gate.add_argument("--slo-tbt-s", type=float, metavar="S", help="TBT target (mean time per output token)")
    gate.add_argument("--slo-priority", action="append", default=[], metavar="P:TTFT_S:TBT_S",
                      help="a priority's own targets, e.g. high:0.5:0.05 or 3:10:0.5 (repeatable)")
    gate.add_argument("--slo-reserve", type=float, default=SloConfig(Slo(1, 1)).reserve, metavar="F",
                      help="share of the SLO normal priority may not use, so high priority is rejected last")
    gate.add_argument("--slo-handoff-reserve", type=float, default=SloConfig(Slo(1, 1)).handoff_reserve, metavar="F",
                      help="the same on a prefill instance of P/D pools (its predictions err more)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", metavar="FILE", help="write the results as JSON")
    out.add_argument("--plot", metavar="DIR", help="write PNG plots (latency CDFs, timelines, sweep)")
    out.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    policies = _policies(args.policy)
    config = build_config(args)
    spec = WorkloadSpec(
        dataset=args.dataset,
        num_requests=args.num_requests,
        rate=None,
        cv=args.cv,
        trace_timestamps=args.trace_timestamps,
        time_scale=args.time_scale,
        priority_fraction=args.priority_fraction,
        default_output_len=args.default_output_len,
        seed=args.seed,
    )
    rates = _rates(args)

    def progress(record) -> None:
        if not args.quiet:
            m = record.metrics
            point = f" at {record.rate:g} req/s" if record.rate is not None else ""
            print(f"simulated {m.policy}{point}: {m.completed} requests in {m.wall_s:.1f} s", file=sys.stderr)

    records = run_sweep(config, policies, spec, rates, on_record=progress, on_workload=_truncation_warning(config))
    print(format_table(records))
    if config.disaggregated:
        print(f"\nP/D hand-offs ({config.num_prefill} prefill, {config.num_decode} decode, "
              f"{config.num_instances - config.num_prefill - config.num_decode} mixed):")
        for record in records:
            point = f"@{record.rate:g}" if record.rate is not None else ""
            print(f"  {record.policy}{point}: {record.result.handoffs.summary()}")
    if config.admission is not None:
        print(f"\nSLO: TTFT {config.admission.slo.default.ttft_s:g} s, TBT {config.admission.slo.default.tbt_s:g} s; "
              f"admission {config.admission.policy.value}")
        print(SLO_HEADER)
        for record in records:
            point = f"@{record.rate:g}" if record.rate is not None else ""
            print(slo_row(f"{record.policy}{point}", slo_metrics(record.result, config.admission.slo)))
    if args.out:
        settings = {"workload": asdict(spec), "rates": rates, "policies": [p.name for p in policies],
                    "cluster": _settings_of(config)}
        document = results_document(records, settings)
        if config.disaggregated:
            for run_doc, record in zip(document["runs"], records):
                run_doc["handoffs"] = record.result.handoffs.to_json()
        if config.admission is not None:
            document["slo"] = [{"policy": r.policy, "rate": r.rate, **slo_metrics(r.result, config.admission.slo).to_json()}
                               for r in records]
        print(f"results: {write_json(args.out, document)}")
    if args.plot:
        written = write_plots(records, args.plot)
        print(f"plots: {len(written)} PNG files in {args.plot}")
    return 0


def build_config(args: argparse.Namespace) -> SimConfig:
    """Command-line values → SimConfig; bad values raise LoadgenError with the reason."""
    try:
        policy = replace(
            PolicyConfig(),
            migrate_out_freeness=args.migrate_out_freeness,
            migrate_in_freeness=args.migrate_in_freeness,
            headroom_blocks={HIGH_PRIORITY: args.headroom_blocks},
        )
        if args.headroom_blocks < 0:
            raise ValueError("headroom blocks must be >= 0")
        if not args.migrate_out_freeness < args.migrate_in_freeness:
            raise ValueError("--migrate-out-freeness must be below --migrate-in-freeness")
        autoscale = None
        if args.autoscale:
            low, high = _band(args.scale_band)
            scaling = ScalingConfig(
                scale_out_below=low,
                scale_in_above=high,
                min_instances=args.min_instances,
                max_instances=args.max_instances if args.max_instances is not None else args.instances,
            )
            autoscale = AutoscaleModel(scaling=scaling, startup_s=args.startup_s)
        return SimConfig(
            num_instances=args.instances,
            gpu=args.gpu,
            fine_latency=args.fine_latency,
            scheduler=SchedulerConfig(num_blocks=args.num_blocks, block_size=args.block_size,
                                      max_model_len=args.max_model_len,
                                      max_num_batched_tokens=args.max_num_batched_tokens, step_mode=args.step_mode,
                                      enable_prefix_caching=args.prefix_caching),
            kv_bytes_per_token=args.kv_bytes_per_token,
            prefix_recompute_weight=args.prefix_recompute_weight,
            prefix_room_wait_weight=args.prefix_room_wait_weight,
            prefix_saturation_weight=args.prefix_saturation_weight,
            prefix_cached_queue_weight=args.prefix_cached_queue_weight,
            prefix_held_request_tokens=args.prefix_held_request_tokens,
            report_interval_s=args.report_interval_s,
            migration_interval_s=args.migration_interval_s,
            policy=policy,
            guard=None if args.no_migration_guard else DEFAULT_GUARD,
            migration=MigrationModel(bandwidth_gbps=args.migration_bandwidth_gbps,
                                     handoff_concurrency=args.handoff_concurrency,
                                     max_out=args.migration_max_out, max_in=args.migration_max_in,
                                     cache_aware=args.cache_aware_migration,
                                     hold=CommitHoldRule(args.migration_hold_max_ms / 1e3,
                                                         args.migration_hold_step_share),
                                     notice_steps=args.migration_notice_steps),
            autoscale=autoscale,
            admission=_admission(args),
            num_prefill=args.prefill,
            num_decode=args.decode,
        )
    except ValueError as exc:
        raise LoadgenError(str(exc)) from None


def _admission(args: argparse.Namespace) -> AdmissionModel | None:
    if args.slo_ttft_s is None and args.slo_tbt_s is None:
        if args.admission != "none":
            raise ValueError(f"--admission {args.admission} needs --slo-ttft-s and --slo-tbt-s")
        return None
    if args.slo_ttft_s is None or args.slo_tbt_s is None:
        raise ValueError("give both --slo-ttft-s and --slo-tbt-s")
    slo = SloConfig(Slo(args.slo_ttft_s, args.slo_tbt_s), priority_slos(args.slo_priority), reserve=args.slo_reserve,
                    handoff_reserve=args.slo_handoff_reserve)
    return AdmissionModel(AdmissionPolicy(args.admission), slo)


def _truncation_warning(config: SimConfig) -> Callable[[Workload], None]:
    """Warns once (every load point replays the same prompts) when prompts were cut to fit."""
    warned = False

    def check(workload: Workload) -> None:
        nonlocal warned
        if workload.num_truncated and not warned:
            warned = True
            engine = config.scheduler
            print(f"warning: {workload.num_truncated} of {len(workload.arrivals)} prompts do not fit an instance "
                  f"(--max-model-len {engine.max_model_len}, KV capacity {engine.num_blocks * engine.block_size} "
                  f"tokens) and were cut to {config.max_seq_len - 1} tokens", file=sys.stderr)

    return check


def _policies(text: str) -> list[SchedulingPolicy]:
    names = [name for name in text.split(",") if name.strip()]
    if not names:
        raise LoadgenError(f"--policy needs at least one of {', '.join(POLICY_NAMES)}")
    try:
        return [get_policy(name) for name in dict.fromkeys(names)]
    except ValueError as exc:
        raise LoadgenError(str(exc)) from None


def _rates(args: argparse.Namespace) -> list[float | None]:
    if args.rates is None:
        return [args.rate]
    try:
        rates = [float(item) for item in args.rates.split(",") if item.strip()]
    except ValueError:
        raise LoadgenError(f"--rates {args.rates!r}: expected numbers separated by commas") from None
    if not rates or any(not rate > 0 for rate in rates):
        raise LoadgenError(f"--rates {args.rates!r}: every rate must be > 0")
    return rates


def _band(text: str) -> tuple[float, float]:
    try:
        low, high = (float(item) for item in text.split(","))
    except ValueError:
        raise ValueError(f"--scale-band {text!r}: expected X,Y (two numbers)") from None
    return low, high


def _settings_of(config: SimConfig) -> dict:
    settings = asdict(config)
    settings["policy"]["headroom_blocks"] = {str(k): v for k, v in config.policy.headroom_blocks.items()}
    if math.isinf(config.prefix_room_wait_weight):  # (strict JSON has no Infinity)
        settings["prefix_room_wait_weight"] = "inf"
    return settings
