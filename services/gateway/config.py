"""Gateway configuration: one typed dataclass, filled from CLI flags, then env vars, then defaults."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared import nats_auth, subjects


class ConfigError(ValueError):
    """A configuration the gateway cannot start with; the message says what to fix."""


def _default_gateway_id() -> str:
    return f"gw-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: str
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "127.0.0.1"
    port: int = 8000
    # Name clients put in `model`; None: the model directory's basename.
    served_model_name: str | None = None
    gateway_id: str = field(default_factory=_default_gateway_id)
    dispatch_timeout_s: float = 0.5
    generate_timeout_s: float = 5.0
    instance_timeout_s: float = 3.0
    # An instance holding requests and silent this long (its load reports are a 50 ms heartbeat)
    # is dead: its requests resume elsewhere (services/gateway/resume.py).
    death_timeout_s: float = 0.8
    max_resumes: int = 2  # per request; past it, the request ends with an error
    # Send the prompt's block hashes with each dispatch request (prefix-aware dispatch).
    dispatch_prefix_hashes: bool = False
    # Streams end with an error once this gateway has been away from NATS this long.
    nats_outage_fail_s: float = 30.0
    request_inactivity_timeout_s: float = 600.0
    # max_tokens when a request gives none: vLLM's rule (the rest of the context window),
    # capped by this when set.
    default_max_tokens: int | None = None
    # Context limit for validation; None: the model's config.json (max_position_embeddings).
    max_model_len: int | None = None
    log_level: str = "info"
    # Bearer tokens accepted on /v1 routes (vLLM's --api-key); empty: no authentication. Never
    # shown in a repr, so never in a log line.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # More keys from a file, one a line ('#' comments and blank lines skipped): kept out of
    # argv and the environment, which other local users may read (ps, /proc).
    api_key_file: str | None = None
    # Bounds on what a client controls (hostile input, issue 15): a larger body is a 413 before
    # it is parsed; tokenization runs on this many threads, each with its own tokenizer.
    max_body_bytes: int = 4 * 1024 * 1024
    tokenizer_workers: int = 2
    # A body this large or larger is parsed and validated in one of `body_parse_workers` processes
    # (body_workers), not on the event loop; 0 workers: every body inline.
    body_offload_bytes: int = 64 * 1024
    body_parse_workers: int = 2
    max_streams_per_key: int | None = None  # generation requests in progress per API key (429 past it)
    # No unbounded queues (issue 14): requests past this many in flight get a 503 with
    # Retry-After; a stream whose client reads so slowly that this many engine steps' output
    # waits for it ends with an error (and the engine's copy is aborted).
    max_requests_in_flight: int = 4096
    max_buffered_chunks: int = 2048
    # CORS, as vLLM's flags: cross-origin browser access is off until origins are given.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # vLLM's flag: usage.prompt_tokens_details.cached_tokens in responses (when the engine keeps a prefix cache).
    enable_prompt_tokens_details: bool = False

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ConfigError("no model directory: pass --model DIR or set CORRAL_MODEL_DIR")
        try:
            subjects.valid_token(self.gateway_id)
        except ValueError as exc:
            raise ConfigError(f"gateway id: {exc}") from None
        if not 0 < self.port < 65536:
            raise ConfigError(f"port {self.port} is out of range")
        for name in ("dispatch_timeout_s", "generate_timeout_s", "instance_timeout_s", "request_inactivity_timeout_s",
                     "death_timeout_s", "nats_outage_fail_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_resumes < 0:
            raise ConfigError(f"max_resumes must not be negative, got {self.max_resumes}")
        if self.api_key_file is not None:
            object.__setattr__(self, "api_keys", self.api_keys + _keys_from_file(self.api_key_file))
            object.__setattr__(self, "api_key_file", None)  # read once: a replace() must not add them twice
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ConfigError("an API key is empty or has surrounding spaces")
        for name in ("max_body_bytes", "tokenizer_workers", "max_requests_in_flight", "max_buffered_chunks",
                     "body_offload_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.body_parse_workers < 0:
            raise ConfigError(f"body_parse_workers must not be negative, got {self.body_parse_workers}")
        if self.max_streams_per_key is not None and not self.api_keys:
            raise ConfigError("max_streams_per_key needs API keys (--api-key or --api-key-file)")
        for name in ("default_max_tokens", "max_model_len", "max_streams_per_key"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir.rstrip("/")).name


def _keys_from_file(path: str) -> tuple[str, ...]:
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the API key file {path!r}: {type(exc).__name__}") from None
    keys = tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ConfigError(f"the API key file {path!r} holds no key")
    return keys


def _string_list(text: str) -> tuple[str, ...]:
    """A JSON list (vLLM's form: '["https://a.example"]') or comma-separated values."""
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list: {exc}") from None
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError("expected a JSON list of strings")
    else:
        values = text.split(",")
    return tuple(v.strip() for v in values if v.strip())


def _flag(text: str) -> bool:
    if text.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if text.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


# (field, flag, env var, parser, help). One table, so flags and env vars cannot drift apart.
_Option = tuple[str, str, str, Callable[[str], Any], str]
_OPTIONS: list[_Option] = [
    ("model_dir", "--model", "CORRAL_MODEL_DIR", str, "local model directory (tokenizer, chat template, config.json)"),
    ("nats_url", "--nats-url", "CORRAL_NATS_URL", str, "NATS server URL (several servers of a cluster: comma-separated)"),
    ("host", "--host", "CORRAL_GATEWAY_HOST", str, "HTTP listen address"),
    ("port", "--port", "CORRAL_GATEWAY_PORT", int, "HTTP listen port"),
    ("served_model_name", "--served-model-name", "CORRAL_SERVED_MODEL_NAME", str, "model name clients use"),
    ("gateway_id", "--gateway-id", "CORRAL_GATEWAY_ID", str, "this gateway's id (letters, digits, '_', '-')"),
    ("dispatch_timeout_s", "--dispatch-timeout-s", "CORRAL_DISPATCH_TIMEOUT_S", float,
     "wait this long for the global scheduler before dispatching locally (bypass mode)"),
    ("generate_timeout_s", "--generate-timeout-s", "CORRAL_GENERATE_TIMEOUT_S", float,
     "wait this long for a llumlet to acknowledge a request"),
    ("instance_timeout_s", "--instance-timeout-s", "CORRAL_INSTANCE_TIMEOUT_S", float,
     "an instance with no load report for this long is dead"),
    ("death_timeout_s", "--death-timeout-s", "CORRAL_DEATH_TIMEOUT_S", float,
     "an instance holding requests with no load report for this long is dead: its requests resume elsewhere"),
    ("max_resumes", "--max-resumes", "CORRAL_MAX_RESUMES", int,
     "how many times one request may resume on another instance after its instance died (0: never)"),
    ("dispatch_prefix_hashes", "--dispatch-prefix-hashes", "CORRAL_DISPATCH_PREFIX_HASHES", _flag,
     "send the prompt's KV block hashes with each dispatch request, for prefix-aware dispatch (true/false)"),
    ("nats_outage_fail_s", "--nats-outage-fail-s", "CORRAL_NATS_OUTAGE_FAIL_S", float,
     "end open streams with an error once NATS has been unreachable this long"),
    ("request_inactivity_timeout_s", "--request-inactivity-timeout-s", "CORRAL_REQUEST_INACTIVITY_TIMEOUT_S", float,
     "fail a request that receives no output for this long"),
    ("default_max_tokens", "--default-max-tokens", "CORRAL_DEFAULT_MAX_TOKENS", int,
     "cap on max_tokens when a request gives none (default: the rest of the context)"),
    ("max_model_len", "--max-model-len", "CORRAL_MAX_MODEL_LEN", int,
     "context limit (default: the model's config.json)"),
    ("log_level", "--log-level", "CORRAL_LOG_LEVEL", str, "logging level"),
    ("api_keys", "--api-key", "CORRAL_API_KEY", _string_list,
     "API key(s) required as `Authorization: Bearer KEY` on /v1 routes; repeat the flag or separate by commas"),
    ("api_key_file", "--api-key-file", "CORRAL_API_KEY_FILE", str,
     "a file of API keys, one a line ('#' comments allowed), added to --api-key's"),
    ("max_body_bytes", "--max-body-bytes", "CORRAL_MAX_BODY_BYTES", int,
     "largest request body accepted (larger: 413, before parsing)"),
    ("max_requests_in_flight", "--max-requests-in-flight", "CORRAL_MAX_REQUESTS_IN_FLIGHT", int,
     "requests (choices) this gateway serves at once; past it: 503 with Retry-After"),
    ("max_buffered_chunks", "--max-buffered-chunks", "CORRAL_MAX_BUFFERED_CHUNKS", int,
     "engine steps' output held for one slow client; past it the stream ends with an error"),
    ("tokenizer_workers", "--tokenizer-workers", "CORRAL_TOKENIZER_WORKERS", int,
     "threads that tokenize prompts (each holds a copy of the tokenizer)"),
    ("body_offload_bytes", "--body-offload-bytes", "CORRAL_BODY_OFFLOAD_BYTES", int,
     "request bodies this large or larger are parsed in a worker process, off the event loop"),
    ("body_parse_workers", "--body-parse-workers", "CORRAL_BODY_PARSE_WORKERS", int,
     "processes that parse large request bodies (0: parse every body on the event loop)"),
    ("max_streams_per_key", "--max-streams-per-key", "CORRAL_MAX_STREAMS_PER_KEY", int,
     "generation requests one API key may have in progress (more: 429 with Retry-After)"),
    ("allowed_origins", "--allowed-origins", "CORRAL_ALLOWED_ORIGINS", _string_list,
     "CORS origins allowed (JSON list or comma-separated; '*' for any)"),
    ("allowed_methods", "--allowed-methods", "CORRAL_ALLOWED_METHODS", _string_list, "CORS methods allowed"),
    ("allowed_headers", "--allowed-headers", "CORRAL_ALLOWED_HEADERS", _string_list, "CORS headers allowed"),
    ("allow_credentials", "--allow-credentials", "CORRAL_ALLOW_CREDENTIALS", _flag, "CORS: allow credentials"),
    ("enable_prompt_tokens_details", "--enable-prompt-tokens-details", "CORRAL_ENABLE_PROMPT_TOKENS_DETAILS", _flag,
     "report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix cache), as vLLM's flag"),
]
_REPEATABLE = {"api_keys"}  # a repeated flag adds to the list
_SWITCHES = {"allow_credentials", "enable_prompt_tokens_details"}  # flags without a value, as vLLM's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for `corral gateway`; unset flags fall back to env vars, then to the defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    nats_auth.add_arguments(parser)  # --nats-creds, --nats-tls-*: read by every NATS connection
    for name, flag, env, parse, help_text in _OPTIONS:
        default = defaults.get(name)
        shown = "" if default in (None, dataclasses.MISSING, ()) or name in _REPEATABLE else f"; default {default}"
        if name in _SWITCHES:
            parser.add_argument(flag, dest=f"gateway_{name}", action="store_const", const=True, default=None,
                                help=f"{help_text} (env {env})")
            continue
        parser.add_argument(flag, dest=f"gateway_{name}", metavar=name.upper(), type=parse, default=None,
                            action="append" if name in _REPEATABLE else "store", help=f"{help_text} (env {env}{shown})")


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> GatewayConfig:
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, _flag, env_name, parse, _help in _OPTIONS:
        value = getattr(args, f"gateway_{name}", None)
        if name in _REPEATABLE and value is not None:
            value = tuple(item for chunk in value for item in chunk)  # each flag may hold several
        if value is None and env.get(env_name):
            try:
                value = parse(env[env_name])
            except ValueError:
                raise ConfigError(f"{env_name}={env[env_name]!r} is not a valid {parse.__name__}") from None
        if value is not None:
            values[name] = value
    values.setdefault("model_dir", "")
    return GatewayConfig(**values)


def config_from_env(env: Mapping[str, str] | None = None) -> GatewayConfig:
    return config_from_args(argparse.Namespace(), env)
