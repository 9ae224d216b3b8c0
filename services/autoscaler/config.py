"""Autoscaler settings."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

from shared.config import add_nats_argument, env
from shared.policy.config import ScalingConfig
from shared.policy.scaling import PrefillBand


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
    # Prefill/decode disaggregation (issue 19 §2): with both counts set, two pools of llumlets
    # (`--role prefill` / `--role decode`), each scaled on its own signal within the limits.
    initial_prefill: int = 0
    initial_decode: int = 0
    prefill_band: PrefillBand = field(default_factory=PrefillBand)

    @property
    def disaggregated(self) -> bool:
        return self.initial_prefill > 0


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
    pools = parser.add_argument_group("prefill/decode pools (both counts: each pool scales on its own signal, "
                                      "--min/--max-instances per pool)")
    pools.add_argument("--initial-prefill", type=int, default=env("INITIAL_PREFILL", 0),
                       help="prefill llumlets to start with")
    pools.add_argument("--initial-decode", type=int, default=env("INITIAL_DECODE", 0),
                       help="decode llumlets to start with")
    band = PrefillBand()
    pools.add_argument("--prefill-scale-out-tokens", type=int,
                       default=env("PREFILL_SCALE_OUT_TOKENS", band.scale_out_tokens),
                       help="add a prefill llumlet while each holds more prompt tokens queued than this")
    pools.add_argument("--prefill-scale-in-tokens", type=int,
                       default=env("PREFILL_SCALE_IN_TOKENS", band.scale_in_tokens),
                       help="drain one while each holds at most this many (and their freeness is high)")
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
        **pools_from_args(args),
    )


def pools_from_args(args: argparse.Namespace) -> dict:
    if not args.initial_prefill and not args.initial_decode:
        return {}
    if args.initial_prefill < 1 or args.initial_decode < 1:
        raise SystemExit("autoscaler: --initial-prefill and --initial-decode need at least 1 each")
    clamp = lambda n: min(max(n, args.min_instances), args.max_instances)  # noqa: E731 (per pool)
    try:
        band = PrefillBand(args.prefill_scale_out_tokens, args.prefill_scale_in_tokens)
    except ValueError as exc:
        raise SystemExit(f"autoscaler: bad prefill band: {exc}") from exc
    return {"initial_prefill": clamp(args.initial_prefill), "initial_decode": clamp(args.initial_decode),
            "prefill_band": band}
