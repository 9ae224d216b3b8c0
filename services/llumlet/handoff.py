"""Prefill/decode hand-off on a prefill instance (issue 19 §2): when a request's prefill completes
(its first token, already published from here), it moves by the ordinary live migration to the
decode instance the global scheduler picks *then* (`shared.policy.disaggregation`).

The hand-off moves exactly that request (`MigrationCoordinator.migrate`, not the pair loop's
`select_request_to_migrate`), and bypasses the per-request residence limit: the request moves
because of this instance's role, not to balance load. When the scheduler names no destination
(no decode instance has room), does not answer, or the migration fails, the request keeps
decoding here: the instance degrades to mixed for it instead of making it wait. "No room" and a
destination's refusal are often momentary (a decode instance that just took a hand-off has it
queued until its next step, and the guard takes no migration into a queue), so both are asked
about again a moment later, with a fresh choice, `ATTEMPTS` times in all; the request decodes
here meanwhile.

Hand-offs queue in first-token order and run `concurrency` at a time; a queued request decodes
here meanwhile, and the destination is chosen when its turn comes. A request whose hand-off can
start at once is taken out of the batch right after the step that gave its first token
(`suspend`), before the next one: it never joins a step of this instance's with other prompts'
prefill in it (a long step: the stall a client would see between its first two tokens), and moves
in one stage. Should the hand-off not happen after all, it is put back in the batch here.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from services.llumlet.migration.ops import LivePhase, MigrationSnapshot
from services.llumlet.migration.outgoing import OutgoingMigration
from services.llumlet.migration.protocol import MigrationStatus
from shared import subjects
from shared.engine_model.views import StepOutput
from shared.messages import HandoffAnswer, HandoffQuery, WireError, decode, encode
from shared.nats_client import request as nats_request
from shared.policy.disaggregation import HANDOFF_ATTEMPTS, HANDOFF_RETRY_AFTER_S

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 0.5  # the scheduler answers from its load table: a slow answer is a loaded scheduler
# "No room" and refusals are asked about again, a fresh choice each time, this often and this
# much later: the simulator's hand-offs follow the same policy constants.
ATTEMPTS, RETRY_AFTER_S = HANDOFF_ATTEMPTS, HANDOFF_RETRY_AFTER_S


class HandoffOutcome(enum.Enum):
    HANDED_OFF = "handed_off"  # committed on the decode instance
    NO_ROOM = "no_room"  # no decode instance had room, every attempt: it decodes here
    NO_SCHEDULER = "no_scheduler"  # nobody answered: it decodes here
    REFUSED = "refused"  # the destination refused every attempt: it decodes here
    GONE = "gone"  # it finished, was aborted, left or stayed preempted before its turn (or its migration)


Ask = Callable[[HandoffQuery], Awaitable[HandoffAnswer | None]]  # None: no scheduler answered
Migrate = Callable[[str, str, bool], Awaitable[OutgoingMigration | None]]  # (request, destination, suspended)
Snapshot = Callable[[str], MigrationSnapshot | None]
Suspend = Callable[[str], Awaitable[bool]]  # out of the batch (False: it was not in it)
Resume = Callable[[str], Awaitable[None]]  # back in the batch, the engine woken


def first_tokens(outputs: Iterable[StepOutput]) -> list[str]:
    """Requests whose prefill completed in this step and that go on decoding: their first output
    token (index 0 of this instance's output), not their last."""
    return [o.request_id for o in outputs if o.start_index == 0 and o.token_ids and o.finish_reason is None]


class PrefillHandoff:
    def __init__(self, instance_id: str, ask: Ask, migrate: Migrate, snapshot: Snapshot, concurrency: int,
                 on_outcome: Callable[[HandoffOutcome], None] = lambda outcome: None,
                 suspend: Suspend | None = None, resume: Resume | None = None) -> None:
        assert concurrency >= 1, concurrency
        self.instance_id = instance_id
        self._ask = ask
        self._migrate = migrate
        self._snapshot = snapshot
        self.concurrency = concurrency
        self.retry_after_s = RETRY_AFTER_S
        self._suspend, self._resume = suspend, resume
        self._busy = 0  # workers handing off now
        self._queue: asyncio.Queue[tuple[str, int, bool]] = asyncio.Queue()  # (request, attempt, suspended)
        self.outcomes: collections.Counter[HandoffOutcome] = collections.Counter()
        self._on_outcome = on_outcome  # (the llumlet's metrics)

    async def prefilled(self, outputs: Iterable[StepOutput]) -> None:
        """After a step's output is published, before the next step: queue the hand-off of each
        request it prefilled, out of the batch already when a worker is free to start it."""
        for request_id in first_tokens(outputs):
            starts_now = self._busy + self._queue.qsize() < self.concurrency
            suspended = starts_now and self._suspend is not None and await self._suspend(request_id)
            self._queue.put_nowait((request_id, 1, suspended))

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            for i in range(self.concurrency):
                group.create_task(self._worker(), name=f"handoff-{i}")

    async def _worker(self) -> None:
        while True:
            request_id, attempt, suspended = await self._queue.get()
            self._busy += 1
            try:
                outcome = await self.hand_off(request_id, attempt, suspended)
            except Exception:  # a bug must not stop later hand-offs: this request decodes here
                log.exception("hand-off of %s failed", request_id)
                await self._back_in_batch(request_id, suspended)
                continue
            finally:
                self._busy -= 1
            if outcome is not None:
                self.outcomes[outcome] += 1
                self._on_outcome(outcome)

    async def hand_off(self, request_id: str, attempt: int = 1, suspended: bool = False) -> HandoffOutcome | None:
        """One attempt (`suspended`: out of the batch since its first token); None when it was
        queued again for another. Whatever the outcome, the request is back in the batch here
        unless it moved."""
        snapshot = self._snapshot(request_id)
        if snapshot is not None and snapshot.phase is LivePhase.QUEUED and self._retry(request_id, attempt):
            return None  # preempted meanwhile: it may be back in the batch by then
        expected = LivePhase.SUSPENDED if suspended else LivePhase.RUNNING
        if snapshot is None or snapshot.phase is not expected:
            return HandoffOutcome.GONE
        answer = await self._ask(HandoffQuery(self.instance_id, request_id, snapshot.num_blocks,
                                              snapshot.max_num_tokens))
        if answer is None or answer.dst_instance_id is None:
            await self._back_in_batch(request_id, suspended)
            if answer is None:
                return HandoffOutcome.NO_SCHEDULER
            if self._retry(request_id, attempt):
                return None
            log.info("hand-off of %s: it decodes here (%s)", request_id, answer.reason or "no destination")
            return HandoffOutcome.NO_ROOM
        m = await self._migrate(request_id, answer.dst_instance_id, suspended)
        if m is None:  # finished meanwhile, or another migration holds it
            await self._back_in_batch(request_id, suspended)
            return HandoffOutcome.GONE
        if m.status is MigrationStatus.FINISHED:
            return HandoffOutcome.HANDED_OFF
        # (a failed migration puts a suspended request back in the batch itself)
        if m.status is not MigrationStatus.ABORTED_DST:
            return HandoffOutcome.GONE  # the source gave up: it finished, was aborted or preempted
        return None if self._retry(request_id, attempt) else HandoffOutcome.REFUSED

    async def _back_in_batch(self, request_id: str, suspended: bool) -> None:
        snapshot = self._snapshot(request_id) if suspended else None
        if snapshot is not None and snapshot.phase is LivePhase.SUSPENDED and self._resume is not None:
            await self._resume(request_id)

    def _retry(self, request_id: str, attempt: int) -> bool:
        if attempt >= ATTEMPTS:
            return False
        asyncio.get_running_loop().call_later(self.retry_after_s, self._queue.put_nowait,
                                              (request_id, attempt + 1, False))
        return True


def nats_ask(nc: Callable[[], Client | None], timeout_s: float = ASK_TIMEOUT_S) -> Ask:
    """Ask the global scheduler (its queue group) over NATS; None when none answers."""

    async def ask(query: HandoffQuery) -> HandoffAnswer | None:
        client = nc()
        if client is None or not client.is_connected:
            return None
        try:
            reply = await nats_request(client, subjects.HANDOFF, encode(query), timeout_s)
            return decode(reply.data, HandoffAnswer)
        except NoRespondersError:
            log.warning("hand-off of %s: no global scheduler is running", query.request_id)
        except (NatsTimeoutError, TimeoutError):
            log.warning("hand-off of %s: the global scheduler did not answer within %.1f s", query.request_id,
                        timeout_s)
        except WireError as exc:
            log.warning("hand-off of %s: bad answer: %s", query.request_id, exc)
        return None

    return ask
