"""Plain data shared by the dataset loaders, the runner, the metrics and the simulator."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSpec:
    """One request as a dataset describes it, before any prompt text is synthesized.

    `input_len` is the prompt length in tokens: the trace's count, or the tokenizer's count of
    `prompt` when the dataset carries text. `output_len` is None when the dataset does not say.
    """

    input_len: int
    output_len: int | None = None
    prompt: str | None = None
    timestamp_s: float | None = None  # trace arrival relative to the trace's first request
    hash_ids: tuple[int, ...] = ()  # Mooncake prefix blocks of PREFIX_BLOCK_TOKENS tokens
    source_id: str | None = None


class RequestStatus(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    REJECTED = "rejected"  # HTTP 429: the server refused it, counted apart from failures


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds since the benchmark started."""

    index: int
    input_len: int  # client-side tokenizer count of the prompt
    max_tokens: int
    priority: int | None = None
    send_s: float = 0.0  # just before the HTTP request was sent
    chunk_s: list[float] = field(default_factory=list)  # arrival of every content chunk
    end_s: float = 0.0  # stream closed or error seen
    text: str = ""
    prompt_tokens: int | None = None  # server's usage.prompt_tokens (chat template included)
    completion_tokens: int | None = None  # server's usage.completion_tokens
    status: RequestStatus = RequestStatus.FAILED
    error: str | None = None
    http_status: int | None = None

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.OK

    @property
    def prompt_len(self) -> int:
        """The server's count when it reported one (as vllm bench serve does), else ours."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.input_len

    @property
    def output_tokens(self) -> int:
        """The server's usage when given, else the number of content chunks."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_s)

    @property
    def ttft_s(self) -> float:
        assert self.chunk_s, "TTFT of a request without content chunks"
        return self.chunk_s[0] - self.send_s

    @property
    def e2el_s(self) -> float:
        assert self.chunk_s, "E2EL of a request without content chunks"
        return self.chunk_s[-1] - self.send_s

    @property
    def itls_s(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None for a single-token output."""
        tokens = self.output_tokens
        if tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (tokens - 1)
