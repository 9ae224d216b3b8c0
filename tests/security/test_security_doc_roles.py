"""SECURITY.md's table of NATS rights says what `shared.nats_auth.ROLES` grants, subject for subject.

The table is the operator's view of the one policy nats-server enforces; this keeps it from
lagging the code (it once left out the migration notice, the KV events and the heartbeats)."""

from __future__ import annotations

from pathlib import Path

from shared.nats_auth import INBOX, ROLES

SECURITY_MD = Path(__file__).resolve().parents[2] / "SECURITY.md"


def grouped(subject_list: tuple[str, ...]) -> str:
    """`a.b.x`, `a.b.y` → `` `a.b.{x,y}` ``, in the policy's order."""
    groups: dict[str, list[str]] = {}
    for subject in subject_list:
        if subject == INBOX:
            continue
        stem, _, last = subject.rpartition(".")
        groups.setdefault(stem, []).append(last)
    parts = []
    for stem, lasts in groups.items():
        tail = lasts[0] if len(lasts) == 1 else "{" + ",".join(lasts) + "}"
        parts.append(f"`{stem}.{tail}`")
    return ", ".join(parts)


def expected_rows() -> dict[str, tuple[str, str, str]]:
    return {role: (grouped(p.publish), grouped(p.subscribe), "yes" if p.responds else "no")
            for role, p in ROLES.items()}


def documented_rows() -> dict[str, tuple[str, str, str]]:
    text = SECURITY_MD.read_text()
    table = text.split("| role | publishes |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        role = cells[0].split()[0]
        rows[role] = (cells[1], cells[2], cells[3].split()[0])
    return rows


def test_the_documented_rights_are_the_enforced_ones():
    expected = expected_rows()
    rendered = "\n".join(f"| {role} | {pub} | {sub} | {ans} |" for role, (pub, sub, ans) in expected.items())
    assert documented_rows() == expected, f"SECURITY.md's role table should read:\n{rendered}"


def test_grouping_keeps_each_subject():
    assert grouped(("corral.a.*.x", "corral.a.*.y", "corral.b", INBOX)) == "`corral.a.*.{x,y}`, `corral.b`"
