"""The cluster simulation: arrivals, dispatch, engine steps per instance, and the periodic
migration rounds, scaling ticks and timeline samples, in virtual time.

Dispatch sees each instance's last load report (at most `report_interval_s` old) plus its own
`account_dispatch` bookkeeping since, as the global scheduler does. A report is produced the
first time a policy looks after the previous one has aged out, or after a step that moved the
instance's free blocks by `report_change_fraction` of them (a live llumlet reports those at once),
so staleness stays bounded without paying for reports nobody reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loadgen.datasets import PREFIX_BLOCK_TOKENS
from loadgen.simulator.admission import SimAdmission
from loadgen.simulator.autoscale import Autoscaler, ScalingEvent
from loadgen.simulator.config import SimConfig
from loadgen.simulator.dispatch_view import IndexedDispatch
from loadgen.simulator.events import EventQueue
from loadgen.simulator.handoff import Handoffs, HandoffStats
from loadgen.simulator.instance import InstanceState, SimInstance
from loadgen.simulator.migration import Migrator
from loadgen.simulator.migration_state import MigrationStats
from loadgen.simulator.timeline import Timeline
from loadgen.simulator.workload import SimArrival, Workload
from shared.engine_model.latency import LatencyModel
from shared.engine_model.report_cadence import blocks_moved
from shared.engine_model.request import SimRequest
from shared.engine_model.scheduler import SimScheduler
from shared.messages import DispatchRequest, LoadReport, Refusal
from shared.policy.admission import AdmissionPolicy
from shared.policy.baselines import DispatchRule, SchedulingPolicy, dispatch
from shared.policy.disaggregation import dispatch_pool
from shared.policy.dispatch import DispatchDecision, account_dispatch
from shared.policy.prefix_dispatch import PrefixContext, cached_tokens, matched_blocks
from shared.prefix_hash import trace_block_hashes


@dataclass
class DispatchRecord:
    request_id: str
    instance_id: str | None
    rejected: str | None = None
    at_s: float = 0.0  # when it arrived


@dataclass
class SimResult:
    policy: str
    workload: str
    finished: list[SimRequest]  # final state of every completed request (on its last instance)
    labels: dict[str, int]  # request id -> priority as labelled by the workload
    num_requests: int
    rejected: list[DispatchRecord]
    migrations: MigrationStats
    scaling_events: list[ScalingEvent]
    lifetimes: list[tuple[str, float, float]]  # (instance, launched at, stopped at or end)
    timeline: Timeline
    makespan_s: float
    wall_s: float
    num_steps: int
    num_preemptions: int
    dispatches: list[DispatchRecord] = field(default_factory=list)  # when record_dispatches
    handoffs: HandoffStats | None = None  # P/D hand-offs, when the cluster has roles
    # Admission's predicted TTFT on the instance each admitted request went to (request id -> s).
    predicted_ttft_s: dict[str, float] = field(default_factory=dict)

    @property
    def instance_seconds(self) -> float:
        return sum(stop - start for _, start, stop in self.lifetimes)


class ClusterSimulator:
    def __init__(
        self, config: SimConfig, policy: SchedulingPolicy, workload: Workload, *, record_dispatches: bool = False,
        dispatch_index: bool = True,
    ) -> None:
        self.config = config
        self.policy = policy
        self.policy_config = policy.policy_config(config.policy)
        self.workload = workload
        self.events = EventQueue()
        self.now = 0.0
        self.latency = LatencyModel(config.gpu, fine=config.fine_latency)
        self.instances: dict[str, SimInstance] = {}
        self.serving: list[SimInstance] = []  # live and draining, in launch order
        self.labels: dict[str, int] = {}
        self.placed_at: dict[str, float] = {}  # request id -> when it reached its current instance
        self.predicted_ttft_s: dict[str, float] = {}  # admission's, on the instance chosen
        self._predictions: dict[str, float] = {}  # the last admission decision's, per instance
        self.finished: list[SimRequest] = []
        self.rejected: list[DispatchRecord] = []
        self.dispatches: list[DispatchRecord] | None = [] if record_dispatches else None
        self.done = not workload.arrivals
        self._turn = 0
        self._next_arrival = 0
        self._fresh_reports = policy.dispatch is not DispatchRule.ROUND_ROBIN
        # Block hashes travel with a request when an engine caches prefixes or dispatch reads them.
        self._hash_prompts = config.scheduler.enable_prefix_caching or policy.dispatch.uses_prefix_index
        self.prefix = PrefixContext(SimPrefixIndex(self.instances), self._prefill_s,
                                    recompute_weight=config.prefix_recompute_weight,
                                    room_wait_weight=config.prefix_room_wait_weight,
                                    saturation_weight=config.prefix_saturation_weight,
                                    cached_queue_weight=config.prefix_cached_queue_weight,
                                    held_request_tokens=config.prefix_held_request_tokens)
        # P/D hand-offs ride the migration machinery even under a policy that never rebalances.
        self.migrator = Migrator(self) if policy.migration or config.disaggregated else None
        self.handoffs = Handoffs(self, self.migrator) if config.disaggregated else None
        self.autoscaler = Autoscaler(self, config.autoscale) if config.autoscale else None
        admission = config.admission
        self.admission = (SimAdmission(admission, self.latency, self.instances)
                          if admission is not None and admission.policy is not AdmissionPolicy.NONE else None)
        # Freeness dispatch reads the live scheduler's index (same decisions as the scan, tested);
        # `dispatch_index=False` scans every instance per arrival, as before (benchmarks compare).
        self.indexed = (IndexedDispatch(self.policy_config, config.report_interval_s, config.max_seq_len)
                        if dispatch_index and policy.dispatch is DispatchRule.FREENESS and self.admission is None
                        and not config.num_prefill
                        else None)
        self.timeline = Timeline()
        for _ in range(config.num_instances):
            self.launch_instance(ready_after_s=0.0)

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> SimResult:
        started = time.perf_counter()
        if self.workload.arrivals:
            self.events.push(self.workload.arrivals[0].time_s, self._on_arrival)
        if self.migrator is not None and self.policy.migration:
            self.events.push(self.config.migration_interval_s, self.migrator.on_round)
        if self.autoscaler is not None:
            self.events.push(self.config.autoscale.interval_s, self.autoscaler.on_tick)
        self.events.push(0.0, self._on_timeline)
        events = self.events
        pop = events.pop
        while not self.done:
            if not events:
                raise RuntimeError(f"simulation stalled at t={self.now:.3f}s: {self._stall_report()}")
            self.now, handler, payload = pop()
            handler(payload)
        if self.migrator is not None:
            self.migrator.close()
        if self.handoffs is not None:
            self.handoffs.close()
        self._sample_timeline()
        return self._result(time.perf_counter() - started)

    # -- instances -------------------------------------------------------------------------------

    def launch_instance(self, ready_after_s: float) -> SimInstance:
        instance_id = f"i{len(self.instances):03d}"
        scheduler = SimScheduler(self.config.scheduler_config(self.policy.queue_policy))
        instance = SimInstance(instance_id, scheduler, self.latency, launched_at=self.now,
                               role=self.config.role_of(len(self.instances)),
                               tells_prefill_tokens=self.config.tells_prefill_tokens(len(self.instances)),
                               max_migrations_in=self.config.migration.max_in)
        if self.indexed is not None:
            instance.on_report = self.indexed.reported
        self.instances[instance_id] = instance
        if ready_after_s > 0:
            instance.state = InstanceState.STARTING
            self.events.push(self.now + ready_after_s, self._on_ready, instance)
        else:
            self._serve(instance)
        return instance

    def _on_ready(self, instance: SimInstance) -> None:
        instance.state = InstanceState.LIVE
        self._serve(instance)

    def _serve(self, instance: SimInstance) -> None:
        self.serving.append(instance)
        if self.indexed is not None:
            self.indexed.joined(instance)

    def drain(self, instance: SimInstance) -> None:
        assert instance.state is InstanceState.LIVE, instance.state
        instance.state = InstanceState.DRAINING
        instance.build_report(self.now, self.config.max_seq_len)
        self.maybe_stop(instance)

    def maybe_stop(self, instance: SimInstance) -> None:
        """A draining instance stops once nothing is left on it (nothing is ever dropped)."""
        if instance.state is InstanceState.DRAINING and instance.is_empty():
            instance.state = InstanceState.STOPPED
            instance.stopped_at = self.now
            self.serving.remove(instance)
            if self.indexed is not None:
                self.indexed.left(instance)

    def kick(self, instance: SimInstance) -> None:
        """Start the instance's next step if it is idle and has something it can run."""
        if instance.step is None:
            self._start_step(instance)

    def _start_step(self, instance: SimInstance) -> bool:
        """Start the idle instance's next step unless a commit hold keeps it (the commit it waits
        for kicks it); whether a step started."""
        if self.migrator is not None and self.migrator.holds_step(instance, self.now):
            return False
        duration = instance.start_step(self.now)
        if duration is None:
            return False
        if self.migrator is not None:
            self.migrator.step_started(instance)
        self.events.push(self.now + duration, self._on_step_end, instance)
        return True

    def _on_step_end(self, instance: SimInstance) -> None:
        step = instance.end_step()
        events = instance.scheduler.update_from_output(step, self.now)
        if events.new_token and blocks_moved(instance.report, instance.scheduler.block_manager.num_free,
                                             instance.scheduler.config.num_blocks, self.config.report_change_fraction):
            instance.build_report(self.now, self.config.max_seq_len)  # (reported at once, as a live llumlet)
        finished = events.finished
        if self.admission is not None:
            self.admission.observe_step(instance.instance_id, step)
            if finished:
                self.admission.observe_finished(instance.instance_id, finished)
        if finished:
            for request in finished:
                self.finished.append(request)
                del self.placed_at[request.request_id]
            if len(self.finished) + len(self.rejected) == len(self.workload.arrivals):
                self.done = True
        if self.handoffs is not None and events.new_token:
            self.handoffs.on_first_tokens(instance, events.new_token)
        if self.migrator is not None:
            self.migrator.on_step_end(instance, events.new_token)
        if not self._start_step(instance) and instance.state is InstanceState.DRAINING:
            self.maybe_stop(instance)

    # -- load reports ------------------------------------------------------------------------------

    def report_of(self, instance: SimInstance, fresh: bool = False) -> LoadReport:
        if fresh or self.now - instance.report_at >= self.config.report_interval_s or instance.report is None:
            return instance.build_report(self.now, self.config.max_seq_len)
        return instance.report

    def loads(self) -> list[LoadReport]:
        """The reports of the serving instances as the global scheduler holds them now."""
        now, interval, max_len = self.now, self.config.report_interval_s, self.config.max_seq_len
        reports = []
        for instance in self.serving:  # report_of, inlined: this runs for every arrival
            report = instance.report
            if report is None or now - instance.report_at >= interval:
                report = instance.build_report(now, max_len)
            reports.append(report)
        return reports

    # -- arrivals and dispatch ---------------------------------------------------------------------

    def _on_arrival(self, _: object) -> None:
        arrivals = self.workload.arrivals
        arrival = arrivals[self._next_arrival]
        self._next_arrival += 1
        if self._next_arrival < len(arrivals):
            self.events.push(arrivals[self._next_arrival].time_s, self._on_arrival)
        self._dispatch(arrival)

    def _dispatch(self, arrival: SimArrival) -> None:
        request_id = f"r{arrival.index}"
        priority = self.policy.effective_priority(arrival.priority)
        hashes = self._block_hashes(arrival)
        message = DispatchRequest(request_id, arrival.prompt_len, arrival.output_len, priority,
                                  block_hashes=hashes, prefix_block_size=self.config.scheduler.block_size)
        if self.indexed is not None:
            decision = self.indexed.choose(self.now, message)
        else:
            decision = self._decide(arrival, message, priority)
        self._turn += 1
        self.labels[request_id] = arrival.priority
        record = DispatchRecord(request_id, decision.instance_id, decision.rejected, self.now)
        if self.dispatches is not None:
            self.dispatches.append(record)
        if decision.instance_id is None:
            self.rejected.append(record)
            self.done = len(self.finished) + len(self.rejected) == len(self.workload.arrivals)
            return
        instance = self.instances[decision.instance_id]
        if decision.instance_id in self._predictions:
            self.predicted_ttft_s[request_id] = self._predictions[decision.instance_id]
        if self._fresh_reports:
            instance.report = account_dispatch(instance.report, message, decision.cached_tokens)
            if self.indexed is not None:
                self.indexed.accounted(instance)
        request = SimRequest(
            request_id, arrival.prompt_len, max_tokens=arrival.output_len, priority=priority, arrival_time=self.now,
            block_hashes=tuple(hashes),
        )
        instance.scheduler.add_request(request)
        self.placed_at[request_id] = self.now
        self.kick(instance)

    def _decide(self, arrival: SimArrival, message: DispatchRequest, priority: int) -> DispatchDecision:
        """The policy's choice over every serving instance's report (a scan per arrival)."""
        if self._fresh_reports:
            loads = self.loads()
        else:  # round-robin reads no load; a report only tells it who is serving
            loads = [instance.report or self.report_of(instance) for instance in self.serving]
        fleet = loads
        if self.config.num_prefill:  # new requests go to prefill (and mixed) instances only
            loads = dispatch_pool(loads)
        self._predictions = {}
        # Early rejection, before any prefill is spent; with every instance draining nothing to
        # predict: dispatch answers as without admission (as the live scheduler's `check`).
        if self.admission is not None and any(not load.draining for load in loads):
            matched = matched_blocks(message, self.prefix.index)  # (none without prefix caching)
            cached = {load.instance_id: cached_tokens(load, message, matched) for load in loads}
            admitted = self.admission.decide(loads, arrival.prompt_len, priority, fleet, cached)
            self._predictions = {p.instance_id: p.ttft_s for p in admitted.predictions}
            if not admitted.accepted:
                return DispatchDecision(None, f"overloaded:{admitted.rejected.value}", Refusal.OVERLOADED)
            loads = [load for load in loads if load.instance_id in admitted.admitted]
        return dispatch(self.policy, loads, message, self.policy_config, self._turn, self.prefix)

    def _prefill_s(self, num_tokens: int) -> float:
        return self.latency.prefill_ms(num_tokens) / 1e3 if num_tokens > 0 else 0.0

    def _block_hashes(self, arrival: SimArrival) -> list[int]:
        """The prompt's chain from the trace's hash_ids (none without them or when unused)."""
        if not (self._hash_prompts and arrival.hash_ids):
            return []
        return trace_block_hashes(arrival.hash_ids, PREFIX_BLOCK_TOKENS, arrival.prompt_len,
                                  self.config.scheduler.block_size)

    # -- timeline ----------------------------------------------------------------------------------

    def _on_timeline(self, _: object) -> None:
        self._sample_timeline()
        self.events.push(self.now + self.config.timeline_interval_s, self._on_timeline)

    def _sample_timeline(self) -> None:
        in_flight = self.migrator.in_flight if self.migrator is not None else 0
        starting = sum(i.state is InstanceState.STARTING for i in self.instances.values())
        self.timeline.sample(self.now, self.serving, starting, in_flight)

    # -- results -----------------------------------------------------------------------------------

    def _result(self, wall_s: float) -> SimResult:
        end = self.now
        lifetimes = [
            (i.instance_id, i.launched_at, i.stopped_at if i.stopped_at is not None else end)
            for i in self.instances.values()
        ]
        return SimResult(
            policy=self.policy.name,
            workload=self.workload.description,
            finished=self.finished,
            labels=self.labels,
            num_requests=len(self.workload.arrivals),
            rejected=self.rejected,
            migrations=self.migrator.stats if self.migrator is not None else MigrationStats(),
            scaling_events=self.autoscaler.events if self.autoscaler is not None else [],
            lifetimes=lifetimes,
            timeline=self.timeline,
            makespan_s=end,
            wall_s=wall_s,
            num_steps=sum(i.num_steps for i in self.instances.values()),
            num_preemptions=sum(i.scheduler.num_preemptions_total for i in self.instances.values()),
            dispatches=self.dispatches or [],
            handoffs=self.handoffs.stats if self.handoffs is not None else None,
            predicted_ttft_s=self.predicted_ttft_s,
        )

    def _stall_report(self) -> str:
        stuck = [
            f"{i.instance_id}({i.state.value}: {len(i.scheduler.running)} running, {len(i.scheduler.waiting)} waiting, "
            f"{i.scheduler.block_manager.num_free} free blocks)"
            for i in self.instances.values()
            if i.scheduler.requests
        ]
        done = len(self.finished) + len(self.rejected)
        return f"{done} of {len(self.workload.arrivals)} requests done; {', '.join(stuck) or 'no instance holds work'}"


class SimPrefixIndex:
    """The global prefix index of the simulation: it reads the instances' caches directly,
    through the interface a live index fed by KV events answers (`PrefixIndex`)."""

    def __init__(self, instances: dict[str, SimInstance]) -> None:
        self._instances = instances

    def matches(self, block_hashes: list[int]) -> dict[str, int]:
        matched = {}
        for instance_id, instance in self._instances.items():
            cache = instance.scheduler.prefix_cache
            if cache is not None and cache.holds(block_hashes[0]):
                matched[instance_id] = cache.matched_blocks(block_hashes)
        return matched


def simulate(config: SimConfig, policy: SchedulingPolicy, workload: Workload) -> SimResult:
    return ClusterSimulator(config, policy, workload).run()
