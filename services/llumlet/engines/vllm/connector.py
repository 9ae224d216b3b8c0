"""Corral's KV connector for vLLM v1 (pinned: vllm 0.32.0): the hooks live migration needs.

vLLM builds two instances of the class in one engine, a scheduler half and a worker half; with
the engine core in process (one engine per OS process) both share `MIGRATION_STATE`, which the
engine thread (`driver.py`) fills and drains. Everything here runs on that one thread.

- Source, last stage: the driver aborts a request whose id is in `held`; `request_finished`
  then keeps its blocks, so they can be copied after the request left the batch. vLLM would free
  them once `get_finished` reports the id as sent, but only in a step, and an idle engine does not
  step: the driver frees them itself (`SchedulerProbe.free_held_blocks`) once the destination
  committed or the request resumed here.
- Destination: received blocks sit in blocks the driver took out of vLLM's pool (a lease). A
  migrated request is added with its generated tokens appended to the prompt and a `LoadPlan`;
  `get_num_new_matched_tokens` reports its computed tokens past the local prefix hit (the lease's
  full blocks, put in the prefix cache at its add: `leases.py`) as an external hit, and
  `start_load_kv` copies those lease blocks (the partial last one) into the blocks vLLM allocated
  before the forward pass reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

CONNECTOR_NAME = "CorralMigrationConnector"
CONNECTOR_MODULE = __name__


@dataclass
class LoadPlan:
    """Destination: where a migrated request's KV waits, and how many tokens it covers."""

    lease_block_ids: list[int]
    num_tokens: int
    num_local_tokens: int = 0  # the local prefix hit vLLM reported (block multiple)


@dataclass
class MigrationState:
    """Shared by both connector halves and the driver (all on the engine thread)."""

    kv_caches: dict[str, Any] = field(default_factory=dict)  # layer → [blocks, heads, bs, 2·dim]
    held: set[str] = field(default_factory=set)  # internal ids whose blocks survive their abort
    loads: dict[str, LoadPlan] = field(default_factory=dict)  # internal id → plan (not yet loaded)
    loaded: list[str] = field(default_factory=list)  # plans done: the driver frees their leases
    pending_copies: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


MIGRATION_STATE = MigrationState()


def kv_transfer_config() -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE,
                            kv_role="kv_both")


@dataclass
class _CopyMetadata(KVConnectorMetadata):
    copies: list[tuple[int, int]]  # (lease block, request block) pairs
    loaded: list[str]


class CorralMigrationConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size: int = vllm_config.cache_config.block_size
        self.state = MIGRATION_STATE

    # -- scheduler half --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self.state.loads.get(request.request_id)
        if plan is None:
            return 0, False
        plan.num_local_tokens = num_computed_tokens
        # At least one token must remain to compute: it produces the next token's logits.
        upto = min(plan.num_tokens, request.num_tokens - 1)
        return max(0, upto - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        plan = self.state.loads.pop(request.request_id, None)
        if plan is None:
            return
        copies: list[tuple[int, int]] = []
        if num_external_tokens > 0:
            block_ids = blocks.get_block_ids()[0]
            first = plan.num_local_tokens // self.block_size
            last = -(-(plan.num_local_tokens + num_external_tokens) // self.block_size)
            assert last <= len(plan.lease_block_ids) and last <= len(block_ids), (last, plan, len(block_ids))
            copies = [(plan.lease_block_ids[i], block_ids[i]) for i in range(first, last)]
        self.state.pending_copies[request.request_id] = copies

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        pending = self.state.pending_copies
        meta = _CopyMetadata([pair for pairs in pending.values() for pair in pairs], list(pending))
        pending.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return request.request_id in self.state.held, None

    # -- worker half -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.state.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _CopyMetadata)
        if meta.copies:
            import torch

            src = torch.tensor([s for s, _ in meta.copies], dtype=torch.long)
            dst = torch.tensor([d for _, d in meta.copies], dtype=torch.long)
            for tensor in self.state.kv_caches.values():
                tensor.index_copy_(0, dst, tensor.index_select(0, src))
        self.state.loaded.extend(meta.loaded)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
