"""Instance roles at the global scheduler (issue 19 §2): new requests go to the dispatch pool
only (prefill and mixed instances while a prefill instance is live), and a prefill llumlet asks
here, at a request's first token, which decode instance takes it (`HandoffQuery`).

The decisions are `shared.policy.disaggregation`'s pure functions, as the simulator runs them.
A fleet whose instances never reported a role other than mixed pays nothing: dispatch keeps its
ranking index and never lists the instances.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from shared.instance_table import InstanceTable
from shared.messages import DispatchRequest, HandoffAnswer, HandoffQuery, InstanceRole, LoadReport
from shared.policy.disaggregation import account_handoff, dispatch_pool, handoff_destination
from shared.policy.migration import MigrationGuard
from shared.unreported_dispatches import UnreportedDispatches

NO_ROOM = "no decode instance has room"
UNKNOWN_SOURCE = "the prefill instance is not in the load table"


class InstanceRoles:
    def __init__(self, table: InstanceTable, guard: MigrationGuard, headroom_blocks: Mapping[int, int],
                 unreported: UnreportedDispatches) -> None:
        self.table = table
        self.unreported = unreported  # (a hand-off is accounted until the destination's reports show it)
        self.guard = guard
        self.headroom_blocks = headroom_blocks
        self.disaggregated = False  # an instance reported a role other than mixed (ever)

    def saw(self, report: LoadReport) -> None:
        if report.role is not InstanceRole.MIXED:
            self.disaggregated = True

    def restrict(self, request: DispatchRequest, live: Sequence[LoadReport]) -> DispatchRequest:
        """The request with every instance outside the dispatch pool excluded (decode instances,
        while a prefill instance is live)."""
        pool = {load.instance_id for load in dispatch_pool(live)}
        outside = [load.instance_id for load in live if load.instance_id not in pool]
        if not outside:
            return request
        return msgspec.structs.replace(request, exclude=[*request.exclude, *outside])

    def handoff(self, query: HandoffQuery) -> HandoffAnswer:
        """Where the request decodes: the freest decode instance with room *now* (the table is
        accounted for the answer), or none (it keeps decoding on its prefill instance)."""
        live = self.table.live()
        source = self.table.get(query.instance_id)
        if source is None:
            return HandoffAnswer(reason=UNKNOWN_SOURCE)
        dst = handoff_destination(source, live, query.num_blocks, self.guard, self.headroom_blocks,
                                  query.max_num_tokens)
        if dst is None:
            return HandoffAnswer(reason=NO_ROOM)
        load = self.table.get(dst)
        self.table.replace_load(account_handoff(load, query.num_blocks))
        self.unreported.handed_off(load, query.num_blocks)
        return HandoffAnswer(dst_instance_id=dst)
