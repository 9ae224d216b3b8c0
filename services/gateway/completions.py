"""One completion request from body to response: parse, tokenize, submit each choice, stream or
collect the output, then release every choice and record how the request ended.

`n` > 1 is fanned out as n requests with the same prompt (each placed by dispatch like any other,
so the choices may run on different instances); their outputs are merged into one response whose
choices are indexed in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from services.gateway.body_parsing import GenerationBody, Route
from services.gateway.errors import ApiError, bad_request, error_response
from services.gateway.generation import Generation, TextEvent, TokenWithLogprob
from services.gateway.logprobs import LogprobsFormatter
from services.gateway.metrics import timeline_of
from services.gateway.middleware import GENERATED_ID_STATE, REQUEST_ID_HEADER  # the header is always there
from services.gateway.protocol import ParsedRequest, RequestKind, parse_priority
from services.gateway.responses import SSE_DONE, ResponseFormatter, Usage, json_bytes, sse_error, sse_event
from services.gateway.prepared import PreparedRequest, another_choice
from services.gateway.service import GatewayService
from services.gateway.tokenizer import PromptError
from services.gateway.tracing import RequestTrace

PRIORITY_HEADER = "x-corral-priority"
CLIENT_CLOSED = 499  # nginx's status for "the client went away first"


@dataclass(frozen=True)
class Choice:
    index: int
    prepared: PreparedRequest
    generation: Generation


class Completion:
    """The choices of one HTTP request and the way they are answered."""

    def __init__(self, service: GatewayService, kind: RequestKind, endpoint: str, trace: RequestTrace,
                 choices: list[Choice]) -> None:
        assert choices
        self.service = service
        self.endpoint = endpoint
        self.trace = trace
        self.choices = choices
        self.options = choices[0].prepared.options
        first = choices[0].prepared
        self.formatter = ResponseFormatter(kind, first.response_id, first.created, service.config.model_name)
        self._logprobs = LogprobsFormatter(service.tokenizer.token_text) if self.options.logprobs is not None else None
        self._text_offsets = [0] * len(choices)  # completions' logprobs.text_offset: output so far per choice
        self._finished = False

    def usage(self, final: bool = True) -> Usage:
        """As vLLM for `n` > 1: the prompt counted once, the completions of every choice. As vLLM
        with --enable-prompt-tokens-details, the final usage (not the continuous stats) says how
        much of the prompt was cached, when the engine keeps a prefix cache."""
        first = self.choices[0].generation
        cached = first.stream.num_cached_tokens if final and self.service.config.enable_prompt_tokens_details else None
        return Usage(first.num_prompt_tokens, sum(c.generation.num_output_tokens for c in self.choices),
                     None if cached is None else min(cached, first.num_prompt_tokens))

    def error(self) -> ApiError | None:
        return next((c.generation.error for c in self.choices if c.generation.error is not None), None)

    def logprobs(self, index: int, event: TextEvent) -> dict[str, Any] | None:
        """The event's tokens' logprobs in the response's shape (None: not asked for)."""
        if self._logprobs is None or event.logprobs is None:
            return None
        if self.formatter.kind is RequestKind.CHAT:
            return self._logprobs.chat(event.logprobs)
        shaped = self._logprobs.completion(event.logprobs, self._text_offsets[index])
        self._text_offsets[index] += len(event.text)
        return shaped

    # ---- streaming ---------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[bytes]:
        status = CLIENT_CLOSED  # until the stream got to its end
        # As vLLM's server: a chat choice's role chunk goes out with its first output, not at once,
        # so a client that times TTFT to its first chunk (vllm bench serve) measures the first token.
        roles_due = {c.index for c in self.choices} if self.formatter.kind is RequestKind.CHAT else set()
        continuous = self.options.continuous_usage_stats
        try:
            async with contextlib.aclosing(self._merged()) as merged:  # a break must stop the pumps too
                async for index, event in merged:
                    if event.text or event.finish_reason or event.logprobs:
                        chunk = sse_event(self.formatter.text_chunk(event.text, event.finish_reason,
                                                                    self.usage(final=False) if continuous else None, index,
                                                                    self.logprobs(index, event)))
                        if index in roles_due:
                            roles_due.discard(index)
                            chunk = sse_event(self.formatter.role_chunk(index)) + chunk
                        yield chunk
                    if event.error is not None:
                        yield sse_error(event.error)
                        break  # one failed choice fails the request, as one failed request would
            error = self.error()
            if error is None and self.options.include_usage:
                yield sse_event(self.formatter.usage_chunk(self.usage()))
            status = error.status if error is not None else 200
            yield SSE_DONE
        finally:
            self.finish(status)

    async def _merged(self) -> AsyncIterator[tuple[int, TextEvent]]:
        """Every choice's events as they come, tagged with the choice's index."""
        if len(self.choices) == 1:  # no task or queue in between for the usual case
            async for event in self.choices[0].generation.events():
                yield 0, event
            return
        queue: asyncio.Queue[tuple[int, TextEvent | None]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            async for event in choice.generation.events():
                queue.put_nowait((choice.index, event))
            queue.put_nowait((choice.index, None))

        pumps = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            running = len(pumps)
            while running:
                index, event = await queue.get()
                if event is None:
                    running -= 1
                else:
                    yield index, event
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    # ---- one JSON response -------------------------------------------------------------------

    async def respond(self, request: Request) -> Response:
        texts = [""] * len(self.choices)
        tokens: list[list[TokenWithLogprob]] = [[] for _ in self.choices]

        async def collect() -> None:
            async with contextlib.aclosing(self._merged()) as merged:
                async for index, event in merged:
                    texts[index] += event.text
                    tokens[index] += event.logprobs or []
                    if event.error is not None:
                        return  # one failed choice fails the request: the others are not waited for

        collecting = asyncio.create_task(collect())
        disconnect = asyncio.create_task(_wait_for_disconnect(request))
        status = CLIENT_CLOSED
        try:
            await asyncio.wait({collecting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():
                self.finish(CLIENT_CLOSED)  # the abort now, not after the cancellations below
                return Response(status_code=CLIENT_CLOSED)
            collecting.result()
            error = self.error()
            if error is not None:
                status = error.status
                return error_response(error)
            reasons = [c.generation.finish_reason for c in self.choices]
            assert all(r is not None for r in reasons)
            status = 200
            logprobs = None
            if self._logprobs is not None:
                logprobs = [self.logprobs(i, TextEvent(text, logprobs=t)) for i, (text, t) in enumerate(zip(texts, tokens))]
            body = self.formatter.full_response(texts, reasons, self.usage(), logprobs)  # type: ignore[arg-type]
            return Response(json_bytes(body), media_type="application/json")
        finally:
            for task in (collecting, disconnect):
                task.cancel()
            await asyncio.gather(collecting, disconnect, return_exceptions=True)
            self.finish(status)

    # ---- the end -----------------------------------------------------------------------------

    def finish(self, status: int) -> None:
        """Release every choice and record how the request ended; only the first call counts."""
        if self._finished:
            return
        self._finished = True
        metrics = self.service.metrics
        metrics.request_done(self.endpoint, status)
        outputs: list[tuple[str, int]] = []  # (engine, output tokens) of each choice counted
        for choice in self.choices:
            generation, prepared = choice.generation, choice.prepared
            stream = generation.stream
            if self.service.release(stream, abort=not stream.upstream_finished) and stream.holders:
                metrics.request_finished(timeline_of(generation, prepared, stream.holders[-1]))
                outputs.append((stream.holders[-1], generation.num_output_tokens))
        metrics.choices_finished(len(self.choices), outputs)
        first = self.choices[0]
        arrival, first_token = first.prepared.arrival, [c.generation.first_token_at for c in self.choices]
        seen = [t for t in first_token if t is not None]
        ttft = min(seen) - arrival if seen else None
        reasons = [c.generation.finish_reason for c in self.choices]
        self.trace.finished(status, reasons[0] if len(reasons) == 1 else None, self.error(),
                            self.usage().completion_tokens, ttft,
                            [h for c in self.choices for h in c.generation.stream.holders])


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class CompletionEndpoint:
    """POST /v1/chat/completions and /v1/completions."""

    def __init__(self, service: GatewayService, check_model: Callable[[str | None], None],
                 stream_response: Callable[[AsyncIterator[bytes], Callable[[], None]], StreamingResponse]) -> None:
        self.service = service
        self._check_model = check_model
        self._stream_response = stream_response

    async def handle(self, request: Request, endpoint: str, kind: RequestKind) -> Response:
        arrival = time.monotonic()
        trace = RequestTrace(kind, self.service.config.model_name, request.headers)
        route = Route.CHAT if kind is RequestKind.CHAT else Route.COMPLETION
        try:
            with trace.current():  # the scheduler's and the llumlet's spans are its children
                body = await self.service.body_workers.parse(route, await request.body(), self.service.model_limits())
                assert isinstance(body, GenerationBody)
                parsed = body.request
                prepared = await self._prepare(body, request.headers, arrival,
                                                getattr(request.state, GENERATED_ID_STATE, None))
                options = parsed.options
                first = prepared[0]
                trace.prepared(first.request_id, first.response_id, len(first.prompt_token_ids), first.max_tokens,
                               options.temperature, options.top_p, options.seed, first.priority, options.stream)
                choices = await self._submit(prepared)
        except ApiError as error:
            self.service.metrics.request_done(endpoint, error.status)
            self.service.metrics.request_rejected(endpoint, error.reason.value if error.reason else "error")
            trace.rejected(error)
            raise
        except BaseException:
            trace.span.end()
            raise
        completion = Completion(self.service, kind, endpoint, trace, choices)
        if parsed.options.stream:
            return self._stream_response(completion.events(), lambda: completion.finish(CLIENT_CLOSED))
        return await completion.respond(request)

    async def _prepare(self, body: GenerationBody, headers: Mapping[str, str],
                       arrival: float, generated_id: str | None = None) -> list[PreparedRequest]:
        parsed = body.request
        self._check_model(parsed.model)
        priority = parsed.options.priority
        if priority is None:
            header = headers.get(PRIORITY_HEADER)
            priority = 0 if header is None else parse_priority(header, "X-Corral-Priority")
        if body.prompt_refusal is not None:  # where the tokenizer would have refused it: after the model check
            raise body.prompt_refusal.error()
        prompt_ids = await self._tokenize(parsed)
        given_id = headers.get(REQUEST_ID_HEADER)
        response_id = f"{parsed.kind.id_prefix}-{given_id}" if given_id else None  # vLLM's convention
        options = parsed.options
        # With a seed, choice i samples with seed + i: the same seed n times would give n equal choices.
        per_choice = [options if options.seed is None or i == 0 else dataclasses.replace(options, seed=options.seed + i)
                      for i in range(options.n)]
        # A client's id may repeat or hold anything: the engines see ids of our own. When the id is
        # one we generated, the first choice's request is named like its response (as vLLM's are).
        own_id = response_id if generated_id is not None else None
        first = self.service.prepare(parsed.kind, prompt_ids, per_choice[0], priority, response_id, arrival,
                                     request_id=own_id)
        return [first, *(another_choice(first, o, response_id) for o in per_choice[1:])]

    async def _tokenize(self, parsed: ParsedRequest) -> list[int]:
        """(A text that cannot fit by its size was refused by body_parsing before it came here.)"""
        tokenizer = self.service.tokenizer
        if isinstance(parsed.prompt, list):
            return parsed.prompt
        try:
            if parsed.kind is RequestKind.CHAT:
                assert parsed.messages is not None
                return await tokenizer.apply_chat_template_async(parsed.messages)
            assert isinstance(parsed.prompt, str)
            return await tokenizer.encode_async(parsed.prompt)
        except PromptError as exc:
            raise bad_request(str(exc), parsed.kind.prompt_param) from None

    async def _submit(self, prepared: list[PreparedRequest]) -> list[Choice]:
        """Submit every choice; if one cannot be placed, release those that were."""
        config = self.service.config
        choices: list[Choice] = []
        try:
            for index, request in enumerate(prepared):
                stream = await self.service.submit(request)
                generation = Generation(stream, self.service.tokenizer.decode, request.prompt_token_ids,
                                        request.options, config.request_inactivity_timeout_s, request.arrival,
                                        self.service.metrics)
                choices.append(Choice(index, request, generation))
        except BaseException:
            for choice in choices:
                self.service.release(choice.generation.stream, abort=True)
            raise
        return choices
