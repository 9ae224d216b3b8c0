"""`corral drain`: empty one llumlet before it goes, by live migration, and wait until it is empty.

The drain order marks the instance draining: dispatch sends it nothing new, its freeness drops to
-inf so the scheduler's migration pairing moves what it holds to other instances, and it takes no
incoming migration. This command is what a Kubernetes `preStop` hook runs; the autoscaler sends
the same order itself. Exit status: 0 empty (or not there at all), 1 still holding requests at the
deadline, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from shared import subjects
from shared.cancellation import wait_set
from shared.config import add_nats_argument, env
from shared.messages import Ack, DrainOrder, LoadReport, WireError, decode, encode
from shared.nats_client import connect, request as nats_request

log = logging.getLogger("corral.drain")


@dataclass(frozen=True)
class DrainOutcome:
    empty: bool
    reason: str  # in words, for the log and the exit message
    remaining: int = 0  # requests still held (running + waiting + migrating out) at the end


def is_empty(report: LoadReport) -> bool:
    """Drained: marked draining, and nothing running, waiting or migrating on it."""
    return report.draining and report.num_running == 0 and report.num_waiting == 0 and report.num_migrating == 0


def held(report: LoadReport) -> int:
    return report.num_running + report.num_waiting + report.num_migrating


async def drain_instance(nats_url: str, instance_id: str, timeout_s: float, absent_after_s: float = 3.0) -> DrainOutcome:
    """Order `instance_id` to drain and wait until its reports say it is empty."""
    nc = await connect(nats_url, f"drain-{instance_id}")
    latest: list[LoadReport] = []
    changed = asyncio.Event()

    async def on_report(msg: Msg) -> None:
        try:
            latest[:] = [decode(msg.data, LoadReport)]
        except WireError:
            return
        changed.set()

    try:
        await nc.subscribe(subjects.load_report(instance_id), cb=on_report)
        try:
            reply = await nats_request(nc, subjects.llumlet(instance_id, "drain"), encode(DrainOrder(drain=True)),
                                       absent_after_s)
            ack = decode(reply.data, Ack)
            if not ack.ok:
                return DrainOutcome(False, f"drain refused: {ack.error}")
        except (NoRespondersError, TimeoutError):
            return DrainOutcome(True, f"{instance_id} does not answer: nothing to drain")
        deadline = time.monotonic() + timeout_s
        while True:
            report = latest[0] if latest else None
            if report is not None and is_empty(report):
                return DrainOutcome(True, f"{instance_id} is empty")
            left = deadline - time.monotonic()
            if left <= 0:
                remaining = held(report) if report is not None else 0
                return DrainOutcome(False, f"{instance_id} still holds {remaining} requests after {timeout_s:g} s",
                                    remaining)
            changed.clear()
            wait_s = min(left, absent_after_s)
            if not await wait_set(changed, wait_s):
                if wait_s >= absent_after_s:  # silent that long: gone (else the deadline came first)
                    return DrainOutcome(True, f"{instance_id} stopped reporting: gone")
    finally:
        await nc.close()


async def _drain_within(nats_url: str, instance_id: str, timeout_s: float) -> DrainOutcome:
    """The whole drain, NATS connection included, ends by the deadline (a preStop hook must)."""
    try:
        async with asyncio.timeout(timeout_s + 5.0):
            return await drain_instance(nats_url, instance_id, timeout_s)
    except TimeoutError:
        return DrainOutcome(False, f"no answer from NATS at {nats_url} within {timeout_s + 5.0:g} s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_argument(parser)
    parser.add_argument("--instance-id", default=env("INSTANCE_ID", None),
                        help="the llumlet to drain (env CORRAL_INSTANCE_ID: in a llumlet's pod, itself)")
    parser.add_argument("--timeout-s", type=float, default=env("DRAIN_TIMEOUT_S", 240.0),
                        help="give up (exit 1) if requests are still held after this long")


def run(args: argparse.Namespace) -> int:
    if not args.instance_id:
        print("corral drain: error: --instance-id (or CORRAL_INSTANCE_ID) is required", file=sys.stderr)
        return 2
    try:
        subjects.valid_token(args.instance_id)
    except ValueError as exc:
        print(f"corral drain: error: {exc}", file=sys.stderr)
        return 2
    if args.timeout_s <= 0:
        print("corral drain: error: --timeout-s must be positive", file=sys.stderr)
        return 2
    outcome = asyncio.run(_drain_within(args.nats_url, args.instance_id, args.timeout_s))
    (log.info if outcome.empty else log.error)("%s", outcome.reason)
    return 0 if outcome.empty else 1
