"""Autoscaler settings."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

from shared.config import add_nats_argument, env
from shared.policy.config import ScalingConfig


@dataclass
class AutoscalerConfig:
    nats_url: str
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    initial_instances: int = 1
    tick_s: float = 0.5
    instance_timeout_s: float = 3.0
    # A started instance that has not reported after this long is given up on (and stopped).
    start_timeout_s: float = 180.0
    # Extra flags for every llumlet the local-process provider starts.
    llumlet_args: list[str] = field(default_factory=list)
    instance_prefix: str = "auto"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_argument(parser)
    defaults = ScalingConfig()
    parser.add_argument("--min-instances", type=int, default=env("MIN_INSTANCES", defaults.min_instances))
    parser.add_argument("--max-instances", type=int, default=env("MAX_INSTANCES", defaults.max_instances))
    parser.add_argument("--initial-instances", type=int, default=env("INITIAL_INSTANCES", 1))
    parser.add_argument("--scale-out-below", type=float, default=env("SCALE_OUT_BELOW", defaults.scale_out_below),
                        help="scale out while the average normal-priority freeness stays below this")
    parser.add_argument("--scale-in-above", type=float, default=env("SCALE_IN_ABOVE", defaults.scale_in_above),
                        help="scale in while it stays above this")
    parser.add_argument("--sustain-s", type=float, default=env("SCALE_SUSTAIN_S", defaults.sustain_s))
    parser.add_argument("--cooldown-s", type=float, default=env("SCALE_COOLDOWN_S", defaults.cooldown_s))
    parser.add_argument("--tick-s", type=float, default=env("SCALE_TICK_S", 0.5))
    parser.add_argument("--instance-prefix", default=env("INSTANCE_PREFIX", "auto"))
    parser.add_argument("--llumlet-args", default=env("LLUMLET_ARGS", ""),
                        help="flags for the llumlets it starts, one shell-quoted string")


def config_from_args(args: argparse.Namespace) -> AutoscalerConfig:
    if not 1 <= args.min_instances <= args.max_instances:
        raise SystemExit("autoscaler: need 1 <= --min-instances <= --max-instances")
    if args.scale_out_below >= args.scale_in_above:
        raise SystemExit("autoscaler: --scale-out-below must be lower than --scale-in-above")
    return AutoscalerConfig(
        nats_url=args.nats_url,
        scaling=ScalingConfig(
            scale_out_below=args.scale_out_below,
            scale_in_above=args.scale_in_above,
            sustain_s=args.sustain_s,
            cooldown_s=args.cooldown_s,
            min_instances=args.min_instances,
            max_instances=args.max_instances,
        ),
        initial_instances=min(max(args.initial_instances, args.min_instances), args.max_instances),
        tick_s=args.tick_s,
        llumlet_args=shlex.split(args.llumlet_args),
        instance_prefix=args.instance_prefix,
    )
