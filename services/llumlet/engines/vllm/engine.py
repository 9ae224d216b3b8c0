"""The real engine: vLLM v1 driven in process, one step at a time, on one dedicated thread.

vLLM's `LLMEngine` is not thread-safe: `step()`, `add_request()`, `abort_request()` and every read
of its scheduler must happen on one thread. The llumlet lives on an asyncio event loop, so the
adapter has two halves:

- `VllmEngine` (this module) is what the llumlet calls on the event loop. `add_request` and
  `abort_request` validate and queue a command; `request_views()` and the block counts read the
  last snapshot. None of them touches vLLM.
- `VllmDriver` (`driver.py`) runs on the engine thread, a single-thread executor: it applies
  queued commands (before each step, and right away when no step is running), steps vLLM, and
  leaves outputs and a fresh snapshot behind.
- `VllmMigration` (`migration.py`), its migration verbs, uses both through `VllmEngineParts`.

In-process mode (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) keeps vLLM's engine core in this process:
no child process is spawned, and the scheduler's state is directly readable. vLLM keeps some
process-wide state (torch.distributed, KV connectors): run one engine per process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from shared.engine_model.views import EngineError, RequestPhase, RequestView, StepOutput
from services.llumlet.engines.vllm.config import VllmEngineConfig
from services.llumlet.engines.vllm.driver import VllmDriver, blocks_for
from services.llumlet.engines.vllm.params import check_request, to_vllm_sampling_params
from services.llumlet.engines.vllm.migration import VllmMigration
from services.llumlet.kv_journal import KvEventJournal
from services.llumlet.engines.vllm.state import AbortCommand, AddCommand, SharedState, Tracked, TrackedStatus
from shared.messages import GenerateRequest, Refusal

log = logging.getLogger(__name__)

T = TypeVar("T")


class VllmEngine:
    kind = "vllm"

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self.model_name = config.model_name or Path(config.model_dir).name
        self.max_model_len = config.max_model_len
        self.block_size = 0  # both known once started
        self.num_blocks_total = 0
        self._shared = SharedState()
        self._executor: ThreadPoolExecutor | None = None
        self._driver: VllmDriver | None = None  # used on the engine thread only
        self._migration = VllmMigration(self)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Build the engine (seconds to tens of seconds) on the engine thread, so the event loop
        keeps serving meanwhile."""
        if self._executor is not None:
            return
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        try:
            driver = await asyncio.wrap_future(
                executor.submit(VllmDriver.build, self.config, self.model_name, self._shared)
            )
        except BaseException:
            executor.shutdown(wait=False)
            raise
        self._started(executor, driver)

    def _started(self, executor: ThreadPoolExecutor, driver: VllmDriver) -> None:
        self._executor, self._driver = executor, driver
        self.block_size = driver.block_size
        self.num_blocks_total = driver.probe.num_blocks_total
        log.info(
            "vLLM engine ready: model=%s blocks=%d block_size=%d max_model_len=%d",
            self.model_name, self.num_blocks_total, self.block_size, self.max_model_len,
        )

    async def stop(self) -> None:
        executor, driver = self._executor, self._driver
        self._executor = self._driver = None
        if executor is None or driver is None:
            return
        try:
            await asyncio.wrap_future(executor.submit(driver.shutdown))
        finally:
            executor.shutdown(wait=True)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: GenerateRequest) -> None:
        driver = self.running_driver()
        check_request(request, max_model_len=self.max_model_len, vocab_size=driver.vocab_size)
        params = to_vllm_sampling_params(request)
        tracked = Tracked(request.request_id, request.priority, len(request.prompt_token_ids), request=request)
        shared = self._shared
        with shared.lock:
            if request.request_id in shared.requests:
                raise EngineError(f"request {request.request_id} is already on this engine", Refusal.DUPLICATE)
            shared.requests[request.request_id] = tracked
            shared.commands.append(AddCommand(tracked, list(request.prompt_token_ids), params))
        self._apply_soon()

    def abort_request(self, request_id: str) -> bool:
        shared = self._shared
        with shared.lock:
            tracked = shared.requests.pop(request_id, None)
            if tracked is None:
                return False
            queued = next((c for c in shared.commands if isinstance(c, AddCommand) and c.tracked is tracked), None)
            # It never reached vLLM: forgetting it is enough (but a migrated request's lease
            # must go back to vLLM's pool, on the engine thread: add it, then abort it).
            if queued is not None and queued.load is None:
                shared.commands.remove(queued)
                tracked.move(TrackedStatus.GONE)
                return True
            shared.commands.append(AbortCommand(tracked))
        self._apply_soon()
        return True

    def has_work(self) -> bool:
        shared = self._shared
        with shared.lock:
            # A request suspended for migration does not step.
            active = any(t.status is not TrackedStatus.SUSPENDED for t in shared.requests.values())
            return active or bool(shared.commands or shared.outbox)

    # ------------------------------------------------------------------ engine-thread calls

    def on_engine_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Submit `fn(driver, *args)` to the engine thread (after the step in progress: a few ms
        with the tiny model); await the future on the event loop, which keeps serving meanwhile."""
        driver = self.running_driver()
        return asyncio.wrap_future(self._executor.submit(fn, driver, *args))

    def migration_ops(self) -> VllmMigration:
        return self._migration

    def kv_event_journal(self) -> KvEventJournal | None:
        """vLLM's KV events, as the engine thread receives them (after `start()`)."""
        return None if self._driver is None else self._driver.kv_journal

    @property
    def shared(self) -> SharedState:
        return self._shared

    def queue_add(self, tracked: Tracked, command: AddCommand) -> None:
        """Queue an add built elsewhere (a migrated request); EngineError on a duplicate id.
        Applied at the start of the next step (the llumlet wakes its loop at the commit), not on
        its own ahead of it: there it would hold the GIL against the event loop that starts that
        step (a step held for the commit would wait for it, ~1-3 ms with the tiny model)."""
        shared = self._shared
        with shared.lock:
            if tracked.request_id in shared.requests:
                raise EngineError(f"request {tracked.request_id} is already on this engine", Refusal.DUPLICATE)
            shared.requests[tracked.request_id] = tracked
            shared.commands.append(command)

    async def step(self) -> list[StepOutput]:
        driver = self.running_driver()
        # Outputs land in the outbox on the engine thread: if this await is cancelled, the next
        # step() still returns them, so no token is lost.
        await asyncio.wrap_future(self._executor.submit(driver.step))
        return self._shared.take_outbox()

    # ------------------------------------------------------------------ load

    def num_free_blocks(self) -> int:
        return self._shared.snapshot.num_free_blocks

    def num_committed_blocks(self) -> int:
        return 0  # vLLM v1 admits a prompt on its next chunk's blocks only: it commits no more than it holds

    def waiting_prefill_tokens(self) -> int | None:
        """The last snapshot's (vLLM's waiting requests less their cached prefixes), plus the
        prompts queued since, whole (vLLM has not hashed them yet); None with caching off."""
        shared = self._shared
        with shared.lock:
            told = shared.snapshot.waiting_prefill_tokens
            queued = sum(c.tracked.num_prompt_tokens for c in shared.commands
                         if isinstance(c, AddCommand) and c.load is None)
        return None if told is None else told + queued

    def num_preemptions_total(self) -> int:
        return self._shared.num_preemptions_total

    def request_views(self) -> list[RequestView]:
        """The last snapshot, less requests aborted since, plus requests queued since (at the
        back of the queue, where vLLM will put them)."""
        shared = self._shared
        with shared.lock:
            snapshot = shared.snapshot
            queued = [c for c in shared.commands if isinstance(c, AddCommand)]
            queued_ids = {c.tracked.request_id for c in queued}
            seen = [v for v in (*snapshot.waiting, *snapshot.running) if v.request_id in shared.requests]
        seen = [v for v in seen if v.request_id not in queued_ids]  # an id reused after an abort
        views = seen + [self._queued_view(c) for c in queued]
        waiting = [v for v in views if v.phase is RequestPhase.WAITING]
        return waiting + [v for v in views if v.phase is RequestPhase.RUNNING]

    def _queued_view(self, command: AddCommand) -> RequestView:
        tracked = command.tracked
        if command.load is not None:  # migrated in: its KV is in its lease, it decodes at the next step
            return RequestView(request_id=tracked.request_id, priority=tracked.priority, phase=RequestPhase.RUNNING,
                               physical_blocks=command.load.num_blocks, demand_blocks=0,
                               num_tokens=len(command.prompt_token_ids),
                               num_output_tokens=len(tracked.prior_output_token_ids))
        return RequestView(
            request_id=tracked.request_id,
            priority=tracked.priority,
            phase=RequestPhase.WAITING,
            physical_blocks=0,
            demand_blocks=blocks_for(tracked.num_prompt_tokens + 1, self.block_size),
            num_tokens=tracked.num_prompt_tokens,
        )

    # ------------------------------------------------------------------ engine thread

    def running_driver(self) -> VllmDriver:
        if self._driver is None:
            raise EngineError("the vLLM engine is not running", Refusal.ENGINE_FAILED)
        return self._driver

    def _apply_soon(self) -> None:
        """Apply queued commands on the engine thread even if nobody steps (an abort on an idle
        engine must still free its blocks); runs after any step already in progress."""
        executor, driver = self._executor, self._driver
        if executor is not None and driver is not None:
            executor.submit(driver.apply_commands_and_snapshot).add_done_callback(_log_failure)


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("applying engine commands failed", exc_info=future.exception())
