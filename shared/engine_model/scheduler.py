"""vLLM-style local scheduler: WAITING and RUNNING queues, paged KV blocks, recompute preemption.

Synchronous and allocation-light on purpose: the live engine wraps it in asyncio, and the
discrete-event simulator calls `schedule()`/`update_from_output()` millions of times in virtual
time. Per-step work is O(batch) (O(1) per scheduled request on the common decode path).

Step modes:
- "v1" (vLLM v1): one token budget per step. Running requests are served first (one decode
  token each, or their next prefill chunk); the rest of the budget admits waiting requests, with
  chunked prefill. A chunk that does not finish the prompt samples no token.
- "v0" (vLLM 0.2, the Llumnix testbed): if waiting requests can be admitted, the step prefills
  whole prompts only (the running batch stalls); otherwise it decodes all running requests.

Admission needs room for the request's whole sequence (vLLM v1's `scheduler_reserve_full_isl`,
its default). With the "priority" queue, a waiting request that cannot be admitted preempts
running requests of strictly lower priority (vLLM V0's priority preemption; vLLM v1 preempts by
priority only when a running request needs a block).
"""

from __future__ import annotations

from shared.engine_model.block_manager import BlockManager, blocks_for_tokens
from shared.engine_model.config import SchedulerConfig
from shared.engine_model.invariants import check_scheduler_invariants
from shared.engine_model.load_report import RequestAggregates, RequestCounts
from shared.engine_model.migration_verbs import MigrationVerbs
from shared.engine_model.prefill_claims import PrefillClaims
from shared.engine_model.queues import create_request_queue, priority_key, select_victim
from shared.engine_model.request import RequestStatus, SimRequest
from shared.engine_model.step import SchedulerOutput, StepEvents
from shared.engine_model.views import EngineError, RequestPhase, RequestView
from shared.messages import Refusal

_RUNNING = RequestStatus.RUNNING


class SimScheduler(MigrationVerbs):
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config = config or SchedulerConfig()
        self.block_size = config.block_size
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.prefix_cache = self.block_manager.cache  # None unless enable_prefix_caching
        self.max_seq_len = config.max_seq_len
        self.waiting = create_request_queue(config.queue_policy)
        self.running: list[SimRequest] = []
        self.suspended: dict[str, SimRequest] = {}
        self.requests: dict[str, SimRequest] = {}  # every live request: waiting, running, suspended
        self.num_preemptions_total = 0
        self.counts = RequestCounts(config.block_size)
        self._priority_preemption = config.queue_policy == "priority" and config.preempt_for_priority
        self._prefill_claims = PrefillClaims(config.block_size)  # v1 chunked prefill's unallocated rest

    # -- intake --------------------------------------------------------------------------------

    def add_request(self, request: SimRequest) -> None:
        self._validate(request)
        if request.prompt_len + 1 > self.max_seq_len:
            capacity = self.config.num_blocks * self.block_size
            raise EngineError(
                f"request {request.request_id}: prompt of {request.prompt_len} tokens (+1 generated) does not fit "
                f"(max_model_len {self.config.max_model_len}, KV capacity {capacity} tokens)", Refusal.TOO_LONG
            )
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
        request.set_stop(self.max_seq_len)
        self.requests[request.request_id] = request
        self.counts.count_live(request, +1)
        self._push_waiting(request, front=False)

    def abort_request(self, request_id: str, now: float = 0.0) -> SimRequest | None:
        """Drop a live request wherever it is and free its blocks; None if it is not here."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.SUSPENDED:
            del self.suspended[request_id]
            self.block_manager.free(request_id)
        elif request.status == _RUNNING:
            self.running.remove(request)
            self.block_manager.free(request_id)
        else:
            self.waiting.remove(request)
            self.counts.count_waiting(request, -1)
        self._finish(request, RequestStatus.FINISHED_ABORTED, now)
        return request

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def get(self, request_id: str) -> SimRequest | None:
        return self.requests.get(request_id)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.waiting and self._priority_preemption:
            self._preempt_for_waiting_priority(out, now)
        if self.config.step_mode == "v1":
            self._schedule_running(out, now, self.config.max_num_batched_tokens)
            if not out.preempted:  # as vLLM v1: a step that had to preempt admits nobody
                self._admit_waiting(out, now, chunked=self.config.enable_chunked_prefill)
        elif out.preempted or not (self.waiting and self._admit_waiting(out, now, chunked=False)):
            self._schedule_running(out, now, None)  # v0: decode everything, no token budget
        return out

    def update_from_output(self, out: SchedulerOutput, now: float = 0.0) -> StepEvents:
        """Apply a finished step: advance computed tokens, sample, finish. Requests aborted,
        suspended or preempted while the step ran are skipped (their work is discarded)."""
        new_token: list[SimRequest] = []
        finished: list[SimRequest] = []
        caching = self.prefix_cache is not None
        for request, num_new in zip(out.requests, out.num_new_tokens):
            if request.status is not _RUNNING:
                continue
            computed = request.num_computed_tokens + num_new
            request.num_computed_tokens = computed
            if caching and request.block_hashes:  # blocks computed now may be reused (only now)
                self.block_manager.cache_full_blocks(request.request_id, request.block_hashes, computed)
            if computed < request.prompt_len + request.num_output_tokens:
                continue  # a prefill chunk that did not reach the end of the sequence
            num_output = request.num_output_tokens = request.num_output_tokens + 1
            request.last_token_time = now
            if request.first_token_time is None or request.preempted_at is not None:
                request.note_token_time(now)
            new_token.append(request)
            if num_output >= request.stop_at_output:
                self.block_manager.free(request.request_id)
                self._finish(request, request.stop_status, now)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return StepEvents(new_token, finished)

    def committed_blocks(self) -> int:
        """Free blocks already spoken for: what prompts admitted here still have to allocate
        (`PrefillClaims`); neither another admission nor a migration lease may take them."""
        return self._prefill_claims.owed(self.block_manager.num_blocks_of)

    # -- load ----------------------------------------------------------------------------------

    def request_views(self) -> list[RequestView]:
        """Waiting requests in scheduling order, then running, then suspended ones."""
        waiting, running = RequestPhase.WAITING, RequestPhase.RUNNING
        views = [
            RequestView(r.request_id, r.priority, waiting, 0, self.counts.demand_blocks(r), r.num_tokens, r.num_preemptions)
            for r in self.waiting
        ]
        num_blocks_of = self.block_manager.num_blocks_of
        for r in (*self.running, *self.suspended.values()):
            blocks = num_blocks_of(r.request_id)
            views.append(RequestView(r.request_id, r.priority, running, blocks, 0, r.num_tokens, r.num_preemptions,
                                     r.num_output_tokens))
        return views

    def load(self) -> RequestAggregates:
        """The aggregates of `request_views`, from counts kept up to date as requests move (per
        priority here, blocks per priority in the block manager): O(priority levels). Suspended
        requests count as running, as in `request_views`: they hold their blocks and are out of
        the batch only briefly."""
        head = self.waiting.peek() if self.waiting else None
        return self.counts.aggregates(len(self.running) + len(self.suspended), len(self.waiting), head,
                                      self.block_manager.group_blocks())

    def check_invariants(self) -> None:
        check_scheduler_invariants(self)

    # -- internals: scheduling -----------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, now: float, budget_limit: int | None) -> None:
        """Give every running request its next tokens (one for a decode), in running order,
        preempting victims when blocks run out; stops when the budget (if any) is spent.

        The hot loop of the simulator: bookkeeping is inlined and kept in locals, and the block
        table is consulted only when the request may cross into a new block."""
        running = self.running
        blocks_needed = self.block_manager.blocks_needed
        block_size = self.block_size
        limit = budget_limit if budget_limit is not None else 1 << 62
        requests, num_new_tokens = out.requests, out.num_new_tokens
        scheduled = out.num_scheduled_tokens
        decode_batch = decode_context = 0
        i = 0
        while i < len(running) and scheduled < limit:
            request = running[i]
            computed = request.num_computed_tokens
            num_new = request.prompt_len + request.num_output_tokens - computed
            if num_new > limit - scheduled:
                num_new = limit - scheduled
            # A block table always covers the computed tokens, so a single new token needs a new
            # block only when the computed ones fill whole blocks.
            if (num_new > 1 or computed % block_size == 0) and blocks_needed(request.request_id, computed + num_new):
                out.num_scheduled_tokens = scheduled
                out.decode_batch_size += decode_batch
                out.decode_context_tokens += decode_context
                decode_batch = decode_context = 0
                i = self._make_room(request, computed + num_new, i, out, now)
                scheduled = out.num_scheduled_tokens
                if i < 0:
                    break  # the request itself was the victim
            requests.append(request)
            num_new_tokens.append(num_new)
            scheduled += num_new
            if num_new == 1 and computed >= request.prompt_len:
                decode_batch += 1
                decode_context += computed + 1
            else:
                out.prefill_tokens += num_new
                out.prefill_chunks.append((num_new, computed))
            i += 1
        out.num_scheduled_tokens = scheduled
        out.decode_batch_size += decode_batch
        out.decode_context_tokens += decode_context

    def _admit_waiting(self, out: SchedulerOutput, now: float, chunked: bool) -> bool:
        """Move waiting requests into the batch while budget, sequence slots and blocks allow.
        Unchunked (v0, or v1 without chunked prefill): whole sequences only, and one longer than
        the budget is admitted when nothing else is in the step (vLLM 0.2 sized its budget to at
        least max_model_len instead)."""
        waiting, running, bm = self.waiting, self.running, self.block_manager
        config = self.config
        admitted = False
        while waiting and len(running) < config.max_num_seqs:
            budget = config.max_num_batched_tokens - out.num_scheduled_tokens
            request = waiting.peek()
            hit = self._prefix_hit(request)
            cached_tokens = len(hit) * self.block_size
            num_new = request.num_tokens - cached_tokens
            if num_new > budget:
                if chunked and budget > 0:
                    num_new = budget
                elif chunked or out.requests:
                    break  # (an unchunked prompt above the budget runs alone in its step)
            num_blocks = blocks_for_tokens(cached_tokens + num_new, self.block_size)
            gate = self._admission_blocks(request, cached_tokens) if config.reserve_full_sequence else num_blocks
            if hit:  # hits held by others cost nothing; evictable ones leave the free pool
                gate -= len(hit) - self.prefix_cache.count_evictable(hit)
            watermark = config.watermark_blocks if running else 0  # (as vLLM: only next to others)
            if gate + watermark > bm.num_free - self.committed_blocks():
                break
            waiting.pop()
            self.counts.count_waiting(request, -1)
            bm.allocate(request.request_id, num_blocks, group=request.priority, cached=hit)
            if config.reserve_full_sequence and cached_tokens + num_new < request.num_tokens:
                self._prefill_claims.claim(request, request.num_tokens)
            if self.prefix_cache is not None and request.first_scheduled_time is None:
                self.prefix_cache.record_query(request.num_tokens, cached_tokens)
            request.start_running(now, cached_tokens)
            running.append(request)
            out.record(request, num_new, cached_tokens)
            admitted = True
        return admitted

    def _admission_blocks(self, request: SimRequest, cached_tokens: int = 0) -> int:
        """Blocks the waiting request's table must reach to be admitted (before the watermark
        and before prefix-cache hits are taken off): its whole sequence, or with chunk-only
        admission its cached prefix and first chunk."""
        config = self.config
        num_tokens = request.num_tokens
        if not config.reserve_full_sequence and config.step_mode == "v1" and config.enable_chunked_prefill:
            num_tokens = min(num_tokens, cached_tokens + config.max_num_batched_tokens)
        return blocks_for_tokens(num_tokens, self.block_size)

    def waiting_prefill_tokens(self) -> int | None:
        """Tokens the waiting requests will prefill, each less the prefix cached here now (as its
        admission would find it; None without a prefix cache: nothing is taken off then, and a
        report's waiting demand says as much). O(waiting requests x blocks matched): per report."""
        if self.prefix_cache is None:
            return None
        cache = self.prefix_cache
        return sum(r.num_tokens - cache.matched_blocks(r.block_hashes, self._max_hit_blocks(r)) * self.block_size
                   for r in self.waiting)

    def _prefix_hit(self, request: SimRequest) -> list[int]:
        """The cached blocks of the request's leading prefix (`_max_hit_blocks` at most)."""
        cache = self.prefix_cache
        if cache is None or not request.block_hashes:
            return []
        return cache.longest_hit(request.block_hashes, self._max_hit_blocks(request))

    def _max_hit_blocks(self, request: SimRequest) -> int:
        """A hit leaves at least the request's last token to compute (as vLLM: the step that
        computes it samples the next token)."""
        return (request.num_tokens - 1) // self.block_size

    def _preempt_for_waiting_priority(self, out: SchedulerOutput, now: float) -> None:
        """vLLM V0's `_schedule_priority_preemption`: when the head of the waiting queue (the most
        important request) cannot be admitted, for want of blocks or of a sequence slot, preempt
        running requests of strictly lower priority, least important first (largest priority
        value, then latest arrival), until it can; it is admitted by the next step. Equal
        priorities never preempt each other (no ping-pong). Unlike V0, nothing is preempted when
        even all the lower-priority requests together would not make room."""
        head = self.waiting.peek()
        if head.priority >= max(self.counts.live):
            return  # nothing alive is less important (the common case: one priority)
        running, bm, config = self.running, self.block_manager, self.config
        need = self._admission_blocks(head)

        def admissible() -> bool:
            watermark = config.watermark_blocks if running else 0
            return need + watermark <= bm.num_free - self.committed_blocks() and len(running) < config.max_num_seqs

        if admissible():
            return
        lower = [r for r in running if r.priority > head.priority]
        if not lower or need > bm.num_free + sum(bm.num_blocks_of(r.request_id) for r in lower):
            return
        lower.sort(key=priority_key, reverse=True)
        for victim in lower:
            running.remove(victim)
            self._preempt(victim, out, now)
            if admissible():
                return

    def _make_room(self, request: SimRequest, num_tokens: int, index: int, out: SchedulerOutput, now: float) -> int:
        """Preempt victims until `request` can hold `num_tokens`, then grow its table. Returns
        the request's index in `running` (victims before it shift it), or -1 if it was itself
        preempted."""
        running, bm = self.running, self.block_manager
        policy = self.config.queue_policy
        while not bm.can_append(request.request_id, num_tokens):
            victim = select_victim(policy, running)
            victim_index = len(running) - 1 if victim is running[-1] else running.index(victim)
            del running[victim_index]
            if victim_index < index:  # already scheduled in this step: take it back out
                out.unrecord(victim)
                index -= 1
            self._preempt(victim, out, now)
            if victim is request:
                return -1
        bm.append_slots(request.request_id, num_tokens)
        return index

    def _preempt(self, request: SimRequest, out: SchedulerOutput, now: float) -> None:
        self.block_manager.free(request.request_id)
        request.preempt(now)
        self.num_preemptions_total += 1
        out.preempted.append(request)
        self._push_waiting(request, front=True)

    # -- internals: bookkeeping ----------------------------------------------------------------

    def _validate(self, request: SimRequest) -> None:
        if request.request_id in self.requests:
            raise EngineError(f"duplicate request id {request.request_id}", Refusal.DUPLICATE)
        if request.prompt_len < 1:
            raise EngineError(f"request {request.request_id}: empty prompt")
        if request.max_tokens < 1:
            raise EngineError(f"request {request.request_id}: max_tokens must be at least 1")
        if request.target_output_len is not None and request.target_output_len < 1:
            raise EngineError(f"request {request.request_id}: target_output_len must be at least 1")

    def _push_waiting(self, request: SimRequest, front: bool) -> None:
        if front:
            self.waiting.add_front(request)
        else:
            self.waiting.add(request)
        self.counts.count_waiting(request, +1)

    def _finish(self, request: SimRequest, status: RequestStatus, now: float) -> None:
        request.finish(status, now)
        del self.requests[request.request_id]
        self.counts.count_live(request, -1)
