"""A llumlet's Prometheus metrics: what vLLM's engine measures, under vLLM's names and labels
(`model_name`, `engine` = this instance's id), and Corral's own (`corral:llumlet_*`).

Measured here because only the engine's side knows them: running/waiting, KV usage, preemptions,
prefix-cache lookups (counted with each request's first token), prompt and generation tokens as
the engine computes them, tokens per engine step, and each request's queue, prefill and
inference time and preemptions (vLLM's definitions: queued until the step that first schedules
it, prefill until its first token, inference until its last; a preemption restarts none). The
client-side latencies (TTFT, ITL, e2e, decode) are the gateway's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared import vllm_metrics as vllm
from shared.engine_model.views import RequestPhase, RequestView, StepOutput
from services.llumlet.handoff import HandoffOutcome
from shared.messages import LoadReport

# A commit hold lasts at most half a step (50 ms by default): milliseconds.
COMMIT_HOLD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1)

if TYPE_CHECKING:
    from services.llumlet.migration.outgoing import OutgoingMigration


# How often, at most, the engine's request views are read to see which queued requests a step
# scheduled: building them costs O(requests) (~0.7 ms for 256), too much for every step. A request's
# queue/prefill split is then exact to this much (their sum, arrival to first token, exactly).
SCHEDULE_PROBE_INTERVAL_S = 0.01


class LlumletMetrics:
    def __init__(self, model_name: str, instance_id: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = vllm.LABELS
        self._labels = (model_name, instance_id)
        self._queued: dict[str, float] = {}  # arrived, not yet seen scheduled: request id → arrival
        self._scheduled: dict[str, tuple[float, float]] = {}  # no first token yet: id → (arrival, scheduled)
        self._running: dict[str, float] = {}  # first token out, not finished: id → scheduled
        self._last_probe = float("-inf")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*self._labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*self._labels)  # present at 0 from the start

        def histogram(name: str, doc: str, buckets: Sequence[float] = vllm.REQUEST_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*self._labels)

        def by_label(metric: type[Counter] | type[Gauge], name: str, doc: str, label: str,
                     values: Iterable[str]) -> dict[str, Counter | Gauge]:
            family = metric(name, doc, [*labels, label], registry=r)
            return {v: family.labels(*self._labels, v) for v in values}  # every value present from the start

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        # Every waiting request here waits for room (nothing defers one: no LoRA budget, and a
        # migrated-in request's KV is in place before it joins the queue).
        self.waiting_by_reason = by_label(
            Gauge, "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: "
            "'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints "
            "(LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            "reason", vllm.WAITING_REASONS)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        # Prompt tokens looked up and found, as the engine reports them (zero on one without a prefix
        # cache: the simulator).
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        # Every hit is the engine's own prefix cache (vLLM's "device" tier).
        self.cached_by_source = by_label(
            Counter, "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that supplied "
            "them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) "
            "or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.", "source", vllm.CACHE_HIT_SOURCES)
        # Corral never fills a prompt from outside (a migration moves a request past its prefill).
        self.prompt_sources = by_label(Counter, "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                       "source", ("local_compute", "local_cache_hit", "external_kv_transfer"))
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          vllm.ITERATION_TOKENS_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.")
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.")
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.")
        self.request_preemptions = histogram("vllm:request_num_preemptions",
                                             "Histogram of the number of times a request was preempted.",
                                             vllm.REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.freeness = gauge("corral:llumlet_freeness", "Head-of-line freeness (Llumnix Algorithm 1)")
        self.dispatch_freeness = gauge("corral:llumlet_dispatch_freeness", "Freeness counting the whole waiting queue")
        migrations = Counter("corral:llumlet_migrations", "Requests migrated (committed), by direction",
                             [*labels, "direction"], registry=r)
        self.migrations = {d: migrations.labels(*self._labels, d) for d in ("in", "out")}
        # Outgoing migrations, committed or not (their stages' bytes crossed the wire either way).
        self.migration_kv_bytes = counter("corral:llumlet_migration_kv_bytes_sent",
                                          "KV-cache bytes this instance sent to migration destinations")
        self.migration_blocks_sent = counter("corral:llumlet_migration_blocks_sent",
                                             "KV blocks this instance sent to migration destinations")
        self.migration_blocks_cached = counter(
            "corral:llumlet_migration_blocks_cached",
            "KV blocks of outgoing migrations not sent: the destination's prefix cache held them")
        self.commit_holds = histogram(
            "corral:llumlet_migration_commit_hold_seconds",
            "Destination: how long an engine step waited for an imminent migration commit, or its paced share "
            "for one a few steps off (each other request of that step waited as long)", COMMIT_HOLD_BUCKETS)
        self.handoffs = by_label(Counter, "corral:llumlet_handoffs",
                                 "Prefill instance: requests at their first token, by how their hand-off to a "
                                 "decode instance ended", "outcome", [o.value for o in HandoffOutcome])
        self._preemptions_seen = 0

    # ---- load reports --------------------------------------------------------------------

    def observe_report(self, report: LoadReport) -> None:
        self.running.set(report.num_running)
        self.waiting.set(report.num_waiting)
        self.waiting_by_reason["capacity"].set(report.num_waiting)
        used = report.num_blocks_total - report.num_blocks_free
        self.kv_usage.set(used / report.num_blocks_total if report.num_blocks_total else 0.0)
        self.freeness.set(report.freeness)
        self.dispatch_freeness.set(report.dispatch_freeness)
        if report.num_preemptions_total > self._preemptions_seen:
            self.preemptions.inc(report.num_preemptions_total - self._preemptions_seen)
            self._preemptions_seen = report.num_preemptions_total

    # ---- requests and steps --------------------------------------------------------------

    def request_arrived(self, request_id: str, now: float) -> None:
        self._queued[request_id] = now

    def request_left(self, request_id: str) -> None:
        """Aborted, failed or migrated away before its first token: no queue/prefill time here."""
        self._queued.pop(request_id, None)
        self._scheduled.pop(request_id, None)
        self._running.pop(request_id, None)

    def wants_views(self, now: float) -> bool:
        """Whether to pass the engine's request views to `step_done`: some arrival is still queued
        and the last look is `SCHEDULE_PROBE_INTERVAL_S` old (a yes counts as the next look)."""
        if not self._queued or now - self._last_probe < SCHEDULE_PROBE_INTERVAL_S:
            return False
        self._last_probe = now
        return True

    def step_done(self, started: float, now: float, outputs: Iterable[StepOutput],
                  views: Iterable[RequestView] = ()) -> None:
        """One engine step that began at `started`: `views` (taken after it) say which queued
        requests are running now; its outputs carry the tokens it computed."""
        for view in views:
            if view.phase is RequestPhase.RUNNING and view.request_id in self._queued:
                self._scheduled[view.request_id] = (self._queued.pop(view.request_id), started)
        step_tokens = 0
        for output in outputs:
            self.generation_tokens.inc(len(output.token_ids))
            step_tokens += len(output.token_ids)
            if output.start_index == 0 and output.token_ids:  # its prefill finished in this step
                step_tokens += self._prefilled(output)
                self._first_token(output.request_id, started, now)
            if output.finish_reason is not None:
                self._finished(output, now)
                self.request_left(output.request_id)
        # As vLLM: a prompt's computed tokens count in the step that finishes its prefill.
        self.iteration_tokens.observe(step_tokens)

    def _prefilled(self, output: StepOutput) -> int:
        """Count a prompt whose prefill is done; the tokens the engine computed for it."""
        cached = output.num_cached_tokens or 0
        self.prompt_tokens.inc(output.num_prompt_tokens)
        self.prompt_tokens_cached.inc(cached)
        self.prompt_sources["local_compute"].inc(output.num_prompt_tokens - cached)
        self.prompt_sources["local_cache_hit"].inc(cached)
        if output.num_cached_tokens is not None:  # the engine looked the prompt up in its prefix cache
            self.prefix_queries.inc(output.num_prompt_tokens)
            self.prefix_hits.inc(cached)
            self.cached_by_source["device"].inc(cached)
        return output.num_prompt_tokens - cached

    def _first_token(self, request_id: str, started: float, now: float) -> None:
        if request_id in self._queued:  # scheduled by this very step (or between two looks)
            arrived, scheduled = self._queued.pop(request_id), started
        elif request_id in self._scheduled:
            arrived, scheduled = self._scheduled.pop(request_id)
        else:
            return  # arrived by migration, or before metrics were on
        self.queue_time.observe(max(0.0, scheduled - arrived))
        self.prefill_time.observe(max(0.0, now - scheduled))
        self._running[request_id] = scheduled

    def _finished(self, output: StepOutput, now: float) -> None:
        """Its preemptions (a migrated request's count carries over); its inference time when it
        was scheduled here (one that migrated in has its start on another instance's clock)."""
        self.request_preemptions.observe(output.num_preemptions)
        scheduled = self._running.get(output.request_id)
        if scheduled is not None:
            self.inference_time.observe(max(0.0, now - scheduled))

    def migrated(self, direction: str) -> None:
        self.migrations[direction].inc()

    def outgoing_migration_ended(self, m: OutgoingMigration) -> None:
        """One outgoing migration is over (committed or aborted): what it moved and skipped."""
        self.migration_kv_bytes.inc(sum(stage.num_bytes for stage in m.stages))
        self.migration_blocks_sent.inc(sum(stage.num_blocks for stage in m.stages))
        self.migration_blocks_cached.inc(m.cached_blocks)

    def handed_off(self, outcome: HandoffOutcome) -> None:
        self.handoffs[outcome.value].inc()
