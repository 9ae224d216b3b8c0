"""Settings of one simulated cluster (units in the names). Defaults: 16 × LLaMA-7B on A10."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from loadgen.simulator.admission import AdmissionModel
from shared.engine_model.latency import SIMPLE_MODELS
from shared.engine_model.config import SchedulerConfig
from shared.engine_model.report_cadence import DEFAULT_CHANGE_FRACTION
from shared.messages import InstanceRole
from shared.policy.config import PolicyConfig, ScalingConfig
from shared.policy.migration import (
    DEFAULT_AFFINITY,
    DEFAULT_GUARD,
    DEFAULT_MAX_IN,
    DEFAULT_MAX_OUT,
    DEFAULT_STAGES,
    IDLE_POLL_S,
    REFUSED_BACKOFF_S,
    CacheAffinity,
    MigrationGuard,
    StageRule,
)
from shared.policy.commit_hold import DEFAULT_HOLD, DEFAULT_NOTICE_STEPS, CommitHoldRule
from shared.policy.prefix_dispatch import (
    DEFAULT_CACHED_QUEUE_WEIGHT, DEFAULT_HELD_REQUEST_TOKENS, DEFAULT_RECOMPUTE_WEIGHT, DEFAULT_ROOM_WAIT_WEIGHT,
    DEFAULT_SATURATION_WEIGHT,
)

KV_BYTES_PER_TOKEN_LLAMA_7B = 2 * 32 * 4096 * 2  # K and V × layers × hidden × fp16 = 0.5 MiB


@dataclass(frozen=True)
class MigrationModel:
    """Multi-stage live migration (Llumnix §4.2): copy stages while the request keeps decoding,
    then a short stop for the last delta, by the llumlets' own stage rule (`StageRule`, the same
    defaults). Stage time = overhead + bytes / bandwidth."""

    bandwidth_gbps: float = 15.0  # GB/s (gigabytes), as the Llumnix artifact assumed for A10 nodes
    stage_overhead_s: float = 0.005  # pre-allocation handshake of one copy stage
    commit_overhead_s: float = 0.02  # last stage: suspend, commit handshake, resume on the destination
    stages: StageRule = DEFAULT_STAGES
    # Migrations in flight per instance, out and in counted apart, as the llumlets'.
    max_out: int = DEFAULT_MAX_OUT
    max_in: int = DEFAULT_MAX_IN
    # P/D hand-offs a prefill instance runs at once (the llumlet's --handoff-concurrency), in
    # place of `max_out`; the destination's limit stays `max_in`.
    handoff_concurrency: int = 2
    # Cache-aware migration (issue 18 §4), wherever the engines cache prefixes: pairing prefers a
    # destination holding the moving request's prefix (`affinity`), and the destination binds the
    # request to the cached blocks it holds, so only the blocks it lacks are copied. On, as the
    # services run it (the scheduler's pairer reads its prefix index, a destination pins what its
    # cache holds); False only to measure without it.
    cache_aware: bool = True
    affinity: CacheAffinity = DEFAULT_AFFINITY
    # The destination's commit hold (the llumlets' `--migration-hold-max-ms`, the same default):
    # a step about to start waits for a commit due within the rule's bound.
    hold: CommitHoldRule = DEFAULT_HOLD
    # A source notices its commit this many of its steps ahead (the llumlets'
    # `--migration-notice-steps`), and the destination paces its steps to meet it.
    notice_steps: int = DEFAULT_NOTICE_STEPS
    # A source whose destination refused (its guard at the first grant) or ran out of blocks
    # starts no migration to it for this long while the pair stands, as a llumlet.
    refused_backoff_s: float = REFUSED_BACKOFF_S
    # While its pair stands, a source starts the next migration as a slot frees (after a commit or
    # an abort), and with nothing it may start looks again after this long, as a llumlet.
    idle_poll_s: float = IDLE_POLL_S

    def __post_init__(self) -> None:
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise ValueError("migration bandwidth must be a positive number of GB/s")
        if self.stage_overhead_s < 0 or self.commit_overhead_s < 0:
            raise ValueError("migration overheads must be >= 0")
        if self.max_out < 1 or self.max_in < 1 or self.handoff_concurrency < 1:
            raise ValueError("migrations per instance and hand-off concurrency must be positive")
        if not self.idle_poll_s > 0:
            raise ValueError("a source's idle poll must be a positive time")
        if self.notice_steps < 1:
            raise ValueError("a commit's notice must come at least one step ahead (--migration-notice-steps >= 1)")

    def copy_s(self, num_blocks: int, block_bytes: int) -> float:
        return num_blocks * block_bytes / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class AutoscaleModel:
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    interval_s: float = 1.0  # how often the scaling policy looks
    startup_s: float = 10.0  # launch → first report (model load); billed from the launch

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or self.startup_s < 0:
            raise ValueError("autoscale interval must be > 0 and startup time >= 0")
        s = self.scaling
        if not 1 <= s.min_instances <= s.max_instances:
            raise ValueError("autoscale needs 1 <= min instances <= max instances")
        if not s.scale_out_below < s.scale_in_above:
            raise ValueError("autoscale band must have scale-out bound < scale-in bound")


@dataclass(frozen=True)
class SimConfig:
    num_instances: int = 16
    gpu: str = "A10"
    fine_latency: bool = False
    # Every instance's local scheduler, as a llumlet's simulated engine runs it (the queue policy
    # is the scheduling policy's own: `scheduler_config`).
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_LLAMA_7B
    report_interval_s: float = 0.05  # a policy sees reports at most this old (+ its own dispatches)
    # ... or this share of an instance's blocks freed or taken since: reported at once (`blocks_moved`)
    report_change_fraction: float = DEFAULT_CHANGE_FRACTION
    migration_interval_s: float = 0.1
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # The policy's anti-thrash guard, as the scheduler and the llumlets apply it (None: pair on
    # the threshold bands only, no destination check, no residence time).
    guard: MigrationGuard | None = DEFAULT_GUARD
    migration: MigrationModel = field(default_factory=MigrationModel)
    autoscale: AutoscaleModel | None = None
    timeline_interval_s: float = 1.0
    admission: AdmissionModel | None = None  # early rejection (None: admit everything)
    # P/D disaggregation (issue 19 §2): the first `num_prefill` instances prefill only, the next
    # `num_decode` decode only, the rest (and any the autoscaler adds) are mixed. 0/0: all mixed.
    num_prefill: int = 0
    num_decode: int = 0
    # corral-prefix's charge for prefill done again away from a prefix's best holder (as the
    # scheduler's --prefix-recompute-weight).
    prefix_recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT
    # and its charge for the blocks an instance lacks (as --prefix-room-wait-weight; inf: rooms first)
    prefix_room_wait_weight: float = DEFAULT_ROOM_WAIT_WEIGHT
    # and how much the recompute charge rises while every instance is queued (--prefix-saturation-weight)
    prefix_saturation_weight: float = DEFAULT_SATURATION_WEIGHT
    # and how much a queued prompt's cached prefix counts in the queue (--prefix-cached-queue-weight)
    prefix_cached_queue_weight: float = DEFAULT_CACHED_QUEUE_WEIGHT
    # and the prefill tokens each request held or queued counts for (--prefix-held-request-tokens)
    prefix_held_request_tokens: float = DEFAULT_HELD_REQUEST_TOKENS
    # A mixed fleet: every this many-th instance (the first, then every n-th after it) reports no
    # waiting prefill in tokens, as an engine without a prefix cache or an older llumlet does
    # (0: every instance tells, as the simulated engine with its prefix cache does).
    untold_every: int = 0

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise ValueError("the cluster needs at least one instance")
        if self.gpu not in SIMPLE_MODELS:
            raise ValueError(f"unknown GPU {self.gpu!r}; expected one of {', '.join(sorted(SIMPLE_MODELS))}")
        if self.kv_bytes_per_token < 1:
            raise ValueError("KV bytes per token must be positive")
        if self.untold_every < 0:
            raise ValueError("untold_every must be >= 0 (0: every instance tells its waiting prefill)")
        for name in ("report_interval_s", "migration_interval_s", "timeline_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if min(self.num_prefill, self.num_decode) < 0 or self.num_prefill + self.num_decode > self.num_instances:
            raise ValueError(f"{self.num_prefill} prefill + {self.num_decode} decode instances do not fit in "
                             f"{self.num_instances}")
        if self.autoscale is not None:
            s = self.autoscale.scaling
            if not s.min_instances <= self.num_instances <= s.max_instances:
                raise ValueError("the initial instance count must lie within the autoscale min/max")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0 or self.num_decode > 0

    def tells_prefill_tokens(self, index: int) -> bool:
        """Whether the `index`-th instance launched reports its waiting prefill in tokens."""
        return not (self.untold_every and index % self.untold_every == 0)

    def role_of(self, index: int) -> InstanceRole:
        """The role of the `index`-th instance launched."""
        if index < self.num_prefill:
            return InstanceRole.PREFILL
        if index < self.num_prefill + self.num_decode:
            return InstanceRole.DECODE
        return InstanceRole.MIXED

    def with_scheduler(self, **changes) -> SimConfig:
        """This cluster with these local-scheduler settings changed (`step_mode="v0"`, ...)."""
        return replace(self, scheduler=replace(self.scheduler, **changes))

    @property
    def block_bytes(self) -> int:
        return self.scheduler.block_size * self.kv_bytes_per_token

    def scheduler_config(self, queue_policy: str) -> SchedulerConfig:
        return replace(self.scheduler, queue_policy=queue_policy)

    @property
    def max_seq_len(self) -> int:
        """Longest sequence an instance can hold."""
        return self.scheduler.max_seq_len
