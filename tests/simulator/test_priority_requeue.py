"""Corral's priority queue re-queues a preempted request as Llumnix-base's FCFS does.

With one priority level the two policies differ only in the local queue. Migration breaks
"running order = arrival order" (a migrated-in request joins the batch last with its old
arrival time), so re-queueing victims by arrival time made Corral diverge: on a heavy-tailed
output trace a short request preempted after its first token waited behind an older victim's
long sequence (benchmarks/decode_tail.py)."""

from __future__ import annotations

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from loadgen.simulator.workload import WorkloadSpec, build_workload
from shared.engine_model.queues import HeapQueue
from shared.policy.baselines import get_policy


def finish_times(config: SimConfig, work, name: str) -> tuple[int, list]:
    result = ClusterSimulator(config, get_policy(name), work).run()
    return result.num_preemptions, sorted((r.request_id, r.finished_time) for r in result.finished)


def test_corral_is_llumnix_base_at_zero_high_priority_with_migrations_and_preemptions(monkeypatch):
    config = SimConfig(num_instances=4).with_scheduler(step_mode="v1")
    work = build_workload(WorkloadSpec("synthetic:S-L", num_requests=600, rate=2.0, seed=0), config.max_seq_len)
    corral, base = finish_times(config, work, "corral"), finish_times(config, work, "llumnix-base")
    assert base[0] > 100  # overloaded: preemptions happen, so the re-queue order matters
    assert corral == base

    # Re-queued by arrival time (vLLM's priority queue) the same requests run differently.
    monkeypatch.setattr(HeapQueue, "add_front", lambda self, request: self.add(request))
    assert finish_times(config, work, "corral") != base
