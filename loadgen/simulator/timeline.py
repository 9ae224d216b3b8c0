"""Periodic samples of the cluster for the timeline plot: instances, queues, memory, migrations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loadgen.simulator.instance import InstanceState, SimInstance


@dataclass
class Timeline:
    times_s: list[float] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    draining: list[int] = field(default_factory=list)
    starting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    used_fraction: list[float] = field(default_factory=list)  # KV blocks in use over serving capacity
    migrations_in_flight: list[int] = field(default_factory=list)
    per_instance_used: list[dict[str, float]] = field(default_factory=list)

    def sample(self, now: float, serving: Sequence[SimInstance], starting: int, migrations: int) -> None:
        """O(instances): only counters the schedulers keep anyway."""
        used = capacity = running = waiting = 0
        per_instance = {}
        for instance in serving:
            scheduler = instance.scheduler
            blocks = scheduler.block_manager
            in_use = blocks.num_blocks - blocks.num_free
            used += in_use
            capacity += blocks.num_blocks
            running += len(scheduler.running) + len(scheduler.suspended)
            waiting += len(scheduler.waiting)
            per_instance[instance.instance_id] = in_use / blocks.num_blocks
        self.times_s.append(now)
        self.live.append(sum(i.state is InstanceState.LIVE for i in serving))
        self.draining.append(sum(i.state is InstanceState.DRAINING for i in serving))
        self.starting.append(starting)
        self.running.append(running)
        self.waiting.append(waiting)
        self.used_fraction.append(used / capacity if capacity else 0.0)
        self.migrations_in_flight.append(migrations)
        self.per_instance_used.append(per_instance)

    def to_json(self) -> dict[str, list]:
        return {
            "time_s": self.times_s,
            "live_instances": self.live,
            "draining_instances": self.draining,
            "starting_instances": self.starting,
            "running": self.running,
            "waiting": self.waiting,
            "kv_used_fraction": [round(x, 4) for x in self.used_fraction],
            "migrations_in_flight": self.migrations_in_flight,
        }
