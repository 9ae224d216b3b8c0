"""`loadgen compare A.json B.json`: two runs' metrics side by side with the ratio B/A."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from loadgen.errors import LoadgenError

_LEADING = (
    "completed", "failed", "rejected", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
)
_LATENCIES = ("ttft", "tpot", "itl", "e2el", "prefill_latency", "decode_latency")
_SKIPPED = ("request_rate", "burstiness", "max_concurrency", "num_prompts", "cv", "seed", "time_scale",
            "priority_fraction", "duration_limit_s")


def load_result(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise LoadgenError(f"cannot read result file {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LoadgenError(f"{path} is not a JSON result file") from None
    if not isinstance(data, dict):
        raise LoadgenError(f"{path} is not a JSON result file (expected an object)")
    return data


def comparable_metrics(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Numeric metric keys present in both, in a reading order: counts, throughputs, latencies."""
    def numeric(key: str) -> bool:
        return all(isinstance(d.get(key), (int, float)) and not isinstance(d.get(key), bool) for d in (a, b))

    ordered = [k for k in _LEADING if numeric(k)]
    for latency in _LATENCIES:
        ordered += [k for k in a if k.endswith(f"_{latency}_ms") and _stat_of(k, latency) and numeric(k)]
    ordered += [k for k in a if k not in ordered and k not in _SKIPPED and numeric(k)]
    return ordered


def _stat_of(key: str, latency: str) -> bool:
    stat = key[: -len(f"_{latency}_ms")]
    is_percentile = stat.startswith("p") and stat[1:].replace(".", "", 1).isdigit()
    return stat in ("mean", "median", "std") or is_percentile


def ratio(a: float, b: float) -> float:
    if a == 0:
        return 1.0 if b == 0 else math.inf
    return b / a


def format_comparison(a: dict[str, Any], b: dict[str, Any], name_a: str, name_b: str) -> str:
    keys = comparable_metrics(a, b)
    if not keys:
        raise LoadgenError("the two files share no numeric metric")
    width = max(len(k) for k in keys)
    header = f"{'metric':<{width}}  {'A':>14}  {'B':>14}  {'B/A':>8}"
    lines = [f"A = {name_a}", f"B = {name_b}", header, "-" * len(header)]
    for key in keys:
        lines.append(f"{key:<{width}}  {a[key]:>14.4g}  {b[key]:>14.4g}  {_ratio_text(a[key], b[key]):>8}")
    return "\n".join(lines)


def _ratio_text(a: float, b: float) -> str:
    value = ratio(a, b)
    return "inf" if math.isinf(value) else f"{value:.3f}"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare two result files metric by metric (ratio B/A)",
        description="Print the metrics of two `loadgen run --result-file` (or vllm bench serve) JSON "
        "files side by side with the ratio B/A.",
    )
    parser.add_argument("a", metavar="A.json", help="the baseline run")
    parser.add_argument("b", metavar="B.json", help="the run compared with it")
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    print(format_comparison(load_result(args.a), load_result(args.b), args.a, args.b))
    return 0
