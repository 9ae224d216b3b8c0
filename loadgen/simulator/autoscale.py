"""Auto-scaling in the simulator: the shared `scaling_decision` on a tick; a new instance serves
after a startup delay; scale-in drains the victim through the fake request (its report says
`draining`), and it stops only when empty."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loadgen.simulator.config import AutoscaleModel
from loadgen.simulator.instance import InstanceState
from shared.policy.scaling import ScaleAction, ScalingState, scaling_decision

if TYPE_CHECKING:
    from loadgen.simulator.cluster import ClusterSimulator


@dataclass(frozen=True)
class ScalingEvent:
    time_s: float
    action: str  # "out" | "in"
    instance_id: str
    average_freeness: float | None


class Autoscaler:
    def __init__(self, sim: ClusterSimulator, model: AutoscaleModel) -> None:
        self.sim = sim
        self.model = model
        self.state = ScalingState()
        self.events: list[ScalingEvent] = []

    def on_tick(self, _: object) -> None:
        sim = self.sim
        if sim.done:
            return
        sim.events.push(sim.now + self.model.interval_s, self.on_tick)
        loads = [sim.report_of(instance, fresh=True) for instance in sim.serving]
        pending = sum(i.state is InstanceState.STARTING for i in sim.instances.values())
        decision, self.state = scaling_decision(loads, self.state, self.model.scaling, sim.now, pending)
        if decision.action is ScaleAction.OUT:
            instance = sim.launch_instance(ready_after_s=self.model.startup_s)
            self.events.append(ScalingEvent(sim.now, "out", instance.instance_id, decision.average_freeness))
        elif decision.action is ScaleAction.IN and decision.victim is not None:
            sim.drain(sim.instances[decision.victim])
            self.events.append(ScalingEvent(sim.now, "in", decision.victim, decision.average_freeness))
