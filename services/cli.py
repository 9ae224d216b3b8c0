"""`corral`: start the whole cluster (`corral up`) or one service (`corral gateway`, ...)."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from shared import nats_auth
from shared.config import env
from shared.logs import setup_logging
from shared.policy.baselines import POLICIES, get_policy


def _cmd_up(args: argparse.Namespace, extra: list[str]) -> int:
    from services.cpu_layout import available_cpus, cpu_layout_decision, resolve_engine
    from services.supervisor import run_cluster, say
    from services.tools.make_model import ensure_tiny_model

    roles = llumlet_roles(args)
    args.instances = len(roles) if roles else (args.instances if args.instances is not None else 2)
    if args.instances < 1:
        raise SystemExit(f"corral up: --instances must be at least 1, got {args.instances}")
    if args.metrics_port < 0 or args.metrics_port + args.instances > 65535:
        raise SystemExit(f"corral up: --metrics-port {args.metrics_port} leaves no room for {args.instances} llumlets")
    if args.model is None:
        say("preparing the tiny test model (made once, then reused)")
    model_dir = args.model or str(ensure_tiny_model())
    say(f"model {model_dir} (give it to benchmark clients as --tokenizer)")
    llumlet_args = ["--model", model_dir, *extra]
    if args.engine:
        llumlet_args += ["--engine", args.engine]
    gateway_args = ["--model", model_dir, "--port", str(args.port), "--host", args.host]
    scheduler_args = ["--dispatch-policy", args.dispatch_policy]
    if get_policy(args.dispatch_policy).dispatch.uses_prefix_index:  # the gateway sends each prompt's block hashes
        gateway_args += ["--dispatch-prefix-hashes", "true"]
    autoscaler_args = None
    if args.autoscale:  # the autoscaler starts (and stops) the llumlets itself
        # Its llumlets serve no metrics: they would share one port (the gateway's and scheduler's still serve).
        autoscaled = ["--metrics-port", "0", *llumlet_args]
        autoscaler_args = ["--initial-instances", str(args.instances), "--min-instances", str(args.min_instances),
                           "--max-instances", str(args.max_instances), "--llumlet-args", shlex.join(autoscaled)]
        if roles:  # a pool each, scaled on its own signal (--min/--max-instances per pool)
            autoscaler_args += ["--initial-prefill", str(args.prefill), "--initial-decode", str(args.decode)]
    try:
        decision = cpu_layout_decision(args.cpu_layout, resolve_engine(args.engine), args.instances, args.autoscale,
                                       available_cpus())
    except ValueError as exc:
        raise SystemExit(f"corral up: {exc}") from exc
    logging.getLogger("corral.up").info("%s", decision.reason)
    return run_cluster(
        cpu_layout=decision.layout,
        nats_url=args.nats_url,
        instances=args.instances,
        gateway_args=gateway_args,
        llumlet_args=llumlet_args,
        scheduler_args=scheduler_args,
        autoscaler_args=autoscaler_args,
        port=args.port,
        ready_timeout_s=args.ready_timeout_s,
        host=args.host,
        metrics_port=args.metrics_port,
        roles=roles,
    )


def llumlet_roles(args: argparse.Namespace) -> list[str]:
    """`--prefill N --decode M`: the role of each llumlet, prefill ones first (none: all mixed)."""
    if not args.prefill and not args.decode:
        return []
    if args.prefill < 1 or args.decode < 1:
        raise SystemExit(f"corral up: --prefill and --decode need at least 1 each, got {args.prefill} and {args.decode}")
    if args.instances is not None:
        raise SystemExit("corral up: --prefill/--decode set the instance count: drop --instances")
    return ["prefill"] * args.prefill + ["decode"] * args.decode


def _cmd_scheduler(args: argparse.Namespace) -> int:
    from services.global_scheduler.config import config_from_args
    from services.global_scheduler.service import GlobalScheduler
    from services.runner import run, serve_until_signalled

    run(serve_until_signalled(GlobalScheduler(config_from_args(args))))
    return 0


def _cmd_llumlet(args: argparse.Namespace) -> int:
    from services.llumlet.config import config_from_args
    from services.llumlet.engines import create_engine
    from services.llumlet.service import Llumlet
    from services.runner import run, serve_until_signalled

    config = config_from_args(args)
    llumlet = Llumlet(config, create_engine(config))
    run(serve_until_signalled(llumlet, wait=llumlet.wait_failed))
    return 0


def _cmd_gateway(args: argparse.Namespace) -> int:
    from services.gateway.config import ConfigError, config_from_args
    from services.gateway.service import serve
    from services.runner import run

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"corral gateway: error: {exc}", file=sys.stderr)
        return 2
    run(serve(config))
    return 0


def _cmd_autoscaler(args: argparse.Namespace) -> int:
    from services.autoscaler.config import config_from_args
    from services.autoscaler.providers import provider_from_args
    from services.autoscaler.service import Autoscaler
    from services.runner import run, serve_until_signalled

    config = config_from_args(args)
    provider = provider_from_args(args, config)
    run(serve_until_signalled(Autoscaler(config, provider)))
    return 0


def _cmd_drain(args: argparse.Namespace) -> int:
    from services.tools.drain import run as drain

    return drain(args)


def _cmd_make_model(args: argparse.Namespace) -> int:
    from services.tools.make_model import run as make_model

    return make_model(args) or 0


def build_parser() -> argparse.ArgumentParser:
    from services.autoscaler.config import add_arguments as autoscaler_arguments
    from services.gateway.config import add_arguments as gateway_arguments
    from services.global_scheduler.config import add_arguments as scheduler_arguments
    from services.llumlet.config import add_arguments as llumlet_arguments
    from services.autoscaler.providers import add_arguments as provider_arguments
    from services.tools.drain import add_arguments as drain_arguments
    from services.tools.make_model import add_arguments as make_model_arguments

    parser = argparse.ArgumentParser(prog="corral", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start NATS (embedded unless --nats-url), the scheduler, N llumlets and the gateway",
                        description="Unrecognised flags are passed to every llumlet (see `corral llumlet --help`).")
    up.add_argument("--nats-url", default=env("NATS_URL", None), help="use this NATS server instead of an embedded one")
    up.add_argument("--instances", type=int, default=None, help="number of llumlets (default 2)")
    up.add_argument("--prefill", type=int, default=0,
                    help="prefill/decode disaggregation: N prefill llumlets (with --decode M; instead of --instances)")
    up.add_argument("--decode", type=int, default=0, help="M decode llumlets (with --prefill N)")
    up.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    up.add_argument("--engine", choices=["sim", "vllm"], default=None, help="default: vllm when importable, else sim")
    up.add_argument("--model", default=None, help="local model directory (default: a tiny Llama made on first use)")
    up.add_argument("--ready-timeout-s", type=float, default=300.0)
    up.add_argument("--metrics-port", type=int, default=env("METRICS_PORT", 0),
                    help="P > 0: Prometheus /metrics of the scheduler on P and of llumlet i on P+1+i (the gateway "
                         "serves its own on --port); 0: only the gateway's")
    up.add_argument("--dispatch-policy", choices=POLICIES, default=env("DISPATCH_POLICY", "corral"),
                    help="the scheduler's dispatch rule by policy name (corral-prefix, prefix-only, kv-cost: the "
                         "gateway hashes prompts; give the llumlets a prefix cache, e.g. --sim-prefix-caching)")
    up.add_argument("--autoscale", action="store_true",
                    help="let the autoscaler start and stop llumlets (--instances is the initial count)")
    up.add_argument("--min-instances", type=int, default=1)
    up.add_argument("--max-instances", type=int, default=8)
    up.add_argument("--cpu-layout", choices=["auto", "off"], default=env("CPU_LAYOUT", "auto"),
                    help="auto: with vLLM on a CPU host, each llumlet gets cores of its own and the gateway, "
                         "scheduler and NATS share the rest (at least one core each; else nothing is bound)")

    scheduler_arguments(sub.add_parser("scheduler", help="run the global scheduler"))
    llumlet_arguments(sub.add_parser("llumlet", help="run one llumlet (one engine instance)"))
    gateway_arguments(sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway"))
    autoscaler = sub.add_parser("autoscaler", help="run the autoscaler (starts llumlets: local processes or Kubernetes)")
    autoscaler_arguments(autoscaler)
    provider_arguments(autoscaler)
    drain_arguments(sub.add_parser("drain", help="drain one llumlet by live migration and wait until it is empty"))
    make_model_arguments(sub.add_parser("make-model", help="write a tiny random-weight Llama model for tests and demos"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "up":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging(args.command)
    nats_auth.export(args)  # --nats-creds / --nats-tls-*: read by every NATS connection of this process
    handlers = {
        "scheduler": _cmd_scheduler,
        "llumlet": _cmd_llumlet,
        "gateway": _cmd_gateway,
        "autoscaler": _cmd_autoscaler,
        "make-model": _cmd_make_model,
        "drain": _cmd_drain,
    }
    if args.command == "up":
        return _cmd_up(args, extra)
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
