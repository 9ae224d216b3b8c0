"""Resume by recompute: a request whose instance died (or gave it up) continues on another one.

The new instance gets the prompt plus every token already delivered as its prompt, `max_tokens`
reduced by as many, and output indices that continue where the client's stream stands, so the
stream goes on with no gap, no duplicate and no error. Greedy output is the same as without the
fault: the continuation of a token sequence does not depend on which instance computed it.

What an engine cannot rebuild from tokens cannot be resumed, and ends the request with a terminal
error instead of output that silently differs (`resume_refusal`).

A stream can also fall silent with its holder alive: its last chunk was lost (no gap shows), or
the holder dropped it without a word. After `SILENCE_PROBE_S` of silence (counted only while the
gateway keeps up with its token output: a chunk in its own backlog is not lost) the holder is sent the
request's continuation (`Resumer.silent`): "already running here" (a duplicate refusal) means it
still holds the request (queued, preempted, a long prefill), and it is asked again after twice
as long; taken means it no longer held it, and it now continues the stream where it stands.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from services.gateway.errors import ApiError
from services.gateway.protocol import GenerationOptions
from services.gateway.streams import OutputStream
from shared.messages import Refusal

if TYPE_CHECKING:
    from services.gateway.prepared import PreparedRequest

log = logging.getLogger(__name__)

# A resume that finds every instance too busy to take it (an overload refusal) tries again for
# this long before the stream ends with the refusal: a stream mid-way is worth a short wait. With
# no instance left at all it ends at once.
RESUME_PATIENCE_S = 5.0
RESUME_RETRY_S = 0.25
SILENCE_PROBE_S = 2.0  # a stream silent this long has its holder asked; then after 2x, 4x … as long
SILENCE_PROBE_MAX_S = 30.0

# place(request, stream, exclude, resume_from): dispatch and send it, as for a new request.
Place = Callable[["PreparedRequest", OutputStream, list[str], int], Awaitable[None]]
# send(instance, request, stream, resume_from): hand it to that instance; raises as `Place` does
# (a refusal is an ApiError), or anything else when the instance is gone.
Send = Callable[[str, "PreparedRequest", OutputStream, int], Awaitable[None]]
# abort(request id, why): drop the request on every instance.
Abort = Callable[[str, str], None]


def unresumable_state(options: GenerationOptions) -> str | None:
    """State of the request that lives only in the engine that ran it; None when tokens carry all.

    - Seeded sampling at a temperature above 0: the generator's state after N draws is not
      something another engine can rebuild from the N tokens (vLLM keeps a per-request
      torch.Generator), so a resumed stream would not be the one this seed gives.
    - Greedy decoding (temperature 0, seed or not), unseeded sampling (any continuation is as
      valid as another), penalties over prompt and output (repetition_penalty: vLLM applies it
      to prompt and output tokens alike), min_tokens and max_tokens (reduced by what was
      delivered), stop strings and detokenization (the gateway's own state) and logprobs (those
      streamed stay streamed; the new instance computes the rest) all carry over.
    """
    if options.seed is not None and options.temperature > 0:
        return "its seeded sampling state cannot be rebuilt on another instance"
    return None


def resume_refusal(options: GenerationOptions, resumes: int, max_resumes: int, delivered: int,
                   max_tokens: int) -> str | None:
    """Why this request must not be resumed; None when it may."""
    if resumes >= max_resumes:
        return f"it was resumed {resumes} time(s) already (limit {max_resumes})"
    if (state := unresumable_state(options)) is not None:
        return state
    if delivered >= max_tokens:
        return "every token was delivered but the end of the request was lost"
    return None


def silence_probe_due(silent_s: float, probes: int) -> bool:
    """Whether a stream silent for `silent_s`, its holder asked `probes` times already, is asked again."""
    # The exponent stops once past the cap: 2.0 * 2**1024 does not fit a float (~8 h of probes).
    return silent_s >= min(SILENCE_PROBE_MAX_S, SILENCE_PROBE_S * 2 ** min(probes, 32))


def resumed_request(request: PreparedRequest, delivered: list[int]) -> PreparedRequest:
    """The same request, continued after `delivered`: those tokens join the prompt."""
    options = request.options
    options = dataclasses.replace(options, min_tokens=max(0, options.min_tokens - len(delivered)))
    return dataclasses.replace(request, prompt_token_ids=[*request.prompt_token_ids, *delivered],
                               max_tokens=request.max_tokens - len(delivered), options=options)


class Resumer:
    """The requests this gateway may resume, and the resuming itself."""

    def __init__(self, place: Place, max_resumes: int, spawn: Callable[[Coroutine[Any, Any, None]], None],
                 on_resumed: Callable[[float], None] | None = None,
                 is_open: Callable[[str], bool] = lambda request_id: True,
                 send: Send | None = None, abort: Abort | None = None) -> None:
        self._place = place
        self._send = send  # (None: silent streams are not probed)
        self._abort = abort
        self._is_open = is_open  # False once the client is gone: stop trying
        self.max_resumes = max_resumes
        self._spawn = spawn
        self._on_resumed = on_resumed  # seconds from losing the holder to the new one acknowledging
        self._requests: dict[str, PreparedRequest] = {}

    def track(self, request: PreparedRequest) -> None:
        self._requests[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def lost(self, stream: OutputStream, instance_id: str, why: str) -> None:
        """`instance_id` no longer runs the request (died, left, lost a chunk): resume it elsewhere,
        or end the stream with a terminal error that says why it cannot be."""
        if stream.finished or instance_id != stream.holder or instance_id in stream.left:
            return  # not its holder (any more), or being resumed already
        stream.abandon(instance_id)
        request = self._requests.get(stream.request_id)
        if request is None:
            stream.fail(f"{why}; the request cannot be resumed", 503)
            return
        refusal = resume_refusal(request.options, stream.resumes, self.max_resumes, len(stream.delivered),
                                 request.max_tokens)
        if refusal is not None:
            log.warning("request %s: %s; not resumed: %s", stream.request_id, why, refusal)
            stream.fail(f"{why}; the request cannot be resumed: {refusal}", 503)
            return
        stream.resumes += 1
        self._spawn(self._resume(stream, request, instance_id, why))

    async def _resume(self, stream: OutputStream, request: PreparedRequest, lost: str, why: str) -> None:
        started = time.monotonic()
        async with stream.placing:  # after a placement in flight (submit's, say) is done
            if stream.finished or not self._is_open(stream.request_id) or stream.holder != lost:
                # Placed elsewhere meanwhile (its first placement moved on from the instance
                # lost), or ended: sending the id out once more would run it twice.
                log.info("request %s: %s; not resumed: placed on %s meanwhile, or ended", stream.request_id, why,
                         stream.holder)
                stream.resumes -= 1
                return
            await self._resume_placed(stream, request, why, started)

    async def _resume_placed(self, stream: OutputStream, request: PreparedRequest, why: str, started: float) -> None:
        delivered = list(stream.delivered)
        try:
            while True:
                try:
                    await self._place(resumed_request(request, delivered), stream, sorted(stream.left),
                                      len(delivered))
                    break
                except ApiError as error:
                    if error.reason is Refusal.DUPLICATE:
                        # The instance chosen runs the request already: a migration of it landed
                        # there before its holder was lost. It is the holder (`_place` made it so):
                        # its chunks continue the stream, and silence would be noticed (`silent`).
                        log.info("request %s: %s; %s holds it already (migrated there): kept there",
                                 stream.request_id, why, stream.holder)
                        stream.heard()
                        return
                    if (error.reason is not Refusal.OVERLOADED or time.monotonic() - started > RESUME_PATIENCE_S
                            or not self._is_open(stream.request_id)):
                        raise
                await asyncio.sleep(RESUME_RETRY_S)
        except ApiError as error:
            log.warning("request %s: %s; resuming it failed: %s", stream.request_id, why, error.message)
            stream.fail(f"{why}; resuming the request elsewhere failed: {error.message}", error.status)
            return
        except Exception as exc:  # the stream must end, whatever went wrong
            log.exception("request %s: resuming it failed", stream.request_id)
            stream.fail(f"{why}; resuming the request elsewhere failed: {exc}", 503)
            return
        took = time.monotonic() - started
        log.info("request %s: %s; resumed on %s after %d delivered tokens (%.0f ms)", stream.request_id, why,
                 stream.holder, len(delivered), took * 1000)
        if self._on_resumed is not None:
            self._on_resumed(took)

    def silent(self, stream: OutputStream, instance_id: str, not_before: float = 0.0) -> None:
        """No chunk for a while from `instance_id`, its holder, alive as far as its load reports
        tell: when due (`silence_probe_due`, silence counted from `not_before` at the earliest),
        ask it by sending it the request's continuation."""
        if (self._send is None or stream.finished or stream.probing or stream.placing.locked()
                or instance_id != stream.holder or instance_id in stream.left):
            return
        if not silence_probe_due(time.monotonic() - max(stream.quiet_since, not_before), stream.silence_probes):
            return
        request = self._requests.get(stream.request_id)
        if request is None:
            return
        stream.probing = True
        self._spawn(self._probe(stream, request, instance_id))

    async def _probe(self, stream: OutputStream, request: PreparedRequest, instance_id: str) -> None:
        assert self._send is not None
        silent_s = time.monotonic() - stream.quiet_since
        why = f"no output from instance {instance_id} for {silent_s:.1f} s"
        delivered = list(stream.delivered)
        refusal = resume_refusal(request.options, stream.resumes, self.max_resumes, len(delivered), request.max_tokens)
        try:
            async with stream.placing:
                await self._send(instance_id, resumed_request(request, delivered), stream, len(delivered))
        except ApiError as error:
            if error.reason is Refusal.DUPLICATE:  # it still holds the request: wait, ask again later
                stream.silence_probes += 1
                return
            self.lost(stream, instance_id, f"{why}, and it no longer holds the request ({error.message})")
            return
        except Exception as exc:  # (gone, or no answer)
            self.lost(stream, instance_id, f"{why}, and it did not answer ({exc or type(exc).__name__})")
            return
        finally:
            stream.probing = False
        # It took the continuation: it had dropped the request (its last chunk was lost, or it
        # was dropped without a word), and now runs it again from where the stream stands.
        if stream.finished or not self._is_open(stream.request_id) or refusal is not None:
            if self._abort is not None:
                self._abort(stream.request_id, "a silent stream's continuation that must not run")
            if refusal is not None:
                log.warning("request %s: %s, and it no longer holds the request; not resumed: %s",
                            stream.request_id, why, refusal)
                stream.fail(f"{why}, and it no longer holds the request; it cannot be resumed: {refusal}", 503)
            return
        stream.resumes += 1
        stream.heard()
        log.warning("request %s: %s, and it no longer held the request (its last chunk lost?): resumed there "
                    "after %d delivered tokens", stream.request_id, why, len(delivered))
