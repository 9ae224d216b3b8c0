"""Failed and rejected requests summarized so that every one is counted.

Error messages often carry request ids, instance ids or numbers, so 200 failures of one cause
can be 200 different strings; a top-10 of raw strings then covers a handful of them. Messages are
grouped by their shape (ids and numbers masked, the HTTP status kept), and the summary says how
many failures there were in all, whether messages were grouped, and how many groups it leaves out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

SHOWN_GROUPS = 10
EXAMPLE_CHARS = 100  # an example beside its (already full) shape
_HTTP_STATUS = re.compile(r"^HTTP \d{3}:?")
# Longest first: a UUID before a hex run before a plain number.
_MASKS = (
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"), "<id>"),
    (re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"), "<id>"),
    (re.compile(r"(?<![A-Za-z0-9.])\d+(?:\.\d+)?"), "<n>"),  # not the digits of a name (gpt4)
)


@dataclass(frozen=True)
class FailureGroup:
    shape: str  # the message with ids and numbers masked
    count: int  # failed requests in the group
    distinct: int  # different messages merged into it
    example: str  # its most frequent message


def message_shape(message: str) -> str:
    """'HTTP 503: instance 3fa2c9d1e0 gone after 12.5 s' → 'HTTP 503: instance <id> gone after <n> s'."""
    status = _HTTP_STATUS.match(message)
    head, rest = (status.group(0), message[status.end():]) if status else ("", message)
    for pattern, placeholder in _MASKS:
        rest = pattern.sub(placeholder, rest)
    return head + rest


def group_failures(counts: Mapping[str, int]) -> list[FailureGroup]:
    """Messages (with their request counts) grouped by shape, largest group first."""
    members: dict[str, dict[str, int]] = {}
    for message, count in counts.items():
        members.setdefault(message_shape(message), {})[message] = count
    groups = [
        FailureGroup(shape, sum(by_message.values()), len(by_message), max(by_message, key=by_message.__getitem__))
        for shape, by_message in members.items()
    ]
    return sorted(groups, key=lambda g: (-g.count, g.shape))


def failure_lines(counts: Mapping[str, int], shown: int = SHOWN_GROUPS) -> list[str]:
    """The summary's error section: a total, then the largest groups, then what was left out."""
    if not counts:
        return []
    total = sum(counts.values())
    groups = group_failures(counts)
    lines = [f"{total} request{'s' if total != 1 else ''} did not complete, {len(counts)} distinct message(s)"]
    if len(groups) < len(counts):
        lines.append(f"grouped into {len(groups)} kind(s): ids shown as <id>, numbers as <n>")
    for group in groups[:shown]:
        if group.distinct == 1:
            lines.append(f"{group.count:>6} x {group.example}")
        else:
            lines.append(f"{group.count:>6} x {group.shape}  ({group.distinct} messages, e.g. {_clip(group.example)})")
    hidden = groups[shown:]
    if hidden:
        left = sum(g.count for g in hidden)
        lines.append(f"... {len(hidden)} more kind(s) covering {left} request(s) not shown "
                     "(every message is in the result file's errors_summary)")
    return lines


def _clip(message: str, limit: int = EXAMPLE_CHARS) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "…"
