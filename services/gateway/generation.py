"""One request's output as text: ordered token deliveries → detokenized text → stop strings."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.errors import ApiError
from services.gateway.protocol import GenerationOptions
from services.gateway.responses import Usage
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.streams import Delivery, OutputStream
from shared.messages import FinishReason, TokenLogprob


# An output token with its log probabilities (None: the instance sent none for it, see TokenChunk).
TokenWithLogprob = tuple[int, TokenLogprob | None]


@dataclass(frozen=True)
class TextEvent:
    text: str
    finish_reason: str | None = None  # set on the last event of a successful request
    error: ApiError | None = None  # set on the last event of a failed one
    logprobs: list[TokenWithLogprob] | None = None  # the tokens since the last event, if asked for


class TokenTimes(Protocol):
    """Told as tokens arrive, with the instance that holds the request then (the gateway's
    metrics: vLLM observes time to first token and inter-token latency as they happen)."""

    def first_token(self, engine: str, ttft_s: float) -> None: ...

    def next_tokens(self, engine: str, gap_s: float) -> None: ...

    def ttft_predicted(self, predicted_s: float, measured_s: float) -> None: ...


class Generation:
    def __init__(self, stream: OutputStream, decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int],
                 options: GenerationOptions, inactivity_timeout_s: float, arrival: float,
                 token_times: TokenTimes | None = None) -> None:
        self.stream = stream
        self._detok = IncrementalDetokenizer(decode, prompt_token_ids)
        self._stops = StopStringMatcher(options.stop, options.include_stop_str_in_output)
        self._token_by_token = bool(options.stop)  # count exactly the tokens up to a stop string
        self._timeout_s = inactivity_timeout_s
        self.arrival = arrival
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._token_times = token_times
        self.finish_reason: str | None = None
        self.error: ApiError | None = None
        self._logprobs: list[TokenWithLogprob] | None = [] if options.logprobs is not None else None

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_output_tokens)

    async def events(self) -> AsyncIterator[TextEvent]:
        """Text as it becomes final; the last event carries the finish reason or the error."""
        while not self.ended:
            try:
                delivery = await self.stream.next(self._timeout_s)
            except TimeoutError:
                self.error = ApiError(504, f"no output from the instance for {self._timeout_s:g} s")
                yield TextEvent("", error=self.error)
                return
            text = self._absorb(delivery)
            if self._stops.stopped:
                self.finish_reason = "stop"
            elif delivery.error is not None:
                self.error = ApiError(delivery.error_code, delivery.error)
            elif delivery.finish_reason is FinishReason.ERROR:
                self.error = ApiError(500, "the engine failed the request")
            elif delivery.finish_reason is not None:
                text += self._stops.append(self._detok.flush())
                self.finish_reason = "stop" if self._stops.stopped else delivery.finish_reason.value
                text += self._stops.finish()
            if text or self.ended or self._logprobs:
                yield TextEvent(text, self.finish_reason, self.error, self._take_logprobs())

    def _take_logprobs(self) -> list[TokenWithLogprob] | None:
        if self._logprobs is None:
            return None
        taken, self._logprobs = self._logprobs, []
        return taken

    def _absorb(self, delivery: Delivery) -> str:
        token_ids = delivery.token_ids
        text, used = self._absorb_tokens(token_ids)
        if self._logprobs is not None:
            logprobs: list[TokenLogprob | None] = list(delivery.logprobs or [])
            logprobs += [None] * (used - len(logprobs))  # none sent (a handover's repeat), or too few
            self._logprobs += list(zip(token_ids[:used], logprobs[:used]))
        return text

    def _clock_tokens(self, now: float) -> None:
        times, holders = self._token_times, self.stream.holders
        if self.first_token_at is None:
            self.first_token_at = now
            if times is not None and holders:
                times.first_token(holders[-1], now - self.arrival)
            if times is not None and self.stream.predicted_ttft_s is not None:
                times.ttft_predicted(self.stream.predicted_ttft_s, now - self.arrival)
        elif times is not None and holders:
            times.next_tokens(holders[-1], now - self.last_token_at)
        self.last_token_at = now

    def _absorb_tokens(self, token_ids: list[int]) -> tuple[str, int]:
        """The text the tokens make (up to a stop string), and how many of them that took."""
        if token_ids:
            self._clock_tokens(time.monotonic())
        if not self._token_by_token:
            self.num_output_tokens += len(token_ids)
            return self._stops.append(self._detok.push(token_ids)), len(token_ids)
        text = ""
        for used, token_id in enumerate(token_ids, start=1):
            self.num_output_tokens += 1
            text += self._stops.append(self._detok.push([token_id]))
            if self._stops.stopped:
                return text, used
        return text, len(token_ids)
