"""How long one full garbage collection holds the gateway's GIL, with and without `gc.freeze()`
after startup (services/gateway/server.py): the gateway's modules and tokenizer loaded, then a
live heap like that of `--streams` open streams (`--objects-per-stream` small objects each).

Each variant runs in a fresh process; prints and writes results/gateway_gc.json.
Usage: .venv/bin/python -m benchmarks.gateway_gc [--streams 1000] [--objects-per-stream 120]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(freeze: bool, streams: int, per_stream: int, repeats: int = 7) -> dict:
    import services.gateway.server  # noqa: F401 (what the gateway imports)
    from services.gateway.tokenizer import ModelTokenizer
    from services.tools.make_model import make_tiny_model

    model_dir = Path(tempfile.mkdtemp()) / "tiny"
    make_tiny_model(model_dir, seed=0)
    tokenizer = ModelTokenizer.load(str(model_dir))
    startup_objects = len(gc.get_objects())
    if freeze:
        gc.freeze()
    live = [[{"i": i, "tokens": list(range(20))} for i in range(per_stream // 2)] for _ in range(streams)]
    pauses = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect(2)
        pauses.append(time.perf_counter() - started)
    tokenizer.close()
    assert live
    pauses.sort()
    return {"freeze": freeze, "startup_objects": startup_objects, "tracked_objects": len(gc.get_objects()),
            "gen2_ms_min": round(pauses[0] * 1000, 1), "gen2_ms_median": round(pauses[len(pauses) // 2] * 1000, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--objects-per-stream", type=int, default=120)
    parser.add_argument("--one", choices=["freeze", "no-freeze"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "results" / "gateway_gc.json"))
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one == "freeze", args.streams, args.objects_per_stream)))
        return
    results = []
    for variant in ("no-freeze", "freeze", "no-freeze", "freeze"):  # interleaved: a loaded machine drifts
        out = subprocess.run([sys.executable, "-m", "benchmarks.gateway_gc", "--one", variant, "--streams",
                              str(args.streams), "--objects-per-stream", str(args.objects_per_stream)],
                             cwd=ROOT, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'variant':10} {'startup objs':>12} {'tracked':>9} {'gen2 min ms':>11} {'median ms':>9}")
    for r in results:
        print(f"{'freeze' if r['freeze'] else 'no freeze':10} {r['startup_objects']:12} {r['tracked_objects']:9} "
              f"{r['gen2_ms_min']:11} {r['gen2_ms_median']:9}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
