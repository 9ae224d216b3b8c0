"""OpenAI request bodies → typed requests, with vLLM's validation rules and error conventions.

Unknown fields are ignored (as vLLM does); fields we cannot honour (best_of > 1, echo, penalties
other than repetition) are refused with a 400 that says so rather than silently dropped.
`n` > 1 is served as n requests, one per choice.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import ApiError, bad_request  # ApiError: re-exported for older importers
from shared.messages import SamplingParams
from shared.policy import HIGH_PRIORITY, NORMAL_PRIORITY

PRIORITY_NAMES = {"high": HIGH_PRIORITY, "normal": NORMAL_PRIORITY}
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_N = 128  # choices per request: each is a request of its own on some instance
MAX_LOGPROBS = 20  # top alternatives per token: vLLM's default --max-logprobs
# Bounds on what a client controls, so that no one request's parsing, chat template or stop-string
# matching costs the gateway more than milliseconds (hostile input, issue 15). Far above what
# OpenAI's API takes (4 stop strings); vLLM has no bound at all.
MAX_MESSAGES = 4096
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 4096
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what the wire (MessagePack) and vLLM's `seed` take
INT32_MAX = 2**31 - 1


class RequestKind(enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self is RequestKind.CHAT else "cmpl"

    @property
    def prompt_param(self) -> str:
        """The body field that holds the prompt (the `param` of a prompt's errors)."""
        return "messages" if self is RequestKind.CHAT else "prompt"


@dataclass(frozen=True)
class GenerationOptions:
    stream: bool = False
    n: int = 1  # choices: each runs as a request of its own
    include_usage: bool = False
    continuous_usage_stats: bool = False
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field it came from (chat: max_completion_tokens wins)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    priority: int | None = None
    logprobs: int | None = None  # top alternatives per token (0: the sampled token's only); None: off

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, ignore_eos=self.ignore_eos, min_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=list(self.stop_token_ids), repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs,
        )


@dataclass(frozen=True)
class ParsedRequest:
    kind: RequestKind
    model: str | None
    options: GenerationOptions
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str | list[int] | None = None  # completion: text or token ids


# ---------------------------------------------------------------------------------------------
# Typed field readers: a missing field or an explicit null is "not given".
# ---------------------------------------------------------------------------------------------


class _Body:
    def __init__(self, body: object) -> None:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self._body = body

    def raw(self, name: str) -> Any:
        return self._body.get(name)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self._body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"`{name}` must be a boolean", name)
        return value

    def integer(self, name: str, *, minimum: int | None = None, maximum: int = INT64_MAX) -> int | None:
        value = self._body.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"`{name}` must be an integer", name)
        if minimum is not None and value < minimum:
            raise bad_request(f"`{name}` must be at least {minimum}, got {value}", name)
        if not INT64_MIN <= value <= maximum:
            raise bad_request(f"`{name}` must be at most {maximum}, got {value}", name)
        return value

    def number(self, name: str, *, minimum: float | None = None, maximum: float | None = None,
               exclusive_minimum: bool = False) -> float | None:
        value = self._body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_request(f"`{name}` must be a number", name)
        if minimum is not None and (value < minimum or (exclusive_minimum and value == minimum)):
            bound = f"greater than {minimum}" if exclusive_minimum else f"at least {minimum}"
            raise bad_request(f"`{name}` must be {bound}, got {value}", name)
        if maximum is not None and value > maximum:
            raise bad_request(f"`{name}` must be at most {maximum}, got {value}", name)
        return float(value)

    def string(self, name: str) -> str | None:
        value = self._body.get(name)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"`{name}` must be a string", name)
        return value


def parse_priority(value: object, param: str = "priority") -> int:
    """An integer (lower runs earlier, as vLLM) or one of the names "high" and "normal"."""
    if isinstance(value, bool):
        raise bad_request(f"`{param}` must be an integer or one of {sorted(PRIORITY_NAMES)}", param)
    number: int | None = value if isinstance(value, int) else None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in PRIORITY_NAMES:
            return PRIORITY_NAMES[text]
        try:
            number = int(text)
        except ValueError:
            pass
    if number is not None:
        if not INT64_MIN <= number <= INT64_MAX:
            raise bad_request(f"`{param}` must be within [{INT64_MIN}, {INT64_MAX}], got {number}", param)
        return number
    raise bad_request(f"unknown priority {value!r}: use an integer or one of {sorted(PRIORITY_NAMES)}", param)


def _choices(body: _Body) -> int:
    n = body.integer("n", minimum=1)
    if n is not None and n > MAX_N:
        raise bad_request(f"`n` must be at most {MAX_N}, got {n}", "n")
    return n or 1


def _unsupported(body: _Body) -> None:
    if (best_of := body.integer("best_of", minimum=1)) is not None and best_of > 1:
        raise bad_request("`best_of` > 1 is not supported by Corral", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.number(name, minimum=-2.0, maximum=2.0):
            raise bad_request(f"`{name}` is not supported by Corral; use `repetition_penalty`", name)


def _unsupported_chat_features(body: _Body) -> None:
    """Tool calls and structured output change what the model must produce: ignoring them would
    answer a different question, so refuse them (tools with tool_choice "none" are harmless)."""
    tools = body.raw("tools")
    if tools and body.raw("tool_choice") != "none":
        raise bad_request("tool calling (`tools`) is not supported by Corral", "tools")
    response_format = body.raw("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise bad_request("structured output (`response_format` other than text) is not supported by Corral",
                          "response_format")


def _stop_strings(body: _Body) -> tuple[str, ...]:
    stop = body.raw("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise bad_request(f"a stop string may be at most {MAX_STOP_STRING_CHARS} characters long", "stop")
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"`stop` may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise bad_request(f"a stop string may be at most {MAX_STOP_STRING_CHARS} characters long", "stop")
        return tuple(s for s in stop if s)
    raise bad_request("`stop` must be a string or a list of strings", "stop")


def _token_id_list(value: object, name: str) -> tuple[int, ...]:
    """Token ids within int32 (vLLM's bound), checked as a whole: the list may be long."""
    if value is None:
        return ()
    if isinstance(value, list) and len(value) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"`{name}` may hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(value)}", name)
    if not isinstance(value, list) or not _ids_within(value, INT32_MAX):
        raise bad_request(f"`{name}` must be a list of token ids (integers from 0 to {INT32_MAX})", name)
    return tuple(value)


def _ids_within(values: list[Any], maximum: int) -> bool:
    return not values or (_all_ints(values) and 0 <= min(values) and max(values) <= maximum)


def _all_ints(values: list[Any]) -> bool:
    """Integers only, booleans not counted: ~3x faster than a per-item isinstance over a
    million-id prompt, which runs on the event loop."""
    return set(map(type, values)) == {int}


def _stream_flags(body: _Body) -> tuple[bool, bool, bool]:
    stream = body.boolean("stream")
    options = body.raw("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("`stream_options` must be an object", "stream_options")
    flags = _Body(options)
    return stream, flags.boolean("include_usage"), flags.boolean("continuous_usage_stats")


def _options(body: _Body, max_tokens: int | None, max_tokens_param: str = "max_tokens",
             logprobs: int | None = None) -> GenerationOptions:
    _unsupported(body)
    stream, include_usage, continuous = _stream_flags(body)
    top_k = body.integer("top_k", minimum=-1, maximum=INT32_MAX)
    min_tokens = body.integer("min_tokens", minimum=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"`min_tokens` ({min_tokens}) must not exceed `max_tokens` ({max_tokens})", "min_tokens")
    priority = body.raw("priority")
    return GenerationOptions(
        stream=stream,
        n=_choices(body),
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        temperature=_or(body.number("temperature", minimum=0.0), 1.0),
        top_p=_or(body.number("top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True), 1.0),
        top_k=max(top_k, 0) if top_k is not None else 0,  # -1 and 0 both mean "disabled"
        min_p=_or(body.number("min_p", minimum=0.0, maximum=1.0), 0.0),
        seed=body.integer("seed"),
        ignore_eos=body.boolean("ignore_eos"),
        min_tokens=min_tokens,
        stop_token_ids=_token_id_list(body.raw("stop_token_ids"), "stop_token_ids"),
        repetition_penalty=_or(body.number("repetition_penalty", minimum=0.0, exclusive_minimum=True), 1.0),
        stop=_stop_strings(body),
        include_stop_str_in_output=body.boolean("include_stop_str_in_output"),
        priority=None if priority is None else parse_priority(priority),
        logprobs=logprobs,
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


# ---------------------------------------------------------------------------------------------
# Endpoints
# ---------------------------------------------------------------------------------------------


def parse_chat_request(raw: object) -> ParsedRequest:
    body = _Body(raw)
    _unsupported_chat_features(body)
    # As vLLM: max_completion_tokens (the newer name) wins over max_tokens.
    newer, older = body.integer("max_completion_tokens", minimum=1), body.integer("max_tokens", minimum=1)
    max_tokens, param = (newer, "max_completion_tokens") if newer is not None else (older, "max_tokens")
    return ParsedRequest(
        RequestKind.CHAT, body.string("model"), _options(body, max_tokens, param, _chat_logprobs(body)),
        messages=parse_messages(body.raw("messages")),
    )


def _chat_logprobs(body: _Body) -> int | None:
    """Chat asks with `logprobs: true` and `top_logprobs: k` (which needs the former)."""
    top = body.integer("top_logprobs", minimum=0)
    if top is not None and top > MAX_LOGPROBS:
        raise bad_request(f"`top_logprobs` must be at most {MAX_LOGPROBS}, got {top}", "top_logprobs")
    if not body.boolean("logprobs"):
        if top is not None:  # as vLLM: even 0 needs logprobs
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs")
        return None
    return top or 0


def parse_completion_request(raw: object) -> ParsedRequest:
    body = _Body(raw)
    if body.boolean("echo"):
        raise bad_request("`echo` is not supported by Corral", "echo")
    if body.string("suffix"):
        raise bad_request("`suffix` is not supported by Corral", "suffix")
    logprobs = body.integer("logprobs", minimum=0)  # completions: the number of alternatives
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise bad_request(f"`logprobs` must be at most {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    options = _options(body, body.integer("max_tokens", minimum=1), logprobs=logprobs)
    return ParsedRequest(RequestKind.COMPLETION, body.string("model"), options, prompt=_prompt(body.raw("prompt")))


def parse_messages(value: object) -> list[dict[str, str]]:
    """Chat messages as the chat template takes them (text only)."""
    if value is None:
        raise bad_request("`messages` is required", "messages")
    if not isinstance(value, list) or not value:
        raise bad_request("`messages` must be a non-empty list", "messages")
    if len(value) > MAX_MESSAGES:
        raise bad_request(f"`messages` may hold at most {MAX_MESSAGES} messages, got {len(value)}", "messages")
    return [_message(m, i) for i, m in enumerate(value)]


def _message(value: object, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param)
    role = value.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:  # (a list or an object is unhashable)
        raise bad_request(f"{param}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", f"{param}.role")
    return {"role": role, "content": _content(value.get("content"), role, f"{param}.content")}


def _content(value: object, role: str, param: str) -> str:
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":  # an assistant turn that only called tools
        return ""
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}: only text parts ({{'type': 'text', 'text': ...}}) are supported", param)
            texts.append(part["text"])
        return "\n".join(texts)  # vLLM's "string" content format joins text parts with newlines
    raise bad_request(f"{param} must be a string or a list of text parts", param)


def _prompt(value: object) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad_request("`prompt` must not be empty", "prompt")
        return value
    if isinstance(value, list) and value and _all_ints(value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise bad_request("batched prompts are not supported by Corral; send one request per prompt", "prompt")
    raise bad_request("`prompt` must be a non-empty string or a non-empty list of token ids", "prompt")
