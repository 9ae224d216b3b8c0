"""The narrow interface between a llumlet and its inference engine (vLLM or simulated).

The llumlet owns the loop: it calls `step()` while the engine has work, publishes each step's
outputs, and builds load reports from `request_views()`. Engines never talk to NATS.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from services.llumlet.migration.ops import MigratableEngine
from shared.engine_model.views import RequestView, StepOutput
from shared.messages import GenerateRequest


@runtime_checkable
class Engine(Protocol):
    kind: str  # "sim" or "vllm"
    model_name: str
    block_size: int
    num_blocks_total: int
    max_model_len: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request; raises EngineError if it can never run here."""

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it was not here."""

    def has_work(self) -> bool: ...

    async def step(self) -> list[StepOutput]:
        """Run one engine iteration (continuous batching) and return what it produced."""

    def num_free_blocks(self) -> int: ...

    def num_committed_blocks(self) -> int:
        """Free blocks admitted prompts still have to claim (counted as used by the load report
        and the migration guard)."""

    def waiting_prefill_tokens(self) -> int | None:
        """Tokens the waiting requests will prefill, their prefix cached here left out (None:
        the engine cannot tell, as without a prefix cache; the load report then says nothing of
        it)."""

    def num_preemptions_total(self) -> int: ...

    def request_views(self) -> list[RequestView]:
        """Live requests: waiting ones first, in the order the local scheduler will take them."""

    def migration_ops(self) -> MigratableEngine | None:
        """This engine's migration verbs (one object for its lifetime), or None when it cannot
        migrate requests. Ask after `start()`: some engines learn their KV layout only then."""
