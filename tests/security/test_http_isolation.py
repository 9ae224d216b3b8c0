"""One client's huge request does not hold up another's (issue 15, point 6): a 10 MB body, a
prompt too long to fit, a million token ids, a long prompt tokenized for real and a 4,096-message
chat, each beside a small probe request on a real gateway process (benchmarks/http_isolation.py
measures the same, with more probes). The probe's bounds are generous for a shared 2-core
machine, where other load makes tens of ms of noise; the event loop's own CPU time in one stall
(benchmarks/loop_stalls.py) is not inflated by that load, and is held to a few ms for the bodies
that body_workers parses off the loop. Measured side by side (`--parse-workers 0,2`, this 2-core
VM): on the loop, one stall of 45-220 ms CPU; off it, 4-10 ms (the /detokenize one closest to 10,
and a CI run saw 10.9). The bound sits between, nearer the off-the-loop side."""

from __future__ import annotations

import pytest

from benchmarks.http_isolation import run

EXPECTED_STATUS = {
    "10 MB body, Content-Length (413)": 413,
    "10 MB body, chunked (413 while read)": 413,
    "7 MB prompt (400: cannot fit, before tokenizing)": 400,
    "2 MB prompt to /tokenize (400: cannot fit)": 400,
    "~56k-token prompt tokenized (/tokenize)": 200,
    "4,096 short messages (template, tokenizer, 503)": 503,  # (no instance behind this gateway)
    "200k stop strings (400)": 400,
    "1.2M token ids as prompt (400)": 400,
    "1.2M ids in an unknown field (503)": 503,
    "1.2M token ids to /detokenize (400: out of vocab)": 400,
}
# Parsed in a worker process: the event loop's CPU time in one stall beside them, at most (ms).
OFF_THE_LOOP = {name: 25.0 for name in EXPECTED_STATUS if name.startswith("1.2M")}


@pytest.fixture(scope="module")
def rows():
    return {row["scenario"]: row for row in run(probes=15, names=list(EXPECTED_STATUS))}


@pytest.mark.parametrize("scenario", list(EXPECTED_STATUS))
def test_a_huge_request_beside_a_probe(rows, scenario):
    row = rows[scenario]
    assert row["status"] == EXPECTED_STATUS[scenario], row
    alone, beside = row["baseline"], row["beside"]
    print(f"{scenario}: probe alone p50 {alone['p50_ms']:.1f} max {alone['max_ms']:.1f} ms; "
          f"beside p50 {beside['p50_ms']:.1f} max {beside['max_ms']:.1f} ms; loop stall beside: "
          f"{row['loop_stalls_beside']['max_wall_ms']:.1f} ms, {row['loop_stalls_beside']['max_cpu_ms']:.1f} ms CPU")
    assert beside["p50_ms"] <= alone["p50_ms"] + 20, row
    assert beside["max_ms"] <= alone["max_ms"] + 150, row
    if scenario in OFF_THE_LOOP:
        assert row["loop_stalls_beside"]["max_cpu_ms"] <= OFF_THE_LOOP[scenario], row
