"""The global scheduler's admission control at dispatch: 429-shaped refusals with a retry hint,
counted by reason; dispatch only among the instances that can meet the SLO."""

from __future__ import annotations

import argparse
import time

import msgspec
import pytest

from services.global_scheduler import config as scheduler_config
from services.global_scheduler.admission import AdmissionSettings
from services.global_scheduler.config import SchedulerConfig
from services.global_scheduler.service import GlobalScheduler
from shared.messages import DispatchRequest, Refusal
from shared.policy.admission import NUM_OUTPUT_BINS, AdmissionPolicy, Slo, SloConfig, output_length_bin
from shared.policy.config import HIGH_PRIORITY
from tests.unit.policy_helpers import make_load

SLO = SloConfig(Slo(ttft_s=1.0, tbt_s=0.2), reserve=0.1)


def scheduler(*loads, policy=AdmissionPolicy.PREDICTED) -> GlobalScheduler:
    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222", admission=AdmissionSettings(policy, SLO)))
    for load in loads:
        load.sent_at = time.time()
        s.table.update(load)
    return s


def rejections(s: GlobalScheduler, reason: str) -> float:
    return s.metrics.registry.get_sample_value("corral:scheduler_admission_rejections_total", {"reason": reason})


def test_a_queue_past_the_ttft_target_is_refused_with_a_retry_hint():
    # A10: 0.255 ms a prefill token: 8 queued blocks of 512 tokens = 4096 tokens ~ 1.05 s ahead.
    busy = make_load("a", total=2000, block_size=512, waiting=[8])
    s = scheduler(busy)
    reply = s.decide(DispatchRequest("r0", 100, 16))
    assert reply.instance_id is None and reply.reason is Refusal.OVERLOADED
    assert 0.1 <= reply.retry_after_s <= 1.0
    assert rejections(s, "ttft") == 1
    assert s.metrics.registry.get_sample_value("corral:scheduler_dispatches_total", {"outcome": "overloaded"}) == 1


def test_dispatch_goes_only_to_an_instance_that_can_meet_the_slo():
    # "a" is the freer by blocks (dispatch would pick it) but its queue is past the TTFT target.
    s = scheduler(make_load("a", total=4000, block_size=512, waiting=[8]),
                  make_load("b", total=300, running={0: (2, 40)}))
    reply = s.decide(DispatchRequest("r0", 100, 16))
    assert reply.instance_id == "b"


def test_a_prompt_cached_on_an_instance_is_predicted_there_by_its_uncached_rest():
    # Behind "b"'s queue (1,024 tokens, ~0.3 s on A10) a 3,200-token prompt (~0.8 s) misses the
    # 0.9 s budget; with its first 3,072 tokens in "b"'s prefix cache (the scheduler's prefix
    # index, from the llumlets' KV events) it is admitted there, and its predicted TTFT is short.
    from shared.messages import KvCacheSnapshot

    chain = list(range(1, 193))  # 192 blocks of 16 tokens
    s = scheduler(make_load("b", total=4000, waiting=[64]))
    req = DispatchRequest("r0", 3200, 16, block_hashes=chain + [999] * 8, prefix_block_size=16)
    assert s.decide(req).reason is Refusal.OVERLOADED
    s.prefixes.index.restore(KvCacheSnapshot("b", 0, 16, chain))
    reply = s.decide(msgspec.structs.replace(req, request_id="r1"))
    assert reply.instance_id == "b" and reply.predicted_ttft_s < 0.5


def test_no_room_is_refused_for_normal_priority_before_high():
    s = scheduler(make_load("a", total=100, running={0: (3, 85)}))  # 15 free; the prompt needs 15; normal keeps 10 free
    assert s.decide(DispatchRequest("n", 14 * 16, 16)).reason is Refusal.OVERLOADED
    assert s.decide(DispatchRequest("h", 14 * 16, 16, priority=HIGH_PRIORITY)).instance_id == "a"


def test_without_admission_the_same_load_is_dispatched():
    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222"))
    load = make_load("a", total=2000, block_size=512, waiting=[8])
    load.sent_at = time.time()
    s.table.update(load)
    assert s.decide(DispatchRequest("r0", 100, 16)).instance_id == "a"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scheduler_config.add_arguments(parser)
    return parser.parse_args(["--nats-url", "nats://x:4222", *argv])


def test_flags_build_the_settings_and_bad_ones_exit():
    config = scheduler_config.config_from_args(parse("--admission", "current-load", "--slo-ttft-s", "2",
                                                     "--slo-tbt-s", "0.1"))
    assert config.admission.policy is AdmissionPolicy.CURRENT_LOAD and config.admission.slo.default == Slo(2, 0.1)
    assert (config.admission.slo.reserve, config.admission.slo.handoff_reserve) == (0.1, 0.3)  # the policy's
    config = scheduler_config.config_from_args(parse("--admission", "predicted", "--slo-ttft-s", "2", "--slo-tbt-s",
                                                     "0.1", "--slo-reserve", "0.05", "--slo-handoff-reserve", "0.2"))
    assert (config.admission.slo.reserve, config.admission.slo.handoff_reserve) == (0.05, 0.2)
    assert scheduler_config.config_from_args(parse()).admission is None
    for argv in (("--admission", "predicted"), ("--admission", "predicted", "--slo-ttft-s", "-1", "--slo-tbt-s", "1"),
                 ("--admission", "predicted", "--slo-ttft-s", "2", "--slo-tbt-s", "1", "--slo-handoff-reserve", "1")):
        with pytest.raises(SystemExit):
            scheduler_config.config_from_args(parse(*argv))


def test_a_priority_gets_its_own_slo_from_the_flags():
    config = scheduler_config.config_from_args(parse("--admission", "predicted", "--slo-ttft-s", "2",
                                                     "--slo-tbt-s", "0.1", "--slo-priority", "high:0.5:0.05",
                                                     "--slo-priority", "3:10:0.5", "--slo-priority=-2:0.4:0.04"))
    slo = config.admission.slo
    assert slo.slo_for(-2) == Slo(0.4, 0.04)
    assert slo.slo_for(HIGH_PRIORITY) == Slo(0.5, 0.05) and slo.slo_for(3) == Slo(10, 0.5)
    assert slo.slo_for(0) == Slo(2, 0.1)
    for bad in ("high:0.5", "x:1:1", "high:0:0.05", "1:1:1:9"):
        with pytest.raises(SystemExit, match="bad priority SLO"):
            scheduler_config.config_from_args(parse("--admission", "predicted", "--slo-ttft-s", "2",
                                                    "--slo-tbt-s", "0.1", "--slo-priority", bad))


def test_a_tighter_high_priority_slo_refuses_what_normal_priority_admits():
    # ~1.05 s of queued prefill ahead (as above): inside normal's 2 s, outside high priority's own 0.5 s.
    busy = make_load("a", total=4000, block_size=512, waiting=[8])
    slo = SloConfig(Slo(2.0, 0.2), {HIGH_PRIORITY: Slo(0.5, 0.2)}, reserve=0.1)
    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222",
                                        admission=AdmissionSettings(AdmissionPolicy.PREDICTED, slo)))
    busy.sent_at = time.time()
    s.table.update(busy)
    assert s.decide(DispatchRequest("n", 100, 16)).instance_id == "a"
    assert s.decide(DispatchRequest("h", 100, 16, priority=HIGH_PRIORITY)).reason is Refusal.OVERLOADED


def test_predicted_reads_output_progress_from_the_reports():
    """A batch about to finish (each running request 10 tokens into an output this instance
    serves at 12, by the report's histogram of finished lengths) leaves a small decode batch
    when the new prefill ends: `predicted` admits where `current-load` refuses on TBT. Without
    the progress fields (a request counts as just started, the estimate at its prior)
    `predicted` refuses the same load too."""
    slo = SloConfig(Slo(ttft_s=1.0, tbt_s=0.1), reserve=0.1)

    def load(progress: bool):
        report = make_load("a", total=6000, running={0: (100, 3750)}, waiting=[100])
        if progress:
            report.running_output_tokens = [10] * 100
            report.num_finished_total, report.finished_output_tokens_total = 1000, 12000
            report.finished_output_histogram = [0] * NUM_OUTPUT_BINS
            report.finished_output_histogram[output_length_bin(12)] = 1000
        report.sent_at = time.time()
        return report

    def decide(policy, progress):
        s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222", admission=AdmissionSettings(policy, slo)))
        s.table.update(load(progress))
        return s.decide(DispatchRequest("r0", 100, 16))

    assert decide(AdmissionPolicy.PREDICTED, progress=True).instance_id == "a"
    assert decide(AdmissionPolicy.CURRENT_LOAD, progress=True).reason is Refusal.OVERLOADED
    assert decide(AdmissionPolicy.PREDICTED, progress=False).reason is Refusal.OVERLOADED


def test_running_outputs_in_a_report_are_the_views_and_bounded():
    from shared.engine_model.load_report import aggregate_views
    from shared.engine_model.views import RequestPhase, RequestView
    from shared.messages import MAX_RUNNING_OUTPUTS

    views = [RequestView("w", 0, RequestPhase.WAITING, 0, 3, 40)]
    views += [RequestView(f"r{i}", 0, RequestPhase.RUNNING, 2, 0, 40 + i, num_output_tokens=i) for i in range(3)]
    assert aggregate_views(views).running_output_tokens == [0, 1, 2]
    many = [RequestView(f"r{i}", 0, RequestPhase.RUNNING, 1, 0, 9, num_output_tokens=1)
            for i in range(MAX_RUNNING_OUTPUTS + 5)]
    aggregates = aggregate_views(many)
    assert aggregates.num_running == MAX_RUNNING_OUTPUTS + 5
    assert len(aggregates.running_output_tokens) == MAX_RUNNING_OUTPUTS
