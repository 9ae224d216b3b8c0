"""Resume by recompute: a request whose instance died (or gave it up) continues on another one.

The new instance gets the prompt plus every token already delivered as its prompt, `max_tokens`
reduced by as many, and output indices that continue where the client's stream stands, so the
stream goes on with no gap, no duplicate and no error. Greedy output is the same as without the
fault: the continuation of a token sequence does not depend on which instance computed it.

What an engine cannot rebuild from tokens cannot be resumed, and ends the request with a terminal
error instead of output that silently differs (`resume_refusal`).
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

# place(request, stream, exclude, resume_from): dispatch and send it, as for a new request.
Place = Callable[["PreparedRequest", OutputStream, list[str], int], Awaitable[None]]


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
                 is_open: Callable[[str], bool] = lambda request_id: True) -> None:
        self._place = place
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
        self._spawn(self._resume(stream, request, why))

    async def _resume(self, stream: OutputStream, request: PreparedRequest, why: str) -> None:
        started = time.monotonic()
        delivered = list(stream.delivered)
        try:
            while True:
                try:
                    await self._place(resumed_request(request, delivered), stream, sorted(stream.left),
                                      len(delivered))
                    break
                except ApiError as error:
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
