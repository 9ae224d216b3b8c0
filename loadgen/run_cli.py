"""`loadgen run`: command-line options → BenchmarkConfig → run → summary, JSON, plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

from loadgen.client import EndpointConfig, normalize_base_url
from loadgen.datasets import SPEC_HELP, parse_dataset_spec
from loadgen.errors import LoadgenError
from loadgen.metrics import DEFAULT_PERCENTILES, parse_goodput
from loadgen.progress import DEFAULT_INTERVAL_S, choose_mode
from loadgen.runner import BenchmarkConfig, BenchmarkResult, run_benchmark, run_title
from loadgen.schedule import SchedulePlan

_EPILOG = f"""dataset SPEC:
{SPEC_HELP}
Traces with lengths but no text get prompts synthesized to the exact token count with
--tokenizer; Mooncake hash_ids become shared 512-token prefix blocks.

arrivals: --request-rate R alone is a Poisson process; with --cv C (or vllm's --burstiness B =
1/C²) Gamma gaps; --trace-timestamps replays the dataset's own times (--time-scale 0.5 = twice
as fast); no rate sends everything at once, so --max-concurrency N gives a closed loop of N.

exit status: 0 when at least one request completed, 1 when none did, 2 on bad input.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="replay a dataset against an endpoint and measure it",
        description="Stream requests to an OpenAI-compatible endpoint and report TTFT, TPOT, ITL, "
        "E2EL, throughput and goodput as `vllm bench serve` does.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_options(parser)
    _add_traffic_options(parser)
    _add_output_options(parser)
    parser.set_defaults(handler=_main)


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("target")
    group.add_argument("--endpoint", required=True, help="server base URL, e.g. http://localhost:8000")
    group.add_argument("--model", required=True, help="model name sent in each request")
    group.add_argument("--api", choices=("chat", "completions"), default="chat", help="default: chat")
    group.add_argument("--dataset", required=True, metavar="SPEC", help="see 'dataset SPEC' below")
    group.add_argument("--tokenizer", metavar="DIR",
                       help="local Hugging Face tokenizer directory (default: --model when it is one)")
    group.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="bearer token (default: $OPENAI_API_KEY)")
    group.add_argument("--extra-body", metavar="JSON", help="extra JSON fields merged into every request")
    group.add_argument("--request-timeout", type=float, default=3600.0, metavar="S",
                       help="per-request timeout in seconds (default 3600)")


def _add_traffic_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("traffic")
    group.add_argument("--num-requests", type=int, metavar="N",
                       help="requests to send (default: the whole file; 1000 for synthetic/random)")
    group.add_argument("--duration", type=float, metavar="S",
                       help="stop sending new requests after S seconds")
    group.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                       help="requests per second (default inf: all at once)")
    shape = group.add_mutually_exclusive_group()
    shape.add_argument("--cv", type=float, help="coefficient of variation of the gaps (Gamma; 1 = Poisson)")
    shape.add_argument("--burstiness", type=float, help="vllm's Gamma shape, = 1/CV²")
    group.add_argument("--trace-timestamps", action="store_true",
                       help="replay the dataset's own arrival times")
    group.add_argument("--time-scale", type=float, default=1.0, metavar="F",
                       help="multiply trace times by F (0.5 = twice as fast)")
    group.add_argument("--max-concurrency", type=int, metavar="N", help="cap on requests in flight")
    group.add_argument("--seed", type=int, default=0, help="same seed, same request set (default 0)")
    group.add_argument("--priority-fraction", type=float, metavar="F",
                       help="send priority -1 (high) on a seeded fraction F of requests, 0 on the rest")
    group.add_argument("--max-tokens", default="trace", metavar="trace|N",
                       help="'trace': the dataset's output length (default); or a fixed number")
    group.add_argument("--default-output-len", type=int, default=256, metavar="N",
                       help="max_tokens under 'trace' when the dataset has no output length (default 256)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="send ignore_eos: generate exactly max_tokens")
    group.add_argument("--send-token-ids", action="store_true",
                       help="send prompts as token id lists (--api completions only)")


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=[],
                       help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    group.add_argument("--percentiles", default=",".join(f"{p:g}" for p in DEFAULT_PERCENTILES),
                       help="comma-separated percentiles (default 50,90,99)")
    group.add_argument("--result-file", metavar="PATH", help="write the JSON result here")
    group.add_argument("--save-detailed", action="store_true", help="add per-request lists to the JSON")
    group.add_argument("--plot", metavar="DIR", help="write latency CDFs and a timeline as PNG")
    group.add_argument("--label", help="label stored in the result")
    group.add_argument("--no-progress", action="store_true", help="no progress output")
    group.add_argument("--progress-interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                       help="when stderr is not a terminal, a progress line every S seconds "
                       f"(default {DEFAULT_INTERVAL_S:g}); on a terminal, a progress bar")


def build_config(args: argparse.Namespace) -> BenchmarkConfig:
    parse_dataset_spec(args.dataset)  # an unknown spec fails before anything else happens
    endpoint = EndpointConfig(
        base_url=normalize_base_url(args.endpoint),
        model=args.model,
        api=args.api,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        extra_body=_extra_body(args.extra_body),
        request_timeout_s=_positive(args.request_timeout, "--request-timeout"),
    )
    return BenchmarkConfig(
        endpoint=endpoint,
        dataset=args.dataset,
        plan=_plan(args),
        tokenizer=_tokenizer_dir(args),
        num_requests=_optional_positive(args.num_requests, "--num-requests"),
        duration_s=_optional_positive(args.duration, "--duration"),
        max_concurrency=_optional_positive(args.max_concurrency, "--max-concurrency"),
        percentiles=_percentiles(args.percentiles),
        goodput_ms=_goodput(args.goodput),
        label=args.label,
        progress=choose_mode(args.no_progress, sys.stderr),
        progress_interval_s=_positive(args.progress_interval, "--progress-interval"),
    )


def _plan(args: argparse.Namespace) -> SchedulePlan:
    cv = _cv(args)
    if args.trace_timestamps:
        arrival = "trace"
        if not parse_dataset_spec(args.dataset).has_timestamps:
            raise LoadgenError(
                "--trace-timestamps needs a dataset with timestamps (burstgpt, mooncake, azure)"
            )
    elif math.isinf(args.request_rate):
        arrival = "burst"
    else:
        arrival = "poisson" if cv == 1.0 else "gamma"
    if args.send_token_ids and args.api != "completions":
        raise LoadgenError("--send-token-ids needs --api completions (chat messages are text)")
    fraction = args.priority_fraction
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        raise LoadgenError(f"--priority-fraction must be within [0, 1], got {fraction}")
    return SchedulePlan(
        arrival=arrival,
        rate=_positive(args.request_rate, "--request-rate"),
        cv=cv,
        time_scale=_positive(args.time_scale, "--time-scale"),
        seed=args.seed,
        priority_fraction=fraction,
        max_tokens=_max_tokens(args.max_tokens),
        default_output_len=int(_positive(args.default_output_len, "--default-output-len")),
        send_token_ids=args.send_token_ids,
    )


def _cv(args: argparse.Namespace) -> float:
    if args.burstiness is not None:
        return 1.0 / math.sqrt(_positive(args.burstiness, "--burstiness"))
    return _positive(args.cv, "--cv") if args.cv is not None else 1.0


def _max_tokens(text: str) -> int | None:
    if text == "trace":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise LoadgenError(f"--max-tokens must be 'trace' or a positive integer, got {text!r}")
    return value


def _positive(value: float, option: str) -> float:
    if not value > 0:
        raise LoadgenError(f"{option} must be > 0, got {value}")
    return value


def _optional_positive(value: float | None, option: str) -> float | None:
    return None if value is None else _positive(value, option)


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or any(not 0 <= p <= 100 for p in values):
        raise LoadgenError(f"--percentiles must be comma-separated numbers within [0, 100], got {text!r}")
    return values


def _goodput(items: list[str]) -> dict[str, float]:
    try:
        return parse_goodput(items)
    except ValueError as exc:
        raise LoadgenError(str(exc)) from None


def _extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LoadgenError(f"--extra-body is not JSON: {exc.msg}") from None
    if not isinstance(body, dict):
        raise LoadgenError("--extra-body must be a JSON object")
    return body


def _tokenizer_dir(args: argparse.Namespace) -> str | None:
    if args.tokenizer:
        return args.tokenizer
    return args.model if Path(args.model).expanduser().is_dir() else None


def _main(args: argparse.Namespace) -> int:
    config = build_config(args)
    result = asyncio.run(run_benchmark(config))
    _report(result, args)
    if result.metrics.completed == 0:
        print("loadgen: warning: no request completed; see the errors above", file=sys.stderr)
        return 1
    return 0


def _report(result: BenchmarkResult, args: argparse.Namespace) -> None:
    from loadgen.report import format_summary, result_to_json, write_result

    models = result.served_models
    if models and args.model not in models:
        print(f"loadgen: warning: {args.model!r} is not among the served models {models}", file=sys.stderr)
    print(format_summary(result))
    if args.result_file:
        write_result(args.result_file, result_to_json(result, detailed=args.save_detailed))
        print(f"result written to {args.result_file}", file=sys.stderr)
    if args.plot:
        from loadgen.plots import write_plots

        for path in write_plots(result.records, args.plot, run_title(result.config)):
            print(f"plot written to {path}", file=sys.stderr)
