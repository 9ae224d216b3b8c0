"""Admission control live (issue 19 §1), with real scheduler, llumlet (simulated engine at the
A10's speed) and gateway processes:

- a burst past capacity gets 429s with Retry-After (and a retry-after-ms hint) at once,
  OpenAI-shaped, while what is admitted is served, and no admitted request misses the TTFT target
  by more than the prediction error the gateway reports; the llumlets' reports carry what the
  `predicted` policy reads (output so far, finished requests and their output, step pace);
- on one load, reports over NATS to scheduler processes, `predicted` admits where `current-load`
  refuses.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import time
from dataclasses import dataclass

import httpx
import msgspec
import nats
import pytest

from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import DispatchReply, DispatchRequest, Refusal, decode, encode
from shared.policy.admission import NUM_OUTPUT_BINS, output_length_bin
from tests.support.cluster import Cluster
from tests.support.observer import NatsObserver
from tests.unit.policy_helpers import make_load

PROMPT_TOKENS = 500  # 32 blocks of 16 (with the first token): three fit an instance of 128 blocks
MAX_TOKENS = 20
LLUMLET = ("--sim-num-blocks", "128", "--sim-time-scale", "1.0", "--max-model-len", "2048",
           "--report-interval-s", "0.05")
SLO_TTFT_S = 1.0
SCHEDULER = ("--admission", "predicted", "--slo-ttft-s", str(SLO_TTFT_S), "--slo-tbt-s", "0.5",
             "--admission-gpu", "A10")
BURST = 30
# The client's clock runs a little wider than the gateway's (which starts at the request's
# handler and stops at its first token): the HTTP hop on either side.
HTTP_SLACK_S = 0.25


@pytest.fixture
def cluster(tiny_model_dir, tmp_path):
    nats_server = start_nats()
    cluster = Cluster(nats_server.url, tiny_model_dir, tmp_path)
    cluster.start_scheduler(*SCHEDULER)
    for i in range(2):
        cluster.start_llumlet(f"adm-{i}", *LLUMLET)
    cluster.start_gateway()
    try:
        cluster.wait_ready(instances=2)
        yield cluster
    finally:
        cluster.stop()
        nats_server.stop()


@dataclass
class Outcome:
    status: int
    elapsed_s: float  # to the answer's head (a refusal) or its end (served)
    headers: httpx.Headers
    body: dict | None = None  # a refusal's
    ttft_s: float | None = None
    finish_reason: str | None = None


async def one(http: httpx.AsyncClient, model: str) -> Outcome:
    body = {"model": model, "prompt": [100] * PROMPT_TOKENS, "max_tokens": MAX_TOKENS, "stream": True}
    start = time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            return Outcome(reply.status_code, time.monotonic() - start, reply.headers,
                           json.loads(await reply.aread()))
        outcome = Outcome(200, 0.0, reply.headers)
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if outcome.ttft_s is None:
                outcome.ttft_s = time.monotonic() - start
            choice = json.loads(line[len("data: "):])["choices"][0]
            outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
        outcome.elapsed_s = time.monotonic() - start
        return outcome


def late_error_bound(metrics: str) -> tuple[float, int, int]:
    """From the gateway's metrics: the bucket bound under which every 'late' TTFT prediction
    error fell (0 when none was late), and how many first tokens were compared, late and early."""
    def samples(direction: str, suffix: str) -> list[tuple[str, float]]:
        pattern = (rf'^corral:gateway_ttft_prediction_error_seconds_{suffix}\{{([^}}]*direction="{direction}"[^}}]*)\}}'
                   r" (\S+)$")
        return [(labels, float(value)) for labels, value in re.findall(pattern, metrics, re.MULTILINE)]

    late = int(samples("late", "count")[0][1])
    early = int(samples("early", "count")[0][1])
    bound = 0.0
    if late:
        buckets = sorted((float(re.search(r'le="([^"]+)"', labels).group(1)), count)
                         for labels, count in samples("late", "bucket"))
        bound = next(le for le, count in buckets if count >= late)
    return bound, late, early


def test_a_burst_gets_429s_with_retry_after_and_the_admitted_meet_the_slo_within_the_reported_error(cluster):
    async def burst():
        async with NatsObserver(cluster.nats_url) as observer:
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                results = await asyncio.gather(*(one(http, model) for _ in range(BURST)))
                served = sum(r.status == 200 for r in results)
                # The llumlets' next reports count what they finished.
                await observer.wait_for(lambda latest: sum(r.num_finished_total for r in latest.values()) >= served)
                return results, [report for _, report in observer.reports], (await http.get("/metrics")).text

    results, reports, metrics = asyncio.run(burst())
    served = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    assert len(served) + len(refused) == BURST, [r.status for r in results]
    # Two instances of 128 blocks hold three such prompts each: the rest cannot start in time.
    assert 2 <= len(served) <= 12 and len(refused) >= BURST - 12
    for reply in refused:
        assert int(reply.headers["retry-after"]) >= 1
        assert int(reply.headers["retry-after-ms"]) > 0
        error = reply.body["error"]
        assert error["type"] and "SLO" in error["message"]
        assert reply.elapsed_s < 5.0  # refused at dispatch, not after queueing (100 ms when the box is idle)
    for reply in served:
        assert reply.finish_reason == "length"

    # Every admitted request's first token was compared with its prediction; none missed the
    # target by more than the error reported, and that error is within the target's size. (It
    # was 2.5 s before the scheduler counted back the dispatches a report had overtaken: an
    # instance took a prompt more than fits, which waited for memory.)
    bound, late, early = late_error_bound(metrics)
    assert late + early == len(served)
    assert bound <= SLO_TTFT_S, metrics
    for reply in served:
        assert reply.ttft_s <= SLO_TTFT_S + bound + HTTP_SLACK_S, (reply.ttft_s, bound)

    # What `predicted` reads came over NATS: output so far, finished requests, step pace.
    last = {report.instance_id: report for report in reports}
    assert sum(r.num_finished_total for r in last.values()) == len(served)
    assert sum(r.finished_output_tokens_total for r in last.values()) == len(served) * MAX_TOKENS
    assert sum(r.finished_output_histogram[output_length_bin(MAX_TOKENS)] for r in last.values()) == len(served)
    assert any(report.running_output_tokens and max(report.running_output_tokens) > 0 for report in reports)
    # The pace is reported while an instance decodes (an idle one forgets it: ServedTally.went_idle).
    served_by = {iid for iid, r in last.items() if r.num_finished_total}
    paced = {r.instance_id for r in reports
             if r.step_time_s > 0 and r.step_decode_batch >= 1 and r.step_decode_context > 0}
    assert served_by and served_by <= paced


# ---- predicted against current-load, on one load over NATS -----------------------------------------

SEQ = itertools.count(1)


def nearly_done_batch() -> bytes:
    """A report as a llumlet sends it: 100 requests decoding, each 10 tokens into an output this
    instance serves at 12 tokens (1,000 finished, by its histogram): they will have ended by the time a
    new prompt's prefill (behind 100 queued blocks) does, which `predicted` sees and
    `current-load`, counting them all in the decode batch, does not."""
    report = make_load("pd-a", total=6000, running={0: (100, 3750)}, waiting=[100])
    report = msgspec.structs.replace(report, seq=next(SEQ), sent_at=time.time(), running_output_tokens=[10] * 100,
                                     num_finished_total=1000, finished_output_tokens_total=12000,
                                     finished_output_histogram=served_at(12, 1000))
    return encode(report)


def served_at(tokens: int, count: int) -> list[int]:
    histogram = [0] * NUM_OUTPUT_BINS
    histogram[output_length_bin(tokens)] = count
    return histogram


async def ask_scheduler(nc, request_id: str, timeout_s: float = 30.0) -> DispatchReply:
    """The scheduler's answer once it has heard the instance (before, it has none to offer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await nc.publish(subjects.load_report("pd-a"), nearly_done_batch())
        try:
            msg = await nc.request(subjects.DISPATCH, encode(DispatchRequest(request_id, 100, 16)), timeout=2.0)
            reply = decode(msg.data, DispatchReply)
            if reply.reason is not Refusal.NO_INSTANCE:
                return reply
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            pass
        assert time.monotonic() < deadline, "the scheduler never answered with the instance known"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("policy", ["predicted", "current-load"])
def test_predicted_admits_a_finishing_batch_that_current_load_refuses(policy, tmp_path, tiny_model_dir):
    nats_server = start_nats()
    cluster = Cluster(nats_server.url, tiny_model_dir, tmp_path)
    cluster.start_scheduler("--admission", policy, "--slo-ttft-s", "1.0", "--slo-tbt-s", "0.1")

    async def decide() -> DispatchReply:
        nc = await nats.connect(nats_server.url)
        try:
            return await ask_scheduler(nc, f"probe-{policy}")
        finally:
            await nc.close()

    try:
        reply = asyncio.run(decide())
    finally:
        cluster.stop()
        nats_server.stop()
    if policy == "predicted":
        assert reply.instance_id == "pd-a" and reply.predicted_ttft_s is not None
        assert 0 < reply.predicted_ttft_s <= 1.0 and math.isfinite(reply.predicted_ttft_s)
    else:
        assert reply.instance_id is None and reply.reason is Refusal.OVERLOADED and "tbt" in reply.rejected
        assert reply.retry_after_s is not None and reply.retry_after_s > 0
