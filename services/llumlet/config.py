"""Llumlet settings: one dataclass, flags with env-variable defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.llumlet.engines.sim.config import SimEngineConfig
from services.llumlet.migration.protocol import MigrationLimits
from shared import subjects
from shared.config import add_nats_argument, env, short_id
from shared.engine_model.config import QUEUE_POLICIES, STEP_MODES, SchedulerConfig
from shared.engine_model.latency import SIMPLE_MODELS
from shared.engine_model.report_cadence import DEFAULT_CHANGE_FRACTION, DEFAULT_HEARTBEAT_S, MAX_HEARTBEAT_S
from shared.messages import InstanceRole
from shared.policy.config import PolicyConfig


@dataclass
class VllmSettings:
    kv_cache_space_gib: float = 1.0
    max_num_seqs: int = 64
    cpu_threads: int = 1  # torch threads on a CPU host (corral up: the cores it gave this llumlet)
    prefix_caching: bool = True  # vLLM's automatic prefix caching (and its KV events, cache-aware migration)


@dataclass
class LlumletConfig:
    instance_id: str
    nats_url: str
    engine: str = "sim"
    model_dir: str | None = None
    max_model_len: int = 2048
    report_interval_s: float = 0.05
    # A report that says nothing new is sent only this long after the last one (0: every one).
    report_heartbeat_s: float = DEFAULT_HEARTBEAT_S
    # SIGTERM: requests migrate out (or finish) for up to this long; what is left then is handed
    # to the gateways to resume elsewhere by recompute.
    stop_grace_s: float = 10.0
    metrics_port: int = 0  # Prometheus /metrics (0: off; several llumlets on one host would collide)
    # Publish a report at once when free blocks moved by this fraction of the capacity.
    report_change_fraction: float = DEFAULT_CHANGE_FRACTION
    seed: int = 0
    # Prefill/decode disaggregation (issue 19 §2): a prefill instance hands each request, at its
    # first token, to a decode instance by live migration (`handoff_concurrency` at a time);
    # decode instances take no new requests while a prefill instance is live.
    role: InstanceRole = InstanceRole.MIXED
    handoff_concurrency: int = 2
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # Live migration: the KV receiver listens on kv_host:kv_port (0: an ephemeral port) and is
    # advertised to peers as kv_advertise_host (default: kv_host).
    enable_migration: bool = True
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_advertise_host: str | None = None
    migration: MigrationLimits = field(default_factory=MigrationLimits)
    # The simulated engine; its scheduler's max_model_len and its seed are the llumlet's own
    # (above), which `create_engine` puts in, as the model's vocabulary.
    sim: SimEngineConfig = field(default_factory=SimEngineConfig)
    vllm: VllmSettings = field(default_factory=VllmSettings)


def default_engine() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "sim"
    return "vllm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_argument(parser)
    parser.add_argument("--instance-id", default=env("INSTANCE_ID", None), help="default: a random id")
    parser.add_argument("--engine", choices=["sim", "vllm"], default=env("ENGINE", None),
                        help="inference engine (default: vllm when importable, else sim)")
    parser.add_argument("--model", dest="model_dir", default=env("MODEL_DIR", None),
                        help="local model directory (env CORRAL_MODEL_DIR)")
    parser.add_argument("--max-model-len", type=int, default=env("MAX_MODEL_LEN", 2048))
    parser.add_argument("--report-interval-s", type=float, default=env("REPORT_INTERVAL_S", 0.05))
    parser.add_argument("--report-heartbeat-s", type=float, default=env("REPORT_HEARTBEAT_S", DEFAULT_HEARTBEAT_S),
                        help="a report that says nothing new goes out only this long after the last one sent "
                             "(0: every report goes out); under the gateways' 0.8 s death limit")
    parser.add_argument("--stop-grace-s", type=float, default=env("STOP_GRACE_S", 10.0),
                        help="on SIGTERM, migrate requests out (or let them finish) for up to this long, "
                             "then hand the rest to the gateways to resume elsewhere (0: at once)")
    parser.add_argument("--seed", type=int, default=env("SEED", 0))
    parser.add_argument("--metrics-port", type=int, default=env("METRICS_PORT", 0),
                        help="serve Prometheus metrics on this port (0: off)")
    parser.add_argument("--role", choices=[r.value for r in InstanceRole], default=env("ROLE", "mixed"),
                        help="prefill: take new requests and hand each to a decode instance at its first token "
                             "(live migration); decode: take only hand-offs while a prefill instance is live; "
                             "mixed: both (default)")
    parser.add_argument("--handoff-concurrency", type=int, default=env("HANDOFF_CONCURRENCY", 2),
                        help="a prefill instance's hand-offs in flight at once")
    mig = parser.add_argument_group("live migration")
    mig.add_argument("--enable-migration", action=argparse.BooleanOptionalAction,
                     default=env("ENABLE_MIGRATION", True), help="take part in live migration (default: on)")
    mig.add_argument("--kv-host", default=env("KV_HOST", "127.0.0.1"), help="KV receiver bind address")
    mig.add_argument("--kv-port", type=int, default=env("KV_PORT", 0), help="KV receiver port (0: ephemeral)")
    mig.add_argument("--kv-advertise-host", default=env("KV_ADVERTISE_HOST", None),
                     help="address peers use to reach the KV receiver (default: --kv-host)")
    defaults = MigrationLimits()
    mig.add_argument("--migration-max-out", type=int, default=env("MIGRATION_MAX_OUT", defaults.max_out),
                     help="concurrent outgoing migrations")
    mig.add_argument("--migration-max-in", type=int, default=env("MIGRATION_MAX_IN", defaults.max_in),
                     help="concurrent incoming migrations")
    mig.add_argument("--migration-stage-limit", type=int, default=env("MIGRATION_STAGE_LIMIT", defaults.stage_limit),
                     help="the last stage is forced at this stage count (1: blocking copy)")
    mig.add_argument("--migration-last-stage-blocks", type=int,
                     default=env("MIGRATION_LAST_STAGE_BLOCKS", defaults.last_stage_blocks),
                     help="suspend and copy the rest once at most this many full blocks remain")
    mig.add_argument("--migration-lease-s", type=float, default=env("MIGRATION_LEASE_S", defaults.lease_s),
                     help="reserved blocks of an incoming migration are freed if the source is silent this long")
    mig.add_argument("--migration-pair-ttl-s", type=float, default=env("MIGRATION_PAIR_TTL_S", defaults.pair_ttl_s),
                     help="a migrate order lapses unless the scheduler re-confirms it within this time")
    mig.add_argument("--migration-min-residence-s", type=float,
                     default=env("MIGRATION_MIN_RESIDENCE_S", defaults.min_residence_s),
                     help="a request migrates out only after this long here since it arrived or migrated in")
    mig.add_argument("--migration-min-return-s", type=float,
                     default=env("MIGRATION_MIN_RETURN_S", defaults.min_return_s),
                     help="a request migrates to an instance it left only this long after it left")
    mig.add_argument("--migration-dest-max-waiting", type=int,
                     default=env("MIGRATION_DEST_MAX_WAITING", defaults.dest_max_waiting),
                     help="refuse incoming migrations while more requests than this wait here")
    mig.add_argument("--migration-dest-min-free-fraction", type=float,
                     default=env("MIGRATION_DEST_MIN_FREE_FRACTION", defaults.dest_min_free_fraction),
                     help="refuse an incoming migration that would leave less than this fraction of blocks free")
    mig.add_argument("--migration-bandwidth-mib-s", type=float, default=env("MIGRATION_BANDWIDTH_MIB_S", 0.0),
                     help="cap on the KV data plane's rate in MiB/s (0: none)")
    mig.add_argument("--migration-token-frames", action=argparse.BooleanOptionalAction,
                     default=env("MIGRATION_TOKEN_FRAMES", defaults.token_frames),
                     help="as a source, send the computed slots of a block not yet full by token, where the KV "
                          "layout allows it (host memory), so the last stage carries only the tokens computed "
                          "since the stage before; --no-migration-token-frames: whole blocks only")
    mig.add_argument("--migration-hold-max-ms", type=float,
                     default=env("MIGRATION_HOLD_MAX_MS", 1e3 * defaults.hold_max_s),
                     help="as a destination, hold the next engine step up to this long for a commit the source "
                          "said is imminent, so the request joins that step (its other requests wait as long); "
                          "0: never hold")
    mig.add_argument("--migration-hold-step-share", type=float,
                     default=env("MIGRATION_HOLD_STEP_SHARE", defaults.hold_step_share),
                     help="and hold at most this share of this engine's typical step (0-1]: a commit due "
                          "later goes to the step after")
    mig.add_argument("--migration-notice-steps", type=int,
                     default=env("MIGRATION_NOTICE_STEPS", defaults.notice_steps),
                     help="as a source, tell a holding destination the commit is coming this many of our steps "
                          "ahead, so it paces its steps to meet it; 1: a step ahead (it holds or not)")
    sim = parser.add_argument_group("simulated engine")
    engine, scheduler = SimEngineConfig(), SchedulerConfig()
    sim.add_argument("--sim-num-blocks", type=int, default=env("SIM_NUM_BLOCKS", scheduler.num_blocks))
    sim.add_argument("--sim-block-size", type=int, default=env("SIM_BLOCK_SIZE", scheduler.block_size))
    sim.add_argument("--sim-gpu", choices=sorted(SIMPLE_MODELS), default=env("SIM_GPU", engine.gpu))
    sim.add_argument("--sim-time-scale", type=float, default=env("SIM_TIME_SCALE", engine.time_scale),
                     help="multiply simulated step times (0.01 = 100x faster than the modelled GPU)")
    sim.add_argument("--sim-queue-policy", choices=QUEUE_POLICIES,
                     default=env("SIM_QUEUE_POLICY", scheduler.queue_policy))
    sim.add_argument("--sim-step-mode", choices=STEP_MODES, default=env("SIM_STEP_MODE", scheduler.step_mode))
    sim.add_argument("--sim-kv-bytes-per-token", type=int,
                     default=env("SIM_KV_BYTES_PER_TOKEN", engine.kv_bytes_per_token))
    sim.add_argument("--sim-reserve-full-sequence", action=argparse.BooleanOptionalAction,
                     default=env("SIM_RESERVE_FULL_SEQUENCE", scheduler.reserve_full_sequence),
                     help="admit a waiting request only when its whole prompt fits (vLLM 0.32's default)")
    sim.add_argument("--sim-prefix-caching", action=argparse.BooleanOptionalAction,
                     default=env("SIM_PREFIX_CACHING", scheduler.enable_prefix_caching),
                     help="vLLM's automatic prefix caching: reuse the cached full blocks of a prompt's prefix")
    sim.add_argument("--sim-preempt-for-priority", action=argparse.BooleanOptionalAction,
                     default=env("SIM_PREEMPT_FOR_PRIORITY", scheduler.preempt_for_priority),
                     help="with --sim-queue-policy priority, a waiting request preempts less important "
                          "running ones (vLLM V0; vLLM v1 does not)")
    vl = parser.add_argument_group("vLLM engine")
    vl.add_argument("--vllm-kv-cache-gib", type=float, default=env("VLLM_KV_CACHE_GIB", 1.0))
    vl.add_argument("--vllm-max-num-seqs", type=int, default=env("VLLM_MAX_NUM_SEQS", 64))
    vl.add_argument("--vllm-cpu-threads", type=int, default=env("VLLM_CPU_THREADS", 1),
                    help="torch threads on a CPU host; give the llumlet that many cores of its own "
                         "(taskset; corral up does it), or the threads contend with the rest (default 1)")
    vl.add_argument("--vllm-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=env("VLLM_PREFIX_CACHING", True),
                    help="vLLM's automatic prefix caching: its cached blocks are reported to the schedulers "
                         "and an incoming migration is not sent the blocks of its prefix cached here")


def config_from_args(args: argparse.Namespace) -> LlumletConfig:
    instance_id = subjects.valid_token(args.instance_id or short_id("llumlet"))
    return LlumletConfig(
        instance_id=instance_id,
        nats_url=args.nats_url,
        engine=args.engine or default_engine(),
        model_dir=args.model_dir,
        max_model_len=args.max_model_len,
        report_interval_s=args.report_interval_s,
        report_heartbeat_s=_heartbeat(args.report_heartbeat_s),
        stop_grace_s=args.stop_grace_s,
        metrics_port=args.metrics_port,
        seed=args.seed,
        role=_role(args.role),
        handoff_concurrency=_positive("--handoff-concurrency", args.handoff_concurrency),
        enable_migration=args.enable_migration,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_advertise_host=args.kv_advertise_host,
        migration=migration_limits_from_args(args),
        sim=sim_engine_from_args(args),
        vllm=VllmSettings(kv_cache_space_gib=args.vllm_kv_cache_gib, max_num_seqs=args.vllm_max_num_seqs,
                          cpu_threads=args.vllm_cpu_threads, prefix_caching=args.vllm_prefix_caching),
    )


def _role(value: str) -> InstanceRole:
    try:  # (argparse checks a flag's choices, not a default from CORRAL_ROLE)
        return InstanceRole(value)
    except ValueError:
        raise SystemExit(f"bad role {value!r}: one of {', '.join(r.value for r in InstanceRole)}") from None


def _heartbeat(heartbeat_s: float) -> float:
    """At or under --report-interval-s it sends every report, as 0 does."""
    if not 0 <= heartbeat_s <= MAX_HEARTBEAT_S:
        raise SystemExit(f"--report-heartbeat-s must be between 0 and {MAX_HEARTBEAT_S} s (the gateways take an "
                         f"instance silent for 0.8 s for dead), got {heartbeat_s}")
    return heartbeat_s


def _positive(flag: str, value: int) -> int:
    if value < 1:
        raise SystemExit(f"{flag} must be at least 1, got {value}")
    return value


def sim_engine_from_args(args: argparse.Namespace) -> SimEngineConfig:
    try:
        scheduler = SchedulerConfig(
            num_blocks=args.sim_num_blocks,
            block_size=args.sim_block_size,
            queue_policy=args.sim_queue_policy,
            step_mode=args.sim_step_mode,
            reserve_full_sequence=args.sim_reserve_full_sequence,
            preempt_for_priority=args.sim_preempt_for_priority,
            enable_prefix_caching=args.sim_prefix_caching,
        )
        return SimEngineConfig(scheduler=scheduler, gpu=args.sim_gpu, time_scale=args.sim_time_scale,
                               kv_bytes_per_token=args.sim_kv_bytes_per_token)
    except ValueError as exc:
        raise SystemExit(f"bad sim engine settings: {exc}") from exc


def migration_limits_from_args(args: argparse.Namespace) -> MigrationLimits:
    try:
        return MigrationLimits(
            max_out=args.migration_max_out,
            max_in=args.migration_max_in,
            stage_limit=args.migration_stage_limit,
            last_stage_blocks=args.migration_last_stage_blocks,
            lease_s=args.migration_lease_s,
            pair_ttl_s=args.migration_pair_ttl_s,
            min_residence_s=args.migration_min_residence_s,
            min_return_s=args.migration_min_return_s,
            dest_max_waiting=args.migration_dest_max_waiting,
            dest_min_free_fraction=args.migration_dest_min_free_fraction,
            bandwidth_bytes_per_s=args.migration_bandwidth_mib_s * (1 << 20),
            hold_max_s=args.migration_hold_max_ms / 1e3,
            hold_step_share=args.migration_hold_step_share,
            notice_steps=args.migration_notice_steps,
            token_frames=args.migration_token_frames,
        )
    except ValueError as exc:
        raise SystemExit(f"bad migration settings: {exc}") from exc
