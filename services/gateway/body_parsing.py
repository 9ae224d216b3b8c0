"""A POST body → the typed request of its route, or the typed refusal a client gets for it.

Pure, and the same wherever it runs: on the event loop for a small body, in a worker process
(body_workers) for a large one, where decoding a 4 MiB body of a million token ids would hold the
event loop for tens of milliseconds. So what it returns is bounded however large the body was:
a prompt that cannot fit the context is dropped here and only its refusal comes back.

A refusal that the inline handlers raised only after the model check (a prompt too long: after
the 404 for an unknown model) comes back deferred, so that the order of errors a client sees is
the same either way.
"""

from __future__ import annotations

import codecs
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.errors import ApiError, bad_request
from services.gateway.prepared import context_refusal
from services.gateway.protocol import (
    ParsedRequest, RequestKind, _all_ints, _Body, parse_chat_request, parse_completion_request, parse_messages,
)
from services.gateway.tokenizer import unfit_prompt_error
from shared.messages import Refusal


class Route(str, enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"


@dataclass(frozen=True)
class ModelLimits:
    """What the checks need to know of the model, sent with each body."""

    max_model_len: int  # GatewayService.max_model_len: may change as instances come and go
    chars_per_token: int  # ModelTokenizer.chars_per_token: text length → fewest tokens
    vocab_size: int


@dataclass(frozen=True)
class Refused:
    """An ApiError as data, so that it can cross from a worker process."""

    status: int
    message: str
    param: str | None = None
    reason: Refusal | None = None

    @classmethod
    def of(cls, error: ApiError) -> Refused:
        assert not error.headers, "a body's refusal carries no headers"
        return cls(error.status, error.message, error.param, error.reason)

    def error(self) -> ApiError:
        return ApiError(self.status, self.message, self.param, reason=self.reason)


@dataclass(frozen=True)
class GenerationBody:
    request: ParsedRequest  # its prompt or messages emptied when `prompt_refusal` is set
    prompt_refusal: Refused | None = None  # raised where the prompt would be tokenized


@dataclass(frozen=True)
class TokenizeBody:
    model: str | None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True
    return_token_strs: bool = False
    refusal: Refused | None = None  # raised after the model check


@dataclass(frozen=True)
class DetokenizeBody:
    model: str | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    refusal: Refused | None = None  # raised after the model check


ParsedBody = GenerationBody | TokenizeBody | DetokenizeBody
BODY_TYPES: dict[Route, type] = {Route.CHAT: GenerationBody, Route.COMPLETION: GenerationBody,
                                 Route.TOKENIZE: TokenizeBody, Route.DETOKENIZE: DetokenizeBody}


def decode_json(body: bytes) -> Any:
    """The body as JSON; a 400 saying why when it is not. msgspec is ~5x faster than `json` and
    refuses what is no JSON text: NaN, numbers past a double, lone surrogates ("\\ud800")."""
    try:
        return msgspec.json.decode(body.removeprefix(codecs.BOM_UTF8))
    except ValueError as exc:  # msgspec.DecodeError and UnicodeDecodeError
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested ~1,000 deep
        raise bad_request("the request body is not valid JSON: nested too deeply") from None


def parse_body(route: Route, body: bytes, limits: ModelLimits) -> ParsedBody:
    """The route's typed body. Raises ApiError for what the inline handlers refused at once."""
    raw = decode_json(body)
    if route is Route.TOKENIZE:
        return _tokenize_body(raw, limits)
    if route is Route.DETOKENIZE:
        return _detokenize_body(raw, limits.vocab_size)
    kind = RequestKind.CHAT if route is Route.CHAT else RequestKind.COMPLETION
    parsed = (parse_chat_request if kind is RequestKind.CHAT else parse_completion_request)(raw)
    refusal = _prompt_refusal(parsed, limits)
    if refusal is None:
        return GenerationBody(parsed)
    return GenerationBody(dataclasses.replace(parsed, prompt=None, messages=None), Refused.of(refusal))


def _prompt_refusal(parsed: ParsedRequest, limits: ModelLimits) -> ApiError | None:
    """What the handler would refuse the prompt for before dispatch: a text that cannot fit by
    its size (before tokenizing), or token ids (or an output budget) that do not fit, or ids
    past the vocabulary (as prepare_request, in its order and words: a worker's answer could not
    even carry an id past 64 bits)."""
    limit, param = limits.max_model_len, parsed.kind.prompt_param
    if not isinstance(parsed.prompt, list):
        return unfit_prompt_error(parsed.prompt, parsed.messages, limits.chars_per_token, limit, param)
    if (refusal := context_refusal(parsed.kind, len(parsed.prompt), parsed.options, limit)) is not None:
        return refusal
    if not (0 <= min(parsed.prompt) and max(parsed.prompt) < limits.vocab_size):
        return bad_request(f"token ids must be in [0, {limits.vocab_size})", param)
    return None


def _tokenize_body(raw: object, limits: ModelLimits) -> TokenizeBody:
    body = _Body(raw)
    model = body.string("model")
    try:
        if body.raw("messages") is not None:
            add_generation_prompt = body.boolean("add_generation_prompt", True)
            continue_final_message = body.boolean("continue_final_message")
            if add_generation_prompt and continue_final_message:
                raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
            messages = parse_messages(body.raw("messages"))
            _raise(unfit_prompt_error(None, messages, limits.chars_per_token, limits.max_model_len, "messages"))
            return TokenizeBody(model, messages=messages, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                return_token_strs=body.boolean("return_token_strs"))
        prompt = body.string("prompt")
        if prompt is None:
            raise bad_request("`prompt` (a string) or `messages` is required", "prompt")
        _raise(unfit_prompt_error(prompt, None, limits.chars_per_token, limits.max_model_len, "prompt"))
        return TokenizeBody(model, prompt=prompt, add_special_tokens=body.boolean("add_special_tokens", True),
                            return_token_strs=body.boolean("return_token_strs"))
    except ApiError as error:
        return TokenizeBody(model, refusal=Refused.of(error))


def _detokenize_body(raw: object, vocab_size: int) -> DetokenizeBody:
    body = _Body(raw)
    model = body.string("model")
    tokens = body.raw("tokens")
    if not isinstance(tokens, list) or (tokens and not _all_ints(tokens)):
        return DetokenizeBody(model, refusal=Refused.of(bad_request("`tokens` must be a list of integers", "tokens")))
    if tokens and not (0 <= min(tokens) and max(tokens) < vocab_size):
        return DetokenizeBody(model, refusal=Refused.of(bad_request(f"token ids must be in [0, {vocab_size})", "tokens")))
    return DetokenizeBody(model, tokens)


def _raise(error: ApiError | None) -> None:
    if error is not None:
        raise error
