"""Committed prefill: the blocks that prompts admitted on their whole sequence still have to claim.

Admission checks that each prompt's whole sequence fits (`reserve_full_sequence`, vLLM v1's
default); chunked prefill then allocates it chunk by chunk. Until the last chunk the rest looks
free, and neither another admission nor a migration lease may take it (the next chunk would
preempt). `PrefillClaims` keeps those admitted-but-unallocated tokens and counts the blocks owed.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.engine_model.block_manager import blocks_for_tokens
from shared.engine_model.request import RequestStatus, SimRequest


class PrefillClaims:
    """Running requests admitted on their whole sequence but allocated chunk by chunk; entries
    that finished prefilling or left are dropped when counted."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._claims: dict[str, tuple[SimRequest, int]] = {}  # id -> (request, tokens admitted on)

    def claim(self, request: SimRequest, num_tokens: int) -> None:
        """`request` was admitted on `num_tokens` but allocated fewer (a first chunk)."""
        self._claims[request.request_id] = (request, num_tokens)

    def owed(self, num_blocks_of: Callable[[str], int]) -> int:
        """Free blocks already spoken for: the claimed blocks beyond what each table holds."""
        claims = self._claims
        if not claims:
            return 0
        owed = 0
        block_size, running = self.block_size, RequestStatus.RUNNING
        for request_id, (request, tokens) in list(claims.items()):
            missing = blocks_for_tokens(tokens, block_size) - num_blocks_of(request_id)
            if request.status is not running or missing <= 0 or request.num_computed_tokens >= tokens:
                del claims[request_id]  # (a preempted one is claimed again when readmitted)
            else:
                owed += missing
        return owed
