"""The engine-thread half of the vLLM adapter: the only code that calls into the running vLLM
engine (`startup.py` builds it).

Every method here runs on the one engine thread (vLLM's `LLMEngine` and its scheduler are not
thread-safe). It applies the commands the event loop queued, steps the engine, turns vLLM's
per-step deltas into StepOutputs indexed from the start of each request's output, and leaves a
snapshot of the scheduler for the event loop to read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from shared.engine_model.views import RequestPhase, RequestView, StepOutput
from services.llumlet.engines.vllm.config import VllmEngineConfig
from services.llumlet.engines.vllm.kv_events import install
from services.llumlet.engines.vllm.leases import DestinationLeases
from services.llumlet.engines.vllm.params import finish_reason_of, logprobs_of, to_vllm_sampling_params
from services.llumlet.engines.vllm.probe import SchedulerProbe
from services.llumlet.engines.vllm.startup import build_llm_engine
from services.llumlet.engines.vllm.state import (
    AbortCommand,
    AddCommand,
    MigrationView,
    SharedState,
    Snapshot,
    Suspended,
    Tracked,
    TrackedStatus,
)
from shared.messages import MAX_TAIL_LOGPROBS, FinishReason, TokenLogprob

log = logging.getLogger(__name__)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def continuation(tracked: Tracked, request: Any, output_token_ids: list[int], load: Any = None) -> AddCommand:
    """Add a request that has generated `output_token_ids` already (elsewhere, or before a
    failed migration): vLLM gets them as prompt, and a budget reduced by as many tokens.
    (Exact for greedy sampling; a seeded sampler or a repetition penalty sees a different
    history split.)"""
    sampling, done = request.sampling, len(output_token_ids)
    rest = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - done,
                                   min_tokens=max(0, sampling.min_tokens - done))
    params = to_vllm_sampling_params(msgspec.structs.replace(request, sampling=rest))
    return AddCommand(tracked, list(request.prompt_token_ids) + list(output_token_ids), params, load)


def _tail_logprobs(tracked: Tracked, num_outputs: int) -> list[TokenLogprob] | None:
    """The last step's logprobs, if that step's tokens are the last of the output."""
    if tracked.last_logprobs is None:
        return None
    start, logprobs = tracked.last_logprobs
    return logprobs[-MAX_TAIL_LOGPROBS:] if start + len(logprobs) == num_outputs else None


class VllmDriver:
    def __init__(self, llm_engine: Any, shared: SharedState) -> None:
        self.llm_engine = llm_engine
        self.shared = shared
        self.probe = SchedulerProbe(llm_engine)
        self.block_size = self.probe.block_size
        self.vocab_size: int = llm_engine.model_config.get_vocab_size()
        self._by_internal_id: dict[str, Tracked] = {}  # the requests vLLM holds
        self._by_request_id: dict[str, Tracked] = {}  # the same, by our id
        self._suspended: dict[str, Tracked] = {}  # aborted in vLLM, blocks held, by our id
        from services.llumlet.engines.vllm.connector import MIGRATION_STATE

        self.kv_state = MIGRATION_STATE
        self.leases = DestinationLeases(self.probe.block_pool, self.kv_state, self.block_size)
        installed = install(self.probe)  # what the prefix cache holds (None: caching off)
        self.kv_journal, self.cached_digests = installed if installed is not None else (None, None)

    @classmethod
    def build(cls, config: VllmEngineConfig, served_model_name: str, shared: SharedState) -> VllmDriver:
        driver = cls(build_llm_engine(config, served_model_name), shared)
        driver.take_snapshot()
        return driver

    def shutdown(self) -> None:
        self.llm_engine.engine_core.shutdown()

    # ------------------------------------------------------------------ one iteration

    def step(self) -> None:
        self.apply_commands()
        if self.llm_engine.has_unfinished_requests():
            started = time.monotonic()
            request_outputs = self.llm_engine.step()
            self._count_preemptions()
            self._collect(request_outputs)
            self.leases.release_loaded(started)
        self.take_snapshot()

    def apply_commands_and_snapshot(self) -> None:
        self.apply_commands()
        self.take_snapshot()

    def apply_commands(self) -> None:
        for command in self.shared.take_commands():
            if isinstance(command, AddCommand):
                self._add(command)
            else:
                self._abort(command)

    # ------------------------------------------------------------------ commands

    def _add(self, command: AddCommand) -> None:
        from vllm.inputs import TokensPrompt

        tracked = command.tracked
        try:
            (engine_input,) = self.llm_engine.renderer.render_cmpl(
                [TokensPrompt(prompt_token_ids=command.prompt_token_ids)]
            )
            internal_id = self.llm_engine.add_request(
                tracked.request_id, engine_input, command.sampling_params, priority=tracked.priority
            )
        except Exception as error:  # vLLM refused what our checks let through: fail the request
            log.warning("vLLM refused request %s: %s", tracked.request_id, error)
            if command.load is not None:
                self.leases.release(command.load.lease_id)
            self._fail(tracked)
            return
        tracked.internal_id = internal_id
        tracked.vllm_request = self.probe.request(internal_id)
        self._move(tracked, TrackedStatus.IN_VLLM)
        self._by_internal_id[internal_id] = tracked
        self._by_request_id[tracked.request_id] = tracked
        if command.load is not None and not self.leases.adopt(internal_id, command.load, tracked.vllm_request):
            log.warning("migrated request %s: the blocks its source named as cached here are not its prefix; "
                        "its KV is computed again from its tokens", tracked.request_id)

    def _abort(self, command: AbortCommand) -> None:
        tracked = command.tracked
        if tracked.status is TrackedStatus.SUSPENDED:  # aborted in vLLM already: hand its held blocks back
            self._free_held(tracked)
            return
        if tracked.status is not TrackedStatus.IN_VLLM:
            return  # refused when added, or finished / migrated away since the abort was queued
        self.llm_engine.abort_request([tracked.internal_id], internal=True)
        self.leases.drop_adopted(tracked.internal_id)
        self._forget(tracked)
        self._move(tracked, TrackedStatus.GONE)

    def _fail(self, tracked: Tracked) -> None:
        output = StepOutput(
            request_id=tracked.request_id,
            start_index=tracked.num_delivered,
            token_ids=[],
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=tracked.num_prompt_tokens,
        )
        with self.shared.lock:
            tracked.move(TrackedStatus.GONE)
            if self.shared.is_live(tracked):
                del self.shared.requests[tracked.request_id]
                self.shared.outbox.append(output)

    def _forget(self, tracked: Tracked) -> None:
        """Out of vLLM (finished, aborted or suspended): no longer in our vLLM indexes."""
        del self._by_internal_id[tracked.internal_id]
        del self._by_request_id[tracked.request_id]

    def _move(self, tracked: Tracked, to: TrackedStatus, suspended: Suspended | None = None) -> None:
        with self.shared.lock:  # (the event loop reads status)
            tracked.move(to, suspended)

    # ------------------------------------------------------------------ migration (engine thread)

    def suspend(self, request_id: str) -> bool:
        """Take a running request out of vLLM for a migration's last stage, keeping its blocks:
        it is aborted with the connector holding them. Its KV is final from here on."""
        tracked = self._by_request_id.get(request_id)
        if tracked is None or tracked.vllm_request is None:
            return False
        from vllm.v1.request import RequestStatus

        vreq = tracked.vllm_request
        if vreq.status != RequestStatus.RUNNING or vreq.num_output_tokens == 0:
            return False
        internal_id = tracked.internal_id
        (block_ids,) = self.probe.kv_cache_manager.get_block_ids(internal_id)
        outputs = (*tracked.prior_output_token_ids, *vreq.output_token_ids)
        suspended = Suspended(internal_id, tuple(block_ids), vreq.num_computed_tokens, vreq.num_preemptions, outputs,
                              tail_logprobs=_tail_logprobs(tracked, len(outputs)))
        self.kv_state.held.add(internal_id)
        self.llm_engine.abort_request([internal_id], internal=True)
        assert internal_id in self.probe.scheduler.requests, "the connector did not hold the blocks"
        self._forget(tracked)
        self._move(tracked, TrackedStatus.SUSPENDED, suspended)
        self._suspended[request_id] = tracked
        self.take_snapshot()
        return True

    def resume(self, request_id: str) -> bool:
        """Undo `suspend` after a failed last stage: the request goes on here, re-added with its
        output as prompt (full blocks come back as prefix-cache hits on the held ones)."""
        tracked = self._suspended.get(request_id)
        if tracked is None:
            return False
        suspended = tracked.suspended
        request = tracked.request
        self._move(tracked, TrackedStatus.QUEUED)
        del self._suspended[request_id]
        command = continuation(tracked, request, list(suspended.output_token_ids))
        tracked.prior_output_token_ids = list(suspended.output_token_ids)
        tracked.prior_preemptions += suspended.num_preemptions
        tracked.num_preemptions_seen = 0
        self._add(command)
        # Freed held blocks stay in the prefix cache (evicted last): the re-added request finds
        # its full blocks there, unless memory pressure evicted them (then it recomputes more).
        self._release_held(suspended.internal_id)
        self.take_snapshot()
        return True

    def release_migrated(self, request_id: str) -> bool:
        """The destination committed: hand the held blocks back; no more output from here."""
        tracked = self._suspended.get(request_id)
        if tracked is None:
            return False
        self._free_held(tracked)
        with self.shared.lock:
            if self.shared.is_live(tracked):
                del self.shared.requests[request_id]
        self.take_snapshot()
        return True

    def pin_cached_prefix(self, lease_id: str, wire_hashes: list[int], max_blocks: int) -> list[int]:
        """A new lease's first blocks: the cached ones of the request's leading prefix."""
        if self.cached_digests is None:
            return []
        block_ids = self.leases.pin(lease_id, self.cached_digests.cached_prefix(wire_hashes, max_blocks))
        if block_ids:
            self.take_snapshot()
        return block_ids

    def reserve(self, lease_id: str, num_blocks: int) -> list[int] | None:
        block_ids = self.leases.reserve(lease_id, num_blocks)
        if block_ids is not None:
            self.take_snapshot()
        return block_ids

    def release_lease(self, lease_id: str) -> int:
        released = self.leases.release(lease_id)
        if released:
            self.take_snapshot()
        return released

    def _free_held(self, tracked: Tracked) -> None:
        suspended = tracked.suspended
        self._move(tracked, TrackedStatus.GONE)
        self._suspended.pop(tracked.request_id, None)
        self._release_held(suspended.internal_id)

    def _release_held(self, internal_id: str) -> None:
        self.kv_state.held.discard(internal_id)
        freed = self.probe.free_held_blocks(internal_id)
        assert freed, f"no held blocks for {internal_id}"

    # ------------------------------------------------------------------ outputs

    def _count_preemptions(self) -> None:
        """Add the preemptions vLLM counted in this step. Requests that finished in it are still
        tracked here, and vLLM's Request keeps its counter, so none is missed."""
        new = 0
        for tracked in self._by_internal_id.values():
            count = tracked.num_preemptions
            new += count - tracked.num_preemptions_seen
            tracked.num_preemptions_seen = count
        if new:
            with self.shared.lock:
                self.shared.num_preemptions_total += new

    def _collect(self, request_outputs: list[Any]) -> None:
        produced: list[tuple[Tracked, StepOutput]] = []
        finished: list[Tracked] = []
        for request_output in request_outputs:
            # A RequestOutput carries our id (vLLM's "external" id), not the internal one.
            tracked = self._by_request_id.get(request_output.request_id)
            if tracked is None:
                continue
            if request_output.finished:
                finished.append(tracked)
            output = self._to_step_output(tracked, request_output)
            if output is not None:
                produced.append((tracked, output))
                if output.logprobs:
                    tracked.last_logprobs = (output.start_index, output.logprobs)
                tracked.num_delivered += len(output.token_ids)
        for tracked in finished:
            self._forget(tracked)
        with self.shared.lock:
            for tracked in finished:
                tracked.move(TrackedStatus.GONE)
            # A request aborted while this step ran has its abort queued: drop its outputs.
            self.shared.outbox.extend(output for tracked, output in produced if self.shared.is_live(tracked))
            for tracked in finished:
                if self.shared.is_live(tracked):
                    del self.shared.requests[tracked.request_id]

    @staticmethod
    def _to_step_output(tracked: Tracked, request_output: Any) -> StepOutput | None:
        completion = request_output.outputs[0]
        token_ids = list(completion.token_ids)
        reason = finish_reason_of(completion.finish_reason) if request_output.finished else None
        if not token_ids and reason is None:
            return None
        top = tracked.request.sampling.logprobs if tracked.request is not None else None
        logprobs = None if top is None or completion.logprobs is None else logprobs_of(token_ids, completion.logprobs, top)
        return StepOutput(
            request_id=tracked.request_id,
            start_index=tracked.num_delivered,
            token_ids=token_ids,
            finish_reason=reason,
            num_prompt_tokens=tracked.num_prompt_tokens,
            num_cached_tokens=request_output.num_cached_tokens,
            num_preemptions=tracked.prior_preemptions + tracked.num_preemptions,
            logprobs=logprobs,
        )

    # ------------------------------------------------------------------ snapshots

    def take_snapshot(self) -> None:
        probe = self.probe
        waiting = (self._view(r, RequestPhase.WAITING) for r in probe.waiting())
        running = (self._view(r, RequestPhase.RUNNING) for r in probe.running())
        snapshot = Snapshot(
            waiting=tuple(v for v in waiting if v is not None),
            running=tuple(v for v in running if v is not None),
            num_free_blocks=probe.num_free_blocks(),
            migration=self._migration_views(),
            num_waiting_for_memory=sum(1 for r in probe.waiting() if not self.leases.is_adopted(r.request_id)),
            waiting_prefill_tokens=self._waiting_prefill_tokens(),
        )
        with self.shared.lock:
            self.shared.snapshot = snapshot

    def _waiting_prefill_tokens(self) -> int | None:
        """What vLLM's waiting requests will prefill, each less the leading blocks its prefix
        cache holds now, at least the last token (as the simulated engine reports it); a
        migrated-in request waiting on its lease's blocks prefills nothing. O(waiting requests x
        blocks matched), once a step. None with prefix caching off."""
        digests = self.cached_digests
        if digests is None:
            return None
        total = 0
        for vreq in self.probe.waiting():
            if vreq.request_id not in self._by_internal_id or self.leases.is_adopted(vreq.request_id):
                continue
            num_tokens = vreq.num_tokens
            cached = digests.num_leading_cached(vreq.block_hashes, (num_tokens - 1) // self.block_size)
            total += num_tokens - cached * self.block_size
        return total

    def _migration_views(self) -> dict[str, MigrationView]:
        from vllm.v1.request import RequestStatus

        views: dict[str, MigrationView] = {}
        for request_id, tracked in self._by_request_id.items():
            vreq = tracked.vllm_request
            if vreq is None or vreq.is_finished():
                continue
            running = vreq.status == RequestStatus.RUNNING
            (block_ids,) = self.probe.kv_cache_manager.get_block_ids(vreq.request_id) if running else ((),)
            num_outputs = len(tracked.prior_output_token_ids) + vreq.num_output_tokens
            views[request_id] = MigrationView(not running, vreq.num_computed_tokens if running else 0,
                                              vreq.num_preemptions, tuple(block_ids), num_outputs)
        return views

    def _view(self, vllm_request: Any, phase: RequestPhase) -> RequestView | None:
        tracked = self._by_internal_id.get(vllm_request.request_id)
        if tracked is None:
            return None
        num_tokens = vllm_request.num_tokens
        # A migrated-in request queued in vLLM for its first step here holds its KV in its lease
        # and needs no prefill: reported running on those blocks, as the simulator's `add_migrated`
        # counts it (and as the destination's own guard does), not as a queue that keeps the
        # scheduler's hand-off guard off this instance for a step.
        adopted = phase is RequestPhase.WAITING and self.leases.is_adopted(vllm_request.request_id)
        if adopted:
            phase = RequestPhase.RUNNING
        return RequestView(
            request_id=tracked.request_id,
            priority=tracked.priority,
            phase=phase,
            physical_blocks=(self.leases.num_adopted_blocks(vllm_request.request_id) if adopted
                             else self.probe.num_blocks_of(vllm_request.request_id)),
            # A queued request (new or preempted) needs its whole sequence plus the next token.
            demand_blocks=blocks_for(num_tokens + 1, self.block_size) if phase is RequestPhase.WAITING else 0,
            num_tokens=num_tokens,
            num_preemptions=vllm_request.num_preemptions,
            # (a migrated-in request's output before the move is part of vLLM's prompt: added back)
            num_output_tokens=len(tracked.prior_output_token_ids) + vllm_request.num_output_tokens,
        )
