"""N fake llumlets in one process, for the control-plane benchmark (benchmarks/control_plane.py).

Each fake instance builds a load report every `report_interval_s`, with the real builder
(`shared.engine_model.load_report.build_load_report`) from request counts that drift like a busy
instance's (a `drift_share` of the instances each interval), and publishes it on its real subject
by the llumlets' rule (`shared.engine_model.report_cadence`: with `heartbeat_s` > 0 only what says
something new, and a heartbeat); it answers generate orders on its real subject: an Ack, then
one `TokenChunk` per engine step (`step_s`) to the gateway's output subject until the request's
`max_tokens`. Nothing of an engine runs: what is measured is the control plane around it.

Run as a `multiprocessing` child (`run_impersonator`); the parent reads the counters it shares.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import nats

from shared import subjects
from shared.engine_model.load_report import RequestAggregates, build_load_report
from shared.engine_model.report_cadence import report_due
from shared.messages import (Ack, FinishReason, GenerateRequest, LoadReport, PriorityLoad, TokenChunk, TokenChunkBatch,
                             decode, encode)
from shared.policy.config import PolicyConfig

# Counter slots in the shared array the parent reads.
# BATCHING is an input: 1 sends a step's chunks per gateway as one TokenChunkBatch, as a llumlet does
# for a gateway that asks (GenerateRequest.batched_output); 0 one message per chunk, as before.
REPORTS, CHUNKS, GENERATES, BUSY_S, MESSAGES, BATCHING = range(6)
NUM_COUNTERS = 6
BLOCKS_TOTAL = 4096
BLOCK_SIZE = 16
TOKEN_ID = 82  # "l" in the tiny test model: each token is a visible character, an SSE event of its own


@dataclass
class _Stream:
    request_id: str
    reply_subject: str
    num_prompt_tokens: int
    max_tokens: int
    batched: bool
    sent: int = 0


@dataclass
class _FakeInstance:
    instance_id: str
    rng: random.Random
    seq: int = 0
    num_running: int = 0
    num_waiting: int = 0
    used_blocks: int = 0
    preemptions: int = 0
    streams: list[_Stream] = field(default_factory=list)
    last_sent: LoadReport | None = None
    last_sent_at: float = 0.0  # monotonic

    def drift(self) -> None:
        """A random walk of a loaded instance's queue, so reports (and dispatch scores) change."""
        rng = self.rng
        self.num_running = max(0, min(64, self.num_running + rng.randint(-2, 2)))
        self.num_waiting = max(0, min(16, self.num_waiting + rng.randint(-1, 1)))
        self.used_blocks = max(0, min(BLOCKS_TOTAL, self.num_running * 40 + rng.randint(-64, 64)))
        if rng.random() < 0.001:
            self.preemptions += 1

    def report(self, headroom: dict[int, int], heartbeat_s: float) -> bytes | None:
        """The report to publish now, or None when the llumlets' rule would skip it."""
        self.seq += 1
        running = self.num_running + len(self.streams)
        demand = self.num_waiting * 20
        requests = RequestAggregates(
            num_running=running, num_waiting=self.num_waiting,
            head_demand_blocks=20 if self.num_waiting else 0, waiting_demand_blocks=demand,
            by_priority=[PriorityLoad(priority=0, num_running=running, running_blocks=self.used_blocks,
                                      num_waiting=self.num_waiting, waiting_demand_blocks=demand)],
        )
        report = build_load_report(
            instance_id=self.instance_id, seq=self.seq, sent_at=time.time(), requests=requests,
            num_blocks_total=BLOCKS_TOTAL, num_blocks_free=BLOCKS_TOTAL - self.used_blocks, block_size=BLOCK_SIZE,
            num_preemptions_total=self.preemptions, headroom_blocks=headroom, kv_address="127.0.0.1:1",
            max_model_len=4096, model="fake", engine="impersonated",
        )
        now = time.monotonic()
        if not report_due(self.last_sent, report, now - self.last_sent_at, heartbeat_s):
            return None
        self.last_sent, self.last_sent_at = report, now
        return encode(report)


class Impersonator:
    def __init__(self, nats_url: str, instance_ids: list[str], report_interval_s: float, step_s: float,
                 counters, seed: int, heartbeat_s: float = 0.0, drift_share: float = 1.0) -> None:
        self.nats_url = nats_url
        self.instances = {iid: _FakeInstance(iid, random.Random(seed * 7919 + i)) for i, iid in enumerate(instance_ids)}
        self.report_interval_s = report_interval_s
        self.heartbeat_s = heartbeat_s
        self.drift_share = drift_share
        self.rng = random.Random(seed)
        self.step_s = step_s
        self.counters = counters
        self.headroom = dict(PolicyConfig().headroom_blocks)
        self.nc = None
        self.busy_s = 0.0

    async def run(self, stop) -> None:
        self.nc = await nats.connect(self.nats_url, name="impersonator", pending_size=64 * 1024 * 1024)
        for instance_id in self.instances:  # each on its own subject, as a llumlet
            await self.nc.subscribe(subjects.llumlet(instance_id, "generate"), cb=self._on_generate)
        tasks = [asyncio.create_task(self._report_loop()), asyncio.create_task(self._step_loop())]
        while not stop.is_set():
            await asyncio.sleep(0.1)
            self.counters[BUSY_S] = self.busy_s
        for task in tasks:
            task.cancel()
        await self.nc.close()

    async def _report_loop(self) -> None:
        """Spreads the fleet's reports evenly over each interval: a slice every tick."""
        fleet = list(self.instances.values())
        slices = 10
        tick = self.report_interval_s / slices
        due = time.monotonic()
        k = 0
        while True:
            started = time.perf_counter()
            published = 0
            for instance in fleet[k::slices]:
                if self.drift_share >= 1.0 or self.rng.random() < self.drift_share:
                    instance.drift()
                report = instance.report(self.headroom, self.heartbeat_s)
                if report is not None:
                    await self.nc.publish(subjects.load_report(instance.instance_id), report)
                    published += 1
            self.counters[REPORTS] += published
            self.busy_s += time.perf_counter() - started
            k = (k + 1) % slices
            due += tick
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    async def _on_generate(self, msg) -> None:
        started = time.perf_counter()
        request = decode(msg.data, GenerateRequest)
        instance_id = msg.subject.split(".")[2]
        self.instances[instance_id].streams.append(_Stream(
            request.request_id, request.reply_subject, len(request.prompt_token_ids), request.sampling.max_tokens,
            request.batched_output))
        await msg.respond(encode(Ack(ok=True)))
        self.counters[GENERATES] += 1
        self.busy_s += time.perf_counter() - started

    async def _step_loop(self) -> None:
        """One engine step for every instance with requests: a chunk per request."""
        due = time.monotonic()
        while True:
            started = time.perf_counter()
            sent = messages = 0
            batching = bool(self.counters[BATCHING])
            for instance in self.instances.values():
                if not instance.streams:
                    continue
                alive = []
                batches: dict[str, list[TokenChunk]] = {}
                for stream in instance.streams:
                    done = stream.sent + 1 >= stream.max_tokens
                    chunk = TokenChunk(
                        request_id=stream.request_id, instance_id=instance.instance_id, start_index=stream.sent,
                        token_ids=[TOKEN_ID], num_prompt_tokens=stream.num_prompt_tokens,
                        finish_reason=FinishReason.LENGTH if done else None)
                    if batching and stream.batched:
                        batches.setdefault(stream.reply_subject, []).append(chunk)
                    else:
                        await self.nc.publish(stream.reply_subject, encode(chunk))
                        messages += 1
                    stream.sent += 1
                    sent += 1
                    if not done:
                        alive.append(stream)
                for subject, chunks in batches.items():
                    await self.nc.publish(subject, encode(chunks[0] if len(chunks) == 1 else TokenChunkBatch(chunks)))
                    messages += 1
                instance.streams = alive
            self.counters[CHUNKS] += sent
            self.counters[MESSAGES] += messages
            self.busy_s += time.perf_counter() - started
            due += self.step_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))


def run_impersonator(nats_url: str, instance_ids: list[str], report_interval_s: float, step_s: float,
                     counters, stop, seed: int, heartbeat_s: float = 0.0, drift_share: float = 1.0) -> None:
    import uvloop

    impersonator = Impersonator(nats_url, instance_ids, report_interval_s, step_s, counters, seed, heartbeat_s,
                                drift_share)
    uvloop.run(impersonator.run(stop))
