"""When the last frame's ack is lost, the source learns over NATS whether its COMMIT landed.

The COMMIT is idempotent, so it is asked again first; if the destination stays silent, an ABORT
decides: either it lands first (never committed, now never will) or the destination answers that
it has committed already. Only when neither answers by the deadline is the outcome unknown (None):
the request then cannot go on anywhere for sure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.llumlet.migration.handshake import DestinationLink
from services.llumlet.migration.protocol import (
    ALREADY_COMMITTED,
    DestinationRefused,
    DestinationSlow,
    MigrationFailed,
    MigrationLimits,
)
from shared.messages import MigrationAbort, MigrationCommit

log = logging.getLogger(__name__)


async def ask_commit(link: DestinationLink, limits: MigrationLimits, dst: str, commit: MigrationCommit,
                     clock: Callable[[], float]) -> bool | None:
    """True: committed there. Raises (→ abort, the request resumes here) when it surely was
    not. None: no answer at all until the deadline."""
    for attempt in range(limits.commit_attempts):
        try:
            ack = await link.commit(dst, commit)
        except DestinationSlow:
            log.warning("commit of %s to %s unanswered (attempt %d)", commit.request.request_id, dst, attempt + 1)
            continue
        if not ack.ok:
            raise DestinationRefused(f"commit refused: {ack.error}")
        return True
    return await resolve_in_doubt(link, limits, dst, commit.migration_id, clock)


async def resolve_in_doubt(link: DestinationLink, limits: MigrationLimits, dst: str, migration_id: str,
                           clock: Callable[[], float]) -> bool | None:
    """ABORT is decisive: either it lands first (never committed, now never will) or the
    destination answers that it has committed already."""
    deadline = clock() + limits.in_doubt_deadline_s
    while clock() < deadline:
        try:
            ack = await link.abort(dst, MigrationAbort(migration_id, "commit unanswered"))
        except DestinationSlow:
            await asyncio.sleep(limits.abort_timeout_s)
            continue
        if ack.ok:
            raise DestinationSlow("commit unanswered; aborted")
        if ack.error == ALREADY_COMMITTED:
            return True
        raise DestinationRefused(f"abort after an unanswered commit: {ack.error}")
    return None


async def tell_abort(link: DestinationLink, dst: str, migration_id: str, reason: str) -> str | None:
    """Send the ABORT; its refusal's error (e.g. ALREADY_COMMITTED), or None."""
    try:
        ack = await link.abort(dst, MigrationAbort(migration_id, reason))
    except MigrationFailed as abort_exc:
        log.info("ABORT of %s not delivered (%s); its lease will expire", migration_id, abort_exc)
        return None
    return None if ack.ok else ack.error
