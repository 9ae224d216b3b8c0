"""The scheduler's instance table and the llumlet's load-report aggregation."""

from __future__ import annotations

from shared.engine_model.views import RequestPhase, RequestView
from shared.engine_model.load_report import aggregate_views, build_load_report
from shared.instance_table import InstanceTable
from tests.unit.policy_helpers import make_load


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_instances_that_stop_reporting_drop_out():
    clock = FakeClock()
    table = InstanceTable(timeout_s=3.0, clock=clock)
    table.update(make_load("a"))
    clock.now = 2.0
    table.update(make_load("b"))
    clock.now = 4.0
    assert [r.instance_id for r in table.live()] == ["b"]


def test_older_reports_do_not_replace_newer_ones_but_a_restart_does():
    table = InstanceTable(timeout_s=3.0)
    newer = make_load("a", total=100)
    newer.seq = 5
    older = make_load("a", total=50)
    older.seq = 4
    assert table.update(newer) and not table.update(older)
    restarted = make_load("a", total=70)
    assert table.update(restarted)  # seq 1: the llumlet restarted
    assert table.get("a").num_blocks_total == 70


def view(rid, phase, blocks=0, demand=0, priority=0):
    return RequestView(rid, priority, phase, physical_blocks=blocks, demand_blocks=demand, num_tokens=blocks * 16)


def test_load_report_aggregates_per_priority_and_queue():
    views = [
        view("w1", RequestPhase.WAITING, demand=5),
        view("w2", RequestPhase.WAITING, demand=9, priority=-1),
        view("r1", RequestPhase.RUNNING, blocks=10),
        view("r2", RequestPhase.RUNNING, blocks=4, priority=-1),
    ]
    report = build_load_report(
        instance_id="x", seq=1, sent_at=0.0, requests=aggregate_views(views), num_blocks_total=100, num_blocks_free=86,
        block_size=16, num_preemptions_total=3, headroom_blocks={-1: 20},
    )
    assert (report.num_running, report.num_waiting) == (2, 2)
    assert (report.head_demand_blocks, report.waiting_demand_blocks) == (5, 14)
    levels = {level.priority: level for level in report.by_priority}
    assert (levels[-1].num_running, levels[-1].running_blocks, levels[-1].waiting_demand_blocks) == (1, 4, 9)
    assert (levels[0].num_running, levels[0].running_blocks, levels[0].waiting_demand_blocks) == (1, 10, 5)
    assert report.freeness == (100 - (14 + 20 + 5)) / 2
    assert report.dispatch_freeness == (100 - (14 + 20 + 14)) / 2
