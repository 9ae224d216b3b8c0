"""Global scheduler settings."""

from __future__ import annotations

import argparse
import dataclasses
import uuid
from dataclasses import dataclass, field

from shared import subjects
from services.global_scheduler.admission import AdmissionSettings
from services.global_scheduler.dispatcher import DISPATCH_POLICY_NAMES
from shared.config import add_nats_argument, env, non_negative_number, non_negative_or_inf, share_of_one
from shared.engine_model.latency import SIMPLE_MODELS
from shared.policy.admission import ADMISSION_POLICY_NAMES, AdmissionPolicy, Slo, SloConfig, priority_slos
from shared.policy.config import PolicyConfig
from shared.policy.migration import DEFAULT_GUARD, MigrationGuard
from shared.policy.prefix_dispatch import (
    DEFAULT_CACHED_QUEUE_WEIGHT, DEFAULT_HELD_REQUEST_TOKENS, DEFAULT_RECOMPUTE_WEIGHT, DEFAULT_ROOM_WAIT_WEIGHT,
    DEFAULT_SATURATION_WEIGHT,
)


@dataclass
class SchedulerConfig:
    nats_url: str
    instance_timeout_s: float = 3.0
    migration_interval_s: float = 0.1
    enable_migration: bool = True
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # The pairing's anti-thrash rules (the llumlets apply the destination's part themselves).
    guard: MigrationGuard = DEFAULT_GUARD
    metrics_port: int = 0  # Prometheus /metrics (0: off)
    # Replicas: each answers dispatch; the live one with the lowest id pairs migrations.
    scheduler_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    heartbeat_interval_s: float = 0.2
    leader_lease_s: float = 1.0  # a replica silent this long is gone (and a new one waits this long)
    admission: AdmissionSettings | None = None  # early rejection against an SLO (None: admit all)
    # Dispatch rule by policy name (services.global_scheduler.dispatcher); prefix-aware ones use the
    # llumlets' KV events and this latency profile's prefill time.
    dispatch_policy: str = "corral"
    dispatch_gpu: str = "A10"
    prefix_recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT  # corral-prefix's (shared.policy.prefix_dispatch)
    prefix_room_wait_weight: float = DEFAULT_ROOM_WAIT_WEIGHT  # (inf: instances with room first)
    prefix_saturation_weight: float = DEFAULT_SATURATION_WEIGHT  # (0: the recompute charge never raised)
    prefix_cached_queue_weight: float = DEFAULT_CACHED_QUEUE_WEIGHT  # (a queued prompt's cached prefix; 1: whole)
    prefix_held_request_tokens: float = DEFAULT_HELD_REQUEST_TOKENS  # (prefill tokens a request held or queued counts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_argument(parser)
    parser.add_argument("--instance-timeout-s", type=float, default=env("INSTANCE_TIMEOUT_S", 3.0),
                        help="drop an instance that has not reported for this long")
    parser.add_argument("--migration-interval-s", type=float, default=env("MIGRATION_INTERVAL_S", 0.1))
    parser.add_argument("--scheduler-id", default=env("SCHEDULER_ID", None),
                        help="this replica's id (letters, digits, '_', '-'; default: random): the live replica "
                             "with the lowest id pairs migrations")
    parser.add_argument("--leader-lease-s", type=float, default=env("LEADER_LEASE_S", 1.0),
                        help="a scheduler replica silent this long no longer leads migration pairing")
    parser.add_argument("--metrics-port", type=int, default=env("METRICS_PORT", 0),
                        help="serve Prometheus metrics on this port (0: off)")
    parser.add_argument("--enable-migration", action=argparse.BooleanOptionalAction,
                        default=env("ENABLE_MIGRATION", True), help="pair sources and destinations (default: on)")
    defaults = PolicyConfig()
    parser.add_argument("--migrate-out-freeness", type=float, default=env("MIGRATE_OUT_FREENESS", defaults.migrate_out_freeness),
                        help="instances below this freeness migrate requests out")
    parser.add_argument("--migrate-in-freeness", type=float, default=env("MIGRATE_IN_FREENESS", defaults.migrate_in_freeness),
                        help="instances above this freeness take migrated requests")
    parser.add_argument("--migration-dest-max-waiting", type=int,
                        default=env("MIGRATION_DEST_MAX_WAITING", DEFAULT_GUARD.dest_max_waiting),
                        help="pair no destination with more requests than this waiting (as the llumlets' flag)")
    parser.add_argument("--migration-min-freeness-gap", type=float,
                        default=env("MIGRATION_MIN_FREENESS_GAP", DEFAULT_GUARD.min_freeness_gap),
                        help="pair only when the destination is this much freer than the source")
    parser.add_argument("--dispatch-policy", choices=DISPATCH_POLICY_NAMES, default=env("DISPATCH_POLICY", "corral"),
                        help="dispatch rule by policy name (corral-prefix: by predicted TTFT with the llumlets' "
                             "prefix caches; migration stays as --enable-migration says)")
    parser.add_argument("--dispatch-gpu", choices=sorted(SIMPLE_MODELS), default=env("DISPATCH_GPU", "A10"),
                        help="latency profile of the prefix-aware policies' prefill-time predictions")
    parser.add_argument("--prefix-recompute-weight", type=non_negative_number,
                        default=env("PREFIX_RECOMPUTE_WEIGHT", str(DEFAULT_RECOMPUTE_WEIGHT)), metavar="W",
                        help="corral-prefix: prefill done again away from a prefix's best holder counts W times "
                             "more (default %(default)s; 0: the request's own TTFT only)")
    parser.add_argument("--prefix-room-wait-weight", type=non_negative_or_inf,
                        default=env("PREFIX_ROOM_WAIT_WEIGHT", str(DEFAULT_ROOM_WAIT_WEIGHT)), metavar="W",
                        help="corral-prefix: an instance without room is charged W times the prefill of the tokens "
                             "its missing blocks hold (default %(default)s; inf: instances with room first)")
    parser.add_argument("--prefix-saturation-weight", type=non_negative_number,
                        default=env("PREFIX_SATURATION_WEIGHT", str(DEFAULT_SATURATION_WEIGHT)), metavar="K",
                        help="corral-prefix: while every instance has prefill queued, the recompute charge's weight "
                             "rises, up to (1 + K)-fold once the shortest queue is as long as the request's own "
                             "prefill (default %(default)s; 0: never)")
    parser.add_argument("--prefix-cached-queue-weight", type=share_of_one,
                        default=env("PREFIX_CACHED_QUEUE_WEIGHT", str(DEFAULT_CACHED_QUEUE_WEIGHT)), metavar="B",
                        help="corral-prefix: a waiting prompt's cached prefix counts B of its prefill in the queue "
                             "ahead, where the instance tells its waiting prefill in tokens (default %(default)s: "
                             "only what it will compute; 1: counted whole)")
    parser.add_argument("--prefix-held-request-tokens", type=non_negative_number,
                        default=env("PREFIX_HELD_REQUEST_TOKENS", str(DEFAULT_HELD_REQUEST_TOKENS)), metavar="R",
                        help="corral-prefix: each request an instance holds or queues counts as R tokens of prefill "
                             "in the queue ahead, on every instance, told or not (default %(default)s)")
    gate = parser.add_argument_group("admission control (429 when no instance can meet the SLO)")
    gate.add_argument("--admission", choices=ADMISSION_POLICY_NAMES, default=env("ADMISSION", "none"))
    gate.add_argument("--slo-ttft-s", type=float, default=env("SLO_TTFT_S", None), help="TTFT target")
    gate.add_argument("--slo-tbt-s", type=float, default=env("SLO_TBT_S", None), help="TBT target")
    gate.add_argument("--slo-priority", action="append", metavar="P:TTFT_S:TBT_S",
                      default=env("SLO_PRIORITY", "").split(),
                      help="a priority's own targets, e.g. high:0.5:0.05 or 3:10:0.5 "
                           "(repeatable; env: space-separated)")
    slo_defaults = SloConfig(Slo(1, 1))  # (the reserves' defaults: the policy's)
    gate.add_argument("--slo-reserve", type=float, default=env("SLO_RESERVE", slo_defaults.reserve),
                      help="share of the SLO (and of KV blocks) normal priority leaves to high priority")
    gate.add_argument("--slo-handoff-reserve", type=float, default=env("SLO_HANDOFF_RESERVE", slo_defaults.handoff_reserve),
                      help="the same on a prefill instance of P/D pools (its predictions err more)")
    gate.add_argument("--admission-gpu", choices=sorted(SIMPLE_MODELS), default=env("ADMISSION_GPU", "A10"),
                      help="latency profile the predictions use")


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    if args.leader_lease_s <= 0:
        raise SystemExit("--leader-lease-s must be positive")
    return SchedulerConfig(
        nats_url=args.nats_url,
        instance_timeout_s=args.instance_timeout_s,
        migration_interval_s=args.migration_interval_s,
        enable_migration=args.enable_migration,
        policy=policy_from_args(args),
        guard=guard_from_args(args),
        metrics_port=args.metrics_port,
        **({"scheduler_id": _scheduler_id(args.scheduler_id)} if args.scheduler_id else {}),
        heartbeat_interval_s=min(0.2, args.leader_lease_s / 4),
        leader_lease_s=args.leader_lease_s,
        admission=admission_from_args(args),
        dispatch_policy=args.dispatch_policy,
        dispatch_gpu=args.dispatch_gpu,
        prefix_recompute_weight=args.prefix_recompute_weight,
        prefix_room_wait_weight=args.prefix_room_wait_weight,
        prefix_saturation_weight=args.prefix_saturation_weight,
        prefix_cached_queue_weight=args.prefix_cached_queue_weight,
        prefix_held_request_tokens=args.prefix_held_request_tokens,
    )


def admission_from_args(args: argparse.Namespace) -> AdmissionSettings | None:
    if args.admission == "none":
        return None
    if args.slo_ttft_s is None or args.slo_tbt_s is None:
        raise SystemExit(f"--admission {args.admission} needs --slo-ttft-s and --slo-tbt-s")
    try:
        slo = SloConfig(Slo(args.slo_ttft_s, args.slo_tbt_s), priority_slos(args.slo_priority),
                        reserve=args.slo_reserve, handoff_reserve=args.slo_handoff_reserve)
    except ValueError as exc:
        raise SystemExit(f"bad SLO: {exc}") from exc
    return AdmissionSettings(AdmissionPolicy(args.admission), slo, gpu=args.admission_gpu)


def _scheduler_id(value: str) -> str:
    try:
        return subjects.valid_token(value)
    except ValueError as exc:
        raise SystemExit(f"bad --scheduler-id: {exc}") from exc


def guard_from_args(args: argparse.Namespace) -> MigrationGuard:
    try:
        return dataclasses.replace(DEFAULT_GUARD, dest_max_waiting=args.migration_dest_max_waiting,
                                   min_freeness_gap=args.migration_min_freeness_gap)
    except ValueError as exc:
        raise SystemExit(f"bad migration guard: {exc}") from exc


def policy_from_args(args: argparse.Namespace) -> PolicyConfig:
    if args.migration_interval_s <= 0:
        raise SystemExit("--migration-interval-s must be positive")
    if args.migrate_out_freeness >= args.migrate_in_freeness:
        raise SystemExit("--migrate-out-freeness must be below --migrate-in-freeness (the gap stops ping-pong)")
    return dataclasses.replace(PolicyConfig(), migrate_out_freeness=args.migrate_out_freeness,
                               migrate_in_freeness=args.migrate_in_freeness)
