"""Per-request output streams: token chunks from whichever llumlet holds the request, in order.

After a migration the destination continues from the next token index while late chunks from
the source may still be in flight, so chunks can arrive duplicated, overlapping or out of order.
`TokenOrderer` (pure) turns them into one gap-free, duplicate-free sequence; `OutputStream` adds
the queue the HTTP handler reads and the bookkeeping of which instance holds the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from shared.messages import FinishReason, TokenChunk, TokenLogprob

log = logging.getLogger(__name__)

# Chunks held past a gap, per request. A migration's overlap leaves a handful; more is a
# misbehaving (or forged) publisher, and each held chunk costs memory and a scan per delivery.
MAX_PENDING_CHUNKS = 256


@dataclass
class Delivery:
    """The next tokens of a request, in order; a finish reason or an error ends the stream."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: int = 500
    # One per token, when the chunk carried them; a None entry: that token's came later (see
    # OutputStream.feed) for only some of the tokens.
    logprobs: Sequence[TokenLogprob | None] | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def _end(chunk: TokenChunk) -> int:
    return chunk.start_index + len(chunk.token_ids)


@dataclass
class TokenOrderer:
    next_index: int = 0
    done: bool = False
    finish_reason: FinishReason | None = None  # the engine's own end of the request
    pending: dict[int, TokenChunk] = field(default_factory=dict)  # chunks that start past a gap
    # The request's max_tokens: never more is delivered, whatever an instance sends (the stream
    # then ends with `length`, as the engine's own end would); None: no bound (tests).
    max_tokens: int | None = None

    def is_stale(self, chunk: TokenChunk) -> bool:
        """Nothing new: every token already delivered, and no finish exactly at our position."""
        if chunk.error is not None:
            return False
        end = _end(chunk)
        return end < self.next_index or (end == self.next_index and chunk.finish_reason is None)

    def accept(self, chunk: TokenChunk) -> list[Delivery]:
        if self.done:
            return []
        if chunk.error is not None:
            self.done = True
            return [Delivery(self._new_tokens(chunk), error=chunk.error, logprobs=self._new_logprobs(chunk))]
        if chunk.start_index > self.next_index:
            self._buffer(chunk)
            return []
        out = self._apply(self._clipped(chunk))
        while not self.done and (ready := self._pop_ready()) is not None:
            out += self._apply(self._clipped(ready))
        return out

    def _clipped(self, chunk: TokenChunk) -> TokenChunk:
        """The chunk cut at max_tokens, ending the request there if it went past."""
        if self.max_tokens is None or _end(chunk) <= self.max_tokens:
            return chunk
        keep = max(0, self.max_tokens - chunk.start_index)
        logprobs = chunk.logprobs[:keep] if chunk.logprobs is not None else None
        log.warning("request %s: instance %s sent tokens past max_tokens=%d; cut there", chunk.request_id,
                    chunk.instance_id, self.max_tokens)
        return msgspec.structs.replace(chunk, token_ids=chunk.token_ids[:keep], logprobs=logprobs,
                                       finish_reason=chunk.finish_reason or FinishReason.LENGTH)

    def _buffer(self, chunk: TokenChunk) -> None:
        if self.max_tokens is not None and chunk.start_index >= self.max_tokens:
            return  # can never be delivered
        held = self.pending.get(chunk.start_index)
        if held is None and len(self.pending) >= MAX_PENDING_CHUNKS:
            log.warning("request %s: %d chunks already wait past a gap; dropping one at %d", chunk.request_id,
                        len(self.pending), chunk.start_index)
            return
        if held is None or _end(chunk) > _end(held) or (_end(chunk) == _end(held) and chunk.finish_reason):
            self.pending[chunk.start_index] = chunk

    def _pop_ready(self) -> TokenChunk | None:
        ready = [start for start in self.pending if start <= self.next_index]
        return self.pending.pop(min(ready)) if ready else None

    def _new_tokens(self, chunk: TokenChunk) -> list[int]:
        if chunk.start_index > self.next_index:
            return []
        return chunk.token_ids[self.next_index - chunk.start_index:]

    def _new_logprobs(self, chunk: TokenChunk) -> list[TokenLogprob] | None:
        if chunk.logprobs is None or chunk.start_index > self.next_index:
            return None
        return chunk.logprobs[self.next_index - chunk.start_index:]

    def _apply(self, chunk: TokenChunk) -> list[Delivery]:
        assert chunk.start_index <= self.next_index, "a chunk past a gap must wait in `pending`"
        if self.is_stale(chunk):
            return []
        new, logprobs = self._new_tokens(chunk), self._new_logprobs(chunk)
        self.next_index += len(new)
        if chunk.finish_reason is not None:
            self.done = True
            self.finish_reason = chunk.finish_reason
            self.pending.clear()
        return [Delivery(new, chunk.finish_reason, logprobs=logprobs)]


@dataclass
class HandoverClock:
    """A migration as the client sees it: the stall from the last new tokens delivered before
    the destination's handover chunk to the first delivered after it (Llumnix's downtime, ending
    at the client). Only a handover starts one: a resume (the request recomputed elsewhere) is
    not a migration, and a source's late chunks after the handover are not another."""

    last_at: float | None = None  # the latest delivery of new tokens
    awaiting: bool = False  # a handover chunk came: the next delivery ends its stall

    def handed_over(self) -> None:
        self.awaiting = True

    def delivered(self, now: float) -> float | None:
        """New tokens reached the client now (whichever chunk released them: the source's last
        may come after the destination's first): the stall, if a handover awaited them."""
        stall = now - self.last_at if self.awaiting and self.last_at is not None else None
        self.last_at, self.awaiting = now, False
        return stall

    def reset(self) -> None:
        """A resume: what comes next is no handover."""
        self.awaiting = False


class OutputStream:
    """One request's ordered output, fed from the NATS callback and read by the HTTP handler."""

    def __init__(self, request_id: str, instance_id: str | None = None,
                 on_handover_stall: Callable[[float], None] | None = None, max_tokens: int | None = None,
                 on_lost: Callable[[OutputStream, str, str], None] | None = None,
                 max_buffered: int | None = None, on_stray: Callable[[OutputStream, str], None] | None = None) -> None:
        self.request_id = request_id
        self._max_buffered = max_buffered  # deliveries waiting for a slow client (None: no bound)
        self.orderer = TokenOrderer(max_tokens=max_tokens)
        self.handover = HandoverClock()
        self._on_handover_stall = on_handover_stall
        self.holder = instance_id  # the instance whose chunks we are reading now
        self.holder_since = time.monotonic()
        self.holders: list[str] = [instance_id] if instance_id else []  # every holder, in order
        self.num_prompt_tokens = 0
        self.predicted_ttft_s: float | None = None  # admission's, on the instance dispatch chose (if any)
        # From the first instance that reports it: a migration's or a resume's later instance
        # may find more of the prompt (and its own output) cached, but the client's prompt was
        # looked up once.
        self.num_cached_tokens: int | None = None
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self._failed = False
        # Resume by recompute (services/gateway/resume.py): every token delivered so far (the
        # new instance's prompt ends with them), the instances left behind (their late chunks
        # are dropped: after a resume they may disagree), and who to tell when the holder gives
        # the request up (stream, instance, why).
        self.delivered: list[int] = []
        self.left: set[str] = set()
        # Instances whose handover came from one left behind: a migration out of it that committed
        # after the resume, so a second copy, unless a resume then placed the request there.
        self._late_copies: set[str] = set()
        # Instances a migration moved the request out of: their late chunks do not make them the
        # holder again (a resumable error from the holder would then go unheard).
        self._handed_off: set[str] = set()
        self._told_to_drop: set[str] = set()
        self._on_stray = on_stray  # ask that one instance to drop its copy (stream, instance)
        self.resumes = 0
        self.gap_since: float | None = None  # when chunks first waited past a gap (a lost chunk)
        # A lost last chunk leaves no gap: silence is the only sign. Since when no chunk came (or
        # the holder changed), and how often the holder was asked about it since (resume.py).
        self.quiet_since = time.monotonic()
        self.silence_probes = 0
        self.probing = False  # its holder is being asked now
        # Held while the request is being placed (its first placement, a resume, a silence probe):
        # one at a time, so a resume set off mid-placement cannot send the same id elsewhere too.
        self.placing = asyncio.Lock()
        self._on_lost = on_lost
        # Queued deliveries of a migration's catch-up chunk (no logprobs: the destination never
        # saw them), by their first token index: a late chunk from the source may fill them in.
        self._unread_catch_up: list[tuple[int, Delivery]] = []

    @property
    def finished(self) -> bool:
        return self.orderer.done or self._failed

    @property
    def upstream_finished(self) -> bool:
        """The engine ended the request itself: nothing is left to abort."""
        return self.orderer.finish_reason is not None

    def set_holder(self, instance_id: str) -> None:
        if instance_id != self.holder:
            self.holder = instance_id
            self.holder_since = time.monotonic()
            self.holders.append(instance_id)
            self.heard()

    def heard(self) -> None:
        """Something came from (or was agreed with) the holder: silence counts from now."""
        self.quiet_since = time.monotonic()
        self.silence_probes = 0

    def feed(self, chunk: TokenChunk) -> None:
        if self.finished:
            return
        if chunk.instance_id in self.left or self._late_copy(chunk):
            self._stray(chunk)
            return
        if chunk.error is not None and chunk.resumable and self._on_lost is not None:
            if chunk.instance_id == self.holder:
                self._on_lost(self, chunk.instance_id, chunk.error)
            return
        if chunk.handover:
            self._handed_off.discard(chunk.instance_id)
            if chunk.handover_from is not None:
                self._handed_off.add(chunk.handover_from)
            self.handover.handed_over()
            self.set_holder(chunk.instance_id)
        elif not self.orderer.is_stale(chunk) and chunk.instance_id not in self._handed_off:
            self.set_holder(chunk.instance_id)
        self.heard()
        if chunk.num_prompt_tokens:
            self.num_prompt_tokens = chunk.num_prompt_tokens
        if self.num_cached_tokens is None and chunk.num_cached_tokens is not None:
            self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.logprobs is not None and self._unread_catch_up:
            self._fill_logprobs(chunk)
        deliveries = self.orderer.accept(chunk)
        for delivery in deliveries:
            if chunk.handover and delivery.token_ids and delivery.logprobs is None:
                self._unread_catch_up.append((len(self.delivered), delivery))
            self.delivered += delivery.token_ids
            self._queue.put_nowait(delivery)
        if self._max_buffered is not None and self._queue.qsize() > self._max_buffered and not self.orderer.done:
            self._overflow()
        self.gap_since = (self.gap_since or time.monotonic()) if self.orderer.pending else None
        if any(d.token_ids for d in deliveries):
            stall = self.handover.delivered(time.monotonic())
            if stall is not None and self._on_handover_stall is not None:
                self._on_handover_stall(stall)

    def _fill_logprobs(self, chunk: TokenChunk) -> None:
        """The source's chunk came after the destination's catch-up delivered the same tokens
        without logprobs: while the client has not read them, give them the source's."""
        assert chunk.logprobs is not None
        for start, delivery in self._unread_catch_up:
            for i, token_id in enumerate(delivery.token_ids):
                j = start + i - chunk.start_index
                if 0 <= j < len(chunk.token_ids) and chunk.token_ids[j] == token_id:
                    filled = list(delivery.logprobs or [None] * len(delivery.token_ids))
                    filled[i] = chunk.logprobs[j]
                    delivery.logprobs = filled

    def _read(self, delivery: Delivery) -> Delivery:
        if self._unread_catch_up:  # read now: too late to fill in
            self._unread_catch_up = [(s, d) for s, d in self._unread_catch_up if d is not delivery]
        return delivery

    def _overflow(self) -> None:
        """The client reads slower than the engine writes: drop what waits for it and end the
        stream with an error at once (its handler then aborts the engine's copy), rather than
        hold an ever longer queue."""
        log.warning("request %s: %d deliveries wait for a slow client: ending it", self.request_id, self._queue.qsize())
        while not self._queue.empty():
            self._queue.get_nowait()
        self._unread_catch_up.clear()
        self.fail(f"the client read too slowly: more than {self._max_buffered} engine steps' output waited for it", 503)

    def _late_copy(self, chunk: TokenChunk) -> bool:
        if chunk.instance_id == self.holder:
            return False
        if chunk.handover and chunk.handover_from is not None and chunk.handover_from in self.left:
            self._late_copies.add(chunk.instance_id)
        return chunk.instance_id in self._late_copies

    def _stray(self, chunk: TokenChunk) -> None:
        """Output of a copy a resume left running (its instance taken for dead while alive, or a
        migration out of it committed late): dropped, and that instance alone told to drop the
        request — unless a placement is in flight, which may yet make it the holder."""
        if (self.placing.locked() or chunk.instance_id == self.holder or chunk.instance_id in self._told_to_drop
                or chunk.finish_reason is not None or chunk.error is not None):
            return
        self.left.add(chunk.instance_id)
        self._told_to_drop.add(chunk.instance_id)
        if self._on_stray is not None:
            log.warning("request %s: %s still runs a copy a resume left behind: aborting it there",
                        self.request_id, chunk.instance_id)
            self._on_stray(self, chunk.instance_id)

    def abandon(self, instance_id: str) -> None:
        """A resume leaves `instance_id` behind: its chunks, late or held past a gap, are dropped
        (after the resume the new instance's tokens may disagree with them)."""
        self.left.add(instance_id)
        self.orderer.pending.clear()
        self.gap_since = None
        self.handover.reset()

    def fail(self, message: str, code: int = 503) -> None:
        """End the stream from the gateway's side (holder died, shutdown): an error delivery."""
        if self.finished:
            return
        self._failed = True
        self._queue.put_nowait(Delivery([], error=message, error_code=code))

    async def next(self, timeout_s: float) -> Delivery:
        """The next delivery: one engine step's tokens, as vLLM's server streams them.

        Deliveries are not merged even when several are queued: a client then sees one SSE event
        per engine step, and the chunk gaps it measures (ITL) mean what they mean against vLLM.
        """
        if not self._queue.empty():
            return self._read(self._queue.get_nowait())
        # Once per token of every stream: `asyncio.timeout` arms a timer, where 3.11's
        # `wait_for` also wraps the get in a new Task.
        async with asyncio.timeout(timeout_s):
            return self._read(await self._queue.get())


class StreamRegistry:
    """Open streams by request id: the demultiplexer behind the gateway's output subject."""

    def __init__(self, on_handover_stall: Callable[[float], None] | None = None, vocab_size: int | None = None,
                 on_lost: Callable[[OutputStream, str, str], None] | None = None,
                 max_buffered: int | None = None, on_stray: Callable[[OutputStream, str], None] | None = None) -> None:
        self._streams: dict[str, OutputStream] = {}
        self._on_stray = on_stray  # a copy a resume left running (see OutputStream._stray)
        self._max_buffered = max_buffered  # per stream: see OutputStream
        self._on_lost = on_lost  # a holder gave a request up whole: resume it elsewhere
        self._on_handover_stall = on_handover_stall  # each migration's client-visible stall (seconds)
        self._vocab_size = vocab_size  # token ids past it are refused (None: not checked)

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[OutputStream]:
        return iter(list(self._streams.values()))

    def open(self, request_id: str, max_tokens: int | None = None) -> OutputStream:
        assert request_id not in self._streams, f"request id {request_id} is already in flight"
        stream = self._streams[request_id] = OutputStream(request_id, on_handover_stall=self._on_handover_stall,
                                                          max_tokens=max_tokens, on_lost=self._on_lost,
                                                          max_buffered=self._max_buffered, on_stray=self._on_stray)
        return stream

    def refusal(self, chunk: TokenChunk) -> str | None:
        """Why a chunk must not reach its stream (a token the tokenizer cannot detokenize: it
        would end the client's stream without an error); None when it may."""
        if self._vocab_size is not None and any(t >= self._vocab_size for t in chunk.token_ids):
            return f"token ids of request {chunk.request_id} from {chunk.instance_id} past the vocabulary ({self._vocab_size})"
        if chunk.logprobs is not None and len(chunk.logprobs) != len(chunk.token_ids):
            return f"{len(chunk.logprobs)} logprobs for {len(chunk.token_ids)} tokens"
        return None

    def is_open(self, request_id: str) -> bool:
        return request_id in self._streams

    def close(self, request_id: str) -> bool:
        """Forget a stream; False when it was not open (closed already)."""
        return self._streams.pop(request_id, None) is not None

    def route(self, chunk: TokenChunk) -> bool:
        """Hand a chunk to its stream; False when the request is unknown (aborted or finished)."""
        stream = self._streams.get(chunk.request_id)
        if stream is None:
            return False
        stream.feed(chunk)
        return True
