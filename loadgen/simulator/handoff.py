"""P/D disaggregation in the simulator (issue 19 §2): at a request's first token on a prefill
instance, hand it off to the decode instance that is freest then, by the simulator's ordinary
live migration (`Migrator.start`: the same stages, KV copy cost from its bytes and the
migration bandwidth, the same commit that frees the prompt's blocks on the source).

The destination comes from the shared policy (`handoff_destination`, under the one migration
guard), over the reports as the scheduler holds them; the destination grants or refuses on its
state then (its limit of migrations in, its guard), as a live one. A request waits for a
hand-off while its source's `handoff_concurrency` hand-offs run, as the llumlet's, and it decodes
meanwhile. "No room" and a destination's refusal are asked about again `HANDOFF_ATTEMPTS` times
in all, `HANDOFF_RETRY_AFTER_S` apart, as the llumlet does; after the last it stays for good
(degrades to mixed) rather than wait. A hand-off its source gave up (the request finished or was
preempted there) is not asked about again, as live.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from loadgen.simulator.instance import SimInstance
from loadgen.simulator.migration import Migrator
from loadgen.simulator.migration_state import Migration, MigrationStatus, is_decoding
from shared.engine_model.request import SimRequest
from shared.messages import InstanceRole
from shared.policy.disaggregation import (
    HANDOFF_ATTEMPTS, HANDOFF_RETRY_AFTER_S, HANDOFF_ROLES, account_handoff, handoff_destination, wants_handoff,
)
from shared.policy.migration import MigrationGuard

if TYPE_CHECKING:
    from loadgen.simulator.cluster import ClusterSimulator

# With `--no-migration-guard` a hand-off still needs the blocks, nothing more.
ROOM_ONLY = MigrationGuard(dest_max_waiting=1 << 30, min_freeness_gap=0.0, min_residence_s=0.0,
                           dest_min_free_fraction_after=0.0, min_return_s=0.0)


@dataclass
class HandoffStats:
    """Each request that reached its first token on a prefill instance with more to generate
    (`prefilled`) ends as exactly one of `committed`, `degraded`, `finished_waiting` and
    `rebalanced`; `started`, `aborted` and `retried` count events."""

    prefilled: int = 0
    committed: int = 0  # moved to a decode (or mixed) instance
    degraded: int = 0  # no room (or a failed hand-off) at every attempt: decoded on the prefill instance
    finished_waiting: int = 0  # finished on the prefill instance while waiting for a slot or a retry
    rebalanced: int = 0  # moved by a load-balancing round while waiting
    started: int = 0  # hand-off migrations started
    aborted: int = 0  # ... that failed (the request may be asked about again)
    retried: int = 0  # attempts after the first
    to_mixed: int = 0  # of `committed`, those that went to a mixed instance
    wait_s: list[float] = field(default_factory=list)  # first token -> a hand-off migration started
    downtime_s: list[float] = field(default_factory=list)  # the request's stop at the commit

    def summary(self) -> str:
        doc = self.to_json()
        return (f"{self.committed} of {self.prefilled} handed off ({self.to_mixed} to mixed), {self.degraded} stayed "
                f"for want of room, {self.finished_waiting} finished waiting; {self.aborted} hand-offs aborted, "
                f"{self.retried} asked again; mean wait {doc['mean_wait_ms']} ms, "
                f"mean stop {doc['mean_downtime_ms']} ms")

    def to_json(self) -> dict:
        doc = asdict(self)
        for name in ("wait_s", "downtime_s"):
            values = doc.pop(name)
            doc[f"mean_{name[:-2]}_ms"] = round(sum(values) / len(values) * 1e3, 2) if values else 0.0
        return doc


class Handoffs:
    def __init__(self, sim: ClusterSimulator, migrator: Migrator) -> None:
        self.sim = sim
        self.migrator = migrator
        self.guard = sim.config.guard or ROOM_ONLY
        self.headroom = sim.policy_config.headroom_blocks
        self.stats = HandoffStats()
        self.pending: dict[str, dict[str, float]] = {}  # prefill instance -> request id -> first token at
        self.attempts: dict[str, int] = {}  # request id -> attempts that found no room or were refused
        self.not_before: dict[str, float] = {}  # request id -> when it may be asked about again
        self.first_token_at: dict[str, float] = {}
        self._left_to_rebalancing: set[str] = set()  # hand-offs that ended for a load-balancing move
        self._retrying = False
        self._again = False
        migrator.on_finished = self._on_migration_finished

    def on_first_tokens(self, instance: SimInstance, requests: list[SimRequest]) -> None:
        """After a step: requests that sampled their first token on a prefill instance and have
        more to generate start their hand-off (or wait for a slot)."""
        if not wants_handoff(instance.role):
            return
        for r in requests:
            if r.num_output_tokens == 1 and r.finished_time is None:
                self.stats.prefilled += 1
                self.first_token_at[r.request_id] = self.sim.now
                self.pending.setdefault(instance.instance_id, {})[r.request_id] = self.sim.now
        self._retry()

    def close(self) -> None:
        """The run is over: every request still waiting for a slot finished where it was."""
        for source_id, waiting in self.pending.items():
            for request_id in list(waiting):
                assert self.sim.instances[source_id].scheduler.get(request_id) is None, request_id
                self._settle_gone(request_id, waiting)

    def _on_migration_finished(self, migration: Migration) -> None:
        if migration.handoff:
            if migration.status is MigrationStatus.COMMITTED:
                self.stats.committed += 1
                self.stats.to_mixed += migration.dst.role is InstanceRole.MIXED
                self.stats.downtime_s.append(self.migrator.stats.downtime_s[-1])
            else:
                self.stats.aborted += 1
                if migration.refused_by_destination:
                    self._again_later(migration.src, migration.request_id)
                else:  # the source gave up (it finished or was preempted there): not asked again, as live
                    self._stays(migration.src, migration.request_id)
        elif migration.request_id in self._left_to_rebalancing:  # the hand-off ended for this migration
            self._left_to_rebalancing.discard(migration.request_id)
            if migration.status is MigrationStatus.COMMITTED:
                self.stats.rebalanced += 1
            else:
                self._stays(migration.src, migration.request_id)
        elif migration.status is MigrationStatus.COMMITTED:  # a load-balancing round moved it first
            waiting = self.pending.get(migration.src.instance_id, {})
            if migration.request_id in waiting:
                self._settle_gone(migration.request_id, waiting)
        self._retry()  # a slot is free

    def _retry(self) -> None:
        """Try every waiting hand-off, oldest first per source. Re-entrant calls (a migration
        that aborts at once frees its slot inside `start`) only ask for another pass."""
        if self._retrying:
            self._again = True
            return
        self._retrying = True
        try:
            self._again = True
            while self._again:
                self._again = False
                for source_id, waiting in list(self.pending.items()):
                    for request_id in list(waiting):
                        if not self._try(self.sim.instances[source_id], request_id, waiting):
                            break
        finally:
            self._retrying = False

    def _try(self, src: SimInstance, request_id: str, waiting: dict[str, float]) -> bool:
        """Settle or start one waiting hand-off; False when the slots are busy, so the requests
        behind it on this source need not be tried in this pass."""
        if request_id not in waiting:
            return True  # settled by a nested pass
        request = src.scheduler.get(request_id)
        if request is None:
            self._settle_gone(request_id, waiting)
            return True
        model = self.migrator.model
        if src.migrations_out >= model.handoff_concurrency:
            return False
        if self.sim.now < self.not_before.get(request_id, 0.0):
            return True  # asked about again later
        if self._moving(request_id):  # a load-balancing migration holds it: the hand-off ends, as live
            del waiting[request_id]
            self._left_to_rebalancing.add(request_id)
            return True
        if not is_decoding(request):  # preempted meanwhile: an attempt, asked about again later, as live
            del waiting[request_id]
            self._again_later(src, request_id)
            return True
        # The scheduler chooses from its table (the reports), as live; the destination then
        # grants or refuses on its state (its limit of migrations in, its guard), and a refusal
        # is an attempt, as a live ABORTED_DST.
        loads = [self.sim.report_of(i) for i in self.sim.serving if i.role in HANDOFF_ROLES]
        blocks = src.scheduler.block_manager.num_blocks_of(request_id)
        dst_id = handoff_destination(self.sim.report_of(src), loads, blocks, self.guard, self.headroom,
                                     request.prompt_len + request.max_tokens)
        del waiting[request_id]
        if dst_id is None:
            self._again_later(src, request_id)
            return True
        dst = self.sim.instances[dst_id]
        if dst.report is not None:  # the scheduler accounts its answer, as for a dispatch
            dst.report = account_handoff(dst.report, blocks)
            if self.sim.indexed is not None:
                self.sim.indexed.accounted(dst)
        self.stats.started += 1
        self.stats.wait_s.append(self.sim.now - self.first_token_at[request_id])
        if not self.migrator.destination_grants(dst, blocks):
            self.stats.aborted += 1
            self.migrator.refused_by(src, dst)  # (the source's back-off, where that is its pair)
            self._again_later(src, request_id)
            return True
        self.migrator.start(src, dst, request_id, handoff=True)
        return True

    def _again_later(self, src: SimInstance, request_id: str) -> None:
        """No room, or the hand-off failed: ask again later while attempts remain (if the request
        still decodes there), else it stays on its prefill instance."""
        attempts = self.attempts[request_id] = self.attempts.get(request_id, 0) + 1
        if attempts >= HANDOFF_ATTEMPTS or src.scheduler.get(request_id) is None:
            self._stays(src, request_id)
            return
        self.stats.retried += 1
        self.not_before[request_id] = self.sim.now + HANDOFF_RETRY_AFTER_S
        self.pending.setdefault(src.instance_id, {})[request_id] = self.first_token_at[request_id]
        self.sim.events.push(self.sim.now + HANDOFF_RETRY_AFTER_S, self._on_retry_due)

    def _stays(self, src: SimInstance, request_id: str) -> None:
        """No more hand-off attempts: it decodes on its prefill instance (or finished there)."""
        if src.scheduler.get(request_id) is None:
            self.stats.finished_waiting += 1
        else:
            self.stats.degraded += 1

    def _on_retry_due(self, _: object) -> None:
        if not self.sim.done:
            self._retry()

    def _settle_gone(self, request_id: str, waiting: dict[str, float]) -> None:
        """A waiting request that left its prefill instance: it finished there, or a
        load-balancing round moved it (it is still placed somewhere)."""
        del waiting[request_id]
        if request_id in self.sim.placed_at:
            self.stats.rebalanced += 1
        else:
            self.stats.finished_waiting += 1

    def _moving(self, request_id: str) -> bool:
        return any(m.request_id == request_id for m in self.migrator.active.values())
