"""Dataset SPECs and their loaders: upstream trace formats in, list[RequestSpec] out.

SPEC syntax (also in `loadgen run --help`):
  sharegpt:PATH        ShareGPT JSON (first human turn = prompt, the gpt reply's length = output
                       length when present) or vidur's ShareGPT length CSV
                       (num_prefill_tokens,num_decode_tokens)
  burstgpt:PATH        BurstGPT CSV (Timestamp, Request tokens, Response tokens); failed rows
                       (Response tokens == 0) are dropped
  mooncake:PATH        Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)
  azure:PATH           Azure LLM inference trace 2023 CSV (TIMESTAMP,ContextTokens,GeneratedTokens)
  synthetic:IN-OUT     Table 1 length distributions, IN and OUT among S, M, L, sharegpt, burstgpt
                       (`synthetic:S-L`; a single name means the same for both: `synthetic:sharegpt`)
  random:IN:OUT        fixed lengths: every prompt IN tokens, every output OUT tokens
  conversation:long    seeded long-prompt multi-turn chat: each turn re-sends the conversation
                       so far (prompts grow past 8k), session arrival times (loadgen/conversation.py)
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.conversation import PROFILES, generate_conversations
from loadgen.errors import LoadgenError
from loadgen.lengths import DISTRIBUTION_NAMES, distribution
from loadgen.records import RequestSpec

PREFIX_BLOCK_TOKENS = 512  # Mooncake's hash_ids block size
DEFAULT_GENERATED_REQUESTS = 1000  # synthetic/random when no count is given (vllm's default)
_CHARS_PER_TOKEN_ESTIMATE = 4  # ShareGPT text without a tokenizer: a rough count for simulation

FILE_KINDS = ("sharegpt", "burstgpt", "mooncake", "azure")
GENERATED_KINDS = ("synthetic", "random", "conversation")
SPEC_HELP = __doc__.split("SPEC syntax (also in `loadgen run --help`):\n", 1)[1]


@dataclass(frozen=True)
class DatasetSpec:
    kind: str
    path: Path | None = None
    input_dist: str | None = None  # synthetic (conversation: the profile)
    output_dist: str | None = None
    fixed_input: int | None = None  # random
    fixed_output: int | None = None

    @property
    def has_timestamps(self) -> bool:
        return self.kind in ("burstgpt", "mooncake", "azure", "conversation")


def parse_dataset_spec(text: str) -> DatasetSpec:
    kind, sep, rest = text.partition(":")
    kind = kind.strip().lower()
    if not sep or not rest:
        raise LoadgenError(f"dataset spec {text!r} is not KIND:ARGS; kinds: {_kinds()}")
    if kind in FILE_KINDS:
        return DatasetSpec(kind, path=Path(rest).expanduser())
    if kind == "synthetic":
        return _parse_synthetic(text, rest)
    if kind == "random":
        return _parse_random(text, rest)
    if kind == "conversation":
        if rest.strip().lower() not in PROFILES:
            raise LoadgenError(f"bad conversation spec {text!r}: profiles: {', '.join(PROFILES)}")
        return DatasetSpec("conversation", input_dist=rest.strip().lower())
    raise LoadgenError(f"unknown dataset kind {kind!r} in {text!r}; kinds: {_kinds()}")


def _kinds() -> str:
    return ", ".join(FILE_KINDS + GENERATED_KINDS)


def _parse_synthetic(text: str, rest: str) -> DatasetSpec:
    names = rest.split("-")
    if len(names) == 1:
        names = names * 2
    valid = {name.lower(): name for name in DISTRIBUTION_NAMES}
    if len(names) != 2 or any(name.lower() not in valid for name in names):
        raise LoadgenError(
            f"bad synthetic spec {text!r}: expected synthetic:IN-OUT with IN and OUT among "
            f"{', '.join(DISTRIBUTION_NAMES)}"
        )
    return DatasetSpec("synthetic", input_dist=names[0].lower(), output_dist=names[1].lower())


def _parse_random(text: str, rest: str) -> DatasetSpec:
    parts = rest.split(":")
    try:
        lengths = [int(part) for part in parts]
    except ValueError:
        lengths = []
    if len(lengths) != 2 or min(lengths) < 1:
        raise LoadgenError(f"bad random spec {text!r}: expected random:IN:OUT with positive integers")
    return DatasetSpec("random", fixed_input=lengths[0], fixed_output=lengths[1])


def load_dataset(
    spec: str | DatasetSpec,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    tokenizer: Any = None,
) -> list[RequestSpec]:
    """The requests of a dataset, reproducible from the seed.

    File datasets keep their file order (timestamped traces) or are shuffled by the seed
    (ShareGPT, as vllm does); `num_requests` takes the first N, cycling the file when N is larger
    (timestamps of later cycles are shifted past the trace's end). Generated datasets draw N
    requests (default 1000). `tokenizer` (optional) counts tokens of ShareGPT text; without one
    the dataset's own counts, or a rough estimate, are used.
    """
    if isinstance(spec, str):
        spec = parse_dataset_spec(spec)
    if num_requests is not None and num_requests < 1:
        raise LoadgenError(f"number of requests must be >= 1, got {num_requests}")
    if spec.kind in GENERATED_KINDS:
        return _generate(spec, num_requests or DEFAULT_GENERATED_REQUESTS, seed)
    records = _read_file(spec, tokenizer)
    if not records:
        raise LoadgenError(f"dataset {spec.path} holds no usable request")
    if spec.kind == "sharegpt":
        random.Random(seed).shuffle(records)
    return _cycle(records, num_requests or len(records))


def _generate(spec: DatasetSpec, n: int, seed: int) -> list[RequestSpec]:
    if spec.kind == "conversation":
        return generate_conversations(PROFILES[spec.input_dist], n, seed)
    if spec.kind == "random":
        assert spec.fixed_input and spec.fixed_output
        return [RequestSpec(spec.fixed_input, spec.fixed_output) for _ in range(n)]
    # One stream per side, so the first N requests of a larger draw are the same N requests.
    inputs = distribution(spec.input_dist, "in").sample(np.random.default_rng([seed, 0]), n)
    outputs = distribution(spec.output_dist, "out").sample(np.random.default_rng([seed, 1]), n)
    return [RequestSpec(int(i), int(o)) for i, o in zip(inputs, outputs)]


def _cycle(records: list[RequestSpec], n: int) -> list[RequestSpec]:
    if n <= len(records):
        return records[:n]
    stamps = [r.timestamp_s for r in records if r.timestamp_s is not None]
    # Each further cycle starts one mean gap after the previous cycle's last request.
    period = (max(stamps) - min(stamps)) * len(stamps) / max(len(stamps) - 1, 1) if stamps else 0.0
    out = []
    for i in range(n):
        record = records[i % len(records)]
        shift = period * (i // len(records))
        if record.timestamp_s is not None and shift:
            record = replace(record, timestamp_s=record.timestamp_s + shift)
        out.append(record)
    return out


def check_dataset_readable(spec: DatasetSpec) -> None:
    """Fail fast on a dataset file that is not there (before any slow work starts)."""
    if spec.path is None:
        return
    if not spec.path.exists():
        raise LoadgenError(f"cannot read dataset file {spec.path}: no such file")
    if not spec.path.is_file():
        raise LoadgenError(f"cannot read dataset file {spec.path}: not a regular file")


def _read_file(spec: DatasetSpec, tokenizer: Any) -> list[RequestSpec]:
    path = spec.path
    assert path is not None
    check_dataset_readable(spec)
    readers: dict[str, Callable[[Path], list[RequestSpec]]] = {
        "sharegpt": lambda p: _read_sharegpt(p, tokenizer),
        "burstgpt": _read_burstgpt,
        "mooncake": _read_mooncake,
        "azure": _read_azure,
    }
    try:
        return readers[spec.kind](path)
    except OSError as exc:
        raise LoadgenError(f"cannot read dataset file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise LoadgenError(f"cannot read dataset file {path}: not UTF-8 text") from None
    except csv.Error as exc:
        raise LoadgenError(f"cannot read dataset file {path}: {exc}") from None


# --- ShareGPT -------------------------------------------------------------------------------

_HUMAN_ROLES = ("human", "user")
_REPLY_ROLES = ("gpt", "chatgpt", "assistant", "bard", "bing")


def _read_sharegpt(path: Path, tokenizer: Any) -> list[RequestSpec]:
    if path.suffix.lower() == ".csv":
        return _read_sharegpt_lengths_csv(path)
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise LoadgenError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(items, list):
        raise LoadgenError(f"{path}: a ShareGPT file is a JSON array of conversations")
    kept = [(item, *_first_exchange(item)) for item in items if isinstance(item, dict)]
    kept = [(item, prompt, reply) for item, prompt, reply in kept if isinstance(prompt, str) and prompt]
    replies = [reply if isinstance(reply, str) else "" for _, _, reply in kept]
    input_lens = _counts([p for _, p, _ in kept], tokenizer, [i.get("prompt_tokens") for i, _, _ in kept])
    output_lens = _counts(replies, tokenizer, [i.get("response_tokens") for i, _, _ in kept])
    records = []
    for (item, prompt, _), reply, input_len, output_len in zip(kept, replies, input_lens, output_lens):
        source = item.get("id") or item.get("conversation_id")
        output = output_len if reply else None
        records.append(RequestSpec(input_len, output, prompt=prompt, source_id=source and str(source)))
    return records


def _first_exchange(item: dict) -> tuple[str | None, str | None]:
    """The first human turn and the reply right after it (None when there is none)."""
    turns = item.get("conversations") or item.get("conversation") or []
    for position, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from", turn.get("role")) in _HUMAN_ROLES:
            following = turns[position + 1] if position + 1 < len(turns) else {}
            if not isinstance(following, dict):
                following = {}
            is_reply = following.get("from", following.get("role")) in _REPLY_ROLES
            reply = following.get("value", following.get("content")) if is_reply else None
            return turn.get("value", turn.get("content")), reply
    return item.get("prompt"), item.get("response")


def _counts(texts: list[str], tokenizer: Any, recorded: list[Any]) -> list[int]:
    """Token counts: the tokenizer's (one batch call) if given, else the file's, else an estimate."""
    if tokenizer is not None and texts:
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [max(1, len(ids)) for ids in encoded]
    def estimate(text: str) -> int:
        return max(1, math.ceil(len(text) / _CHARS_PER_TOKEN_ESTIMATE))

    return [c if isinstance(c, int) and c > 0 else estimate(t) for t, c in zip(texts, recorded)]


def _read_sharegpt_lengths_csv(path: Path) -> list[RequestSpec]:
    records = []
    for line, row in _csv_rows(path, ("num_prefill_tokens", "num_decode_tokens")):
        inputs = _int(row, "num_prefill_tokens", path, line)
        outputs = _int(row, "num_decode_tokens", path, line)
        if inputs > 0 and outputs > 0:
            records.append(RequestSpec(inputs, outputs, source_id=f"line{line}"))
    return records


# --- CSV traces -----------------------------------------------------------------------------


def _csv_rows(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise LoadgenError(f"{path}: missing CSV column(s) {', '.join(missing)}")
        return [(number, row) for number, row in enumerate(reader, start=2)]


def _int(row: dict[str, str], column: str, path: Path, line: int) -> int:
    try:
        return int(float(row[column]))
    except (TypeError, ValueError):
        raise LoadgenError(f"{path}:{line}: column {column!r} is not a number: {row[column]!r}") from None


def _read_burstgpt(path: Path) -> list[RequestSpec]:
    columns = ("Timestamp", "Request tokens", "Response tokens")
    records = []
    for line, row in _csv_rows(path, columns):
        inputs, outputs = _int(row, "Request tokens", path, line), _int(row, "Response tokens", path, line)
        if outputs <= 0 or inputs <= 0:  # a failed request in the trace
            continue
        stamp = float(_int(row, "Timestamp", path, line))
        records.append(RequestSpec(inputs, outputs, timestamp_s=stamp, source_id=f"line{line}"))
    return _relative_to_first(records)


def _read_azure(path: Path) -> list[RequestSpec]:
    records = []
    for line, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        inputs, outputs = _int(row, "ContextTokens", path, line), _int(row, "GeneratedTokens", path, line)
        if inputs <= 0 or outputs <= 0:
            continue
        stamp = _azure_time(row["TIMESTAMP"], path, line)
        records.append(RequestSpec(inputs, outputs, timestamp_s=stamp, source_id=f"line{line}"))
    return _relative_to_first(records)


def _azure_time(text: str, path: Path, line: int) -> float:
    """'2023-11-16 18:17:03.9799600' (7 fraction digits, more than datetime parses) → epoch s."""
    whole, _, fraction = text.strip().partition(".")
    try:
        moment = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
        return moment.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)
    except ValueError:
        raise LoadgenError(f"{path}:{line}: bad TIMESTAMP {text!r}") from None


def _relative_to_first(records: list[RequestSpec]) -> list[RequestSpec]:
    if not records:
        return records
    first = min(r.timestamp_s for r in records if r.timestamp_s is not None)
    return [replace(r, timestamp_s=r.timestamp_s - first) for r in records]


# --- Mooncake -------------------------------------------------------------------------------


def _read_mooncake(path: Path) -> list[RequestSpec]:
    records = []
    with path.open(encoding="utf-8") as handle:
        for line, text in enumerate(handle, start=1):
            if text.strip():
                records.append(_mooncake_record(text, path, line))
    return _relative_to_first([r for r in records if r.input_len > 0 and (r.output_len or 0) > 0])


def _mooncake_record(text: str, path: Path, line: int) -> RequestSpec:
    try:
        item = json.loads(text)
        hash_ids = tuple(int(h) for h in item.get("hash_ids", ()))
        return RequestSpec(
            int(item["input_length"]),
            int(item["output_length"]),
            timestamp_s=float(item["timestamp"]) / 1000.0,
            hash_ids=hash_ids,
            source_id=f"line{line}",
        )
    except json.JSONDecodeError as exc:
        raise LoadgenError(f"{path}:{line}: not JSON ({exc.msg})") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise LoadgenError(f"{path}:{line}: bad Mooncake record ({exc!r})") from None
