"""Errors answered as OpenAI-style JSON, and the map from typed refusals to HTTP statuses.

The statuses are what the openai SDK keys on (it maps by status alone and retries 408/409/429/5xx);
`type` holds vLLM's class-like names, `code` the status number, as vLLM's server does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from starlette.responses import JSONResponse

from shared.messages import Refusal

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

# A refusal's HTTP status: the client's fault (400, 409), load shedding (429: retry later), or
# ours (503). The metric label is the refusal's own value.
REFUSAL_STATUS: dict[Refusal, int] = {
    Refusal.TOO_LONG: 400,
    Refusal.INVALID: 400,
    Refusal.DUPLICATE: 409,
    Refusal.OVERLOADED: 429,
    Refusal.DRAINING: 503,
    Refusal.NO_INSTANCE: 503,
    Refusal.ENGINE_FAILED: 503,
}
assert set(REFUSAL_STATUS) == set(Refusal), "every refusal needs an HTTP status"

# Refusals by one instance that another instance may not repeat: the gateway tries another.
TRY_ANOTHER_INSTANCE = frozenset({Refusal.DRAINING, Refusal.ENGINE_FAILED})


class ApiError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {"message", "type", "param", "code"}}.

    `reason` is set when a request was refused before any output (the rejection metric's label)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None,
                 reason: Refusal | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        self.reason = reason

    @property
    def type(self) -> str:
        if self.status in _ERROR_TYPES:
            return _ERROR_TYPES[self.status]
        return HTTPStatus(self.status).phrase.replace(" ", "") + "Error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class _ErrorJSON(JSONResponse):
    """ASCII JSON: an error may quote the client's text, and that may hold a lone surrogate
    ("\\ud800"), which UTF-8 cannot encode (JSONResponse's render would fail with a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(error: ApiError) -> JSONResponse:
    return _ErrorJSON(error.body(), status_code=error.status, headers=error.headers)


def bad_request(message: str, param: str | None = None, reason: Refusal = Refusal.INVALID) -> ApiError:
    return ApiError(400, message, param, reason=reason)


def refusal_error(reason: Refusal, message: str, param: str | None = None,
                  retry_after_s: float | None = None) -> ApiError:
    """The HTTP error for a typed refusal; `param` names the prompt's field for TOO_LONG."""
    headers = {}
    if reason is Refusal.OVERLOADED and retry_after_s is not None and retry_after_s > 0:
        headers = {"retry-after": str(max(1, math.ceil(retry_after_s))),
                   "retry-after-ms": str(int(retry_after_s * 1000))}
    return ApiError(REFUSAL_STATUS[reason], message, param if reason is Refusal.TOO_LONG else None, headers, reason)
