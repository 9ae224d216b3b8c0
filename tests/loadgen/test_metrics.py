"""Metrics against hand-computed values (BENCHMARKS.md definitions)."""

from __future__ import annotations

import pytest

from loadgen.metrics import compute_metrics, parse_goodput, peak_in_flight
from loadgen.records import RequestRecord, RequestStatus


def _ok(index: int, send: float, chunks: list[float], end: float, **usage) -> RequestRecord:
    return RequestRecord(index, input_len=10, max_tokens=8, send_s=send, chunk_s=chunks, end_s=end,
                         status=RequestStatus.OK, **usage)


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        # 3 chunks, no usage: out 3, TTFT .1, E2EL .25, ITL .05 .1, TPOT .075
        _ok(0, 0.0, [0.1, 0.15, 0.25], 0.26),
        # server usage: out 5, prompt 12; TTFT .2, E2EL .3, ITL .1, TPOT .1/4 = .025
        _ok(1, 0.5, [0.7, 0.8], 0.81, completion_tokens=5, prompt_tokens=12),
        # a single token: TTFT = E2EL = .4, no TPOT
        _ok(2, 1.0, [1.4], 1.41),
        RequestRecord(3, 10, 8, send_s=0.2, end_s=0.9, status=RequestStatus.FAILED, error="boom"),
        RequestRecord(4, 10, 8, send_s=0.55, end_s=0.56, status=RequestStatus.REJECTED,
                      error="HTTP 429: slow down"),
    ]


def test_counts_and_throughputs(records) -> None:
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed, m.rejected) == (3, 1, 1)
    assert m.total_input_tokens == 10 + 12 + 10  # the server's prompt count wins when given
    assert m.total_output_tokens == 3 + 5 + 1
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(20.5)
    assert m.request_goodput is None
    assert m.errors == {"boom": 1, "HTTP 429: slow down": 1}


def test_ttft(records) -> None:
    ttft = compute_metrics(records, 2.0).ttft
    assert ttft.mean_ms == pytest.approx(700 / 3)
    assert ttft.median_ms == pytest.approx(200)
    assert ttft.std_ms == pytest.approx(124.7219, abs=1e-3)
    assert ttft.percentiles_ms == pytest.approx({50.0: 200, 90.0: 360, 99.0: 396})


def test_tpot_excludes_single_token_outputs(records) -> None:
    tpot = compute_metrics(records, 2.0).tpot
    assert tpot.count == 2
    assert (tpot.mean_ms, tpot.median_ms, tpot.std_ms) == pytest.approx((50, 50, 25))
    assert tpot.percentiles_ms[90.0] == pytest.approx(70)


def test_itl_pools_all_gaps(records) -> None:
    itl = compute_metrics(records, 2.0).itl
    assert itl.count == 3
    assert itl.mean_ms == pytest.approx(250 / 3)
    assert itl.median_ms == pytest.approx(100)
    assert itl.std_ms == pytest.approx(23.5702, abs=1e-3)


def test_e2el(records) -> None:
    e2el = compute_metrics(records, 2.0).e2el
    assert e2el.mean_ms == pytest.approx(950 / 3)
    assert e2el.median_ms == pytest.approx(300)
    assert e2el.percentiles_ms[99.0] == pytest.approx(398)


def test_prefill_decode_split_follows_ttft_and_tpot(records) -> None:
    m = compute_metrics(records, 2.0)
    assert m.prefill == m.ttft
    assert m.decode.mean_ms == pytest.approx(50)


def test_goodput_counts_requests_meeting_every_slo(records) -> None:
    # request 0 misses TPOT (75 > 60), request 2 misses TTFT (400 > 250): only request 1 is good
    assert compute_metrics(records, 2.0, goodput_ms={"ttft": 250, "tpot": 60}).request_goodput == 0.5
    # a single-token output has TPOT 0 for goodput, as in vllm
    assert compute_metrics(records, 2.0, goodput_ms={"tpot": 1}).request_goodput == 0.5
    assert compute_metrics(records, 2.0, goodput_ms={"e2el": 350}).request_goodput == 1.0  # .25 and .3


def test_per_second_peaks_follow_vllm(records) -> None:
    m = compute_metrics(records, 2.0)
    assert m.max_output_tokens_per_s == 5  # 3 + 2 content chunks in the first second
    assert m.max_concurrent_requests == 2  # requests 0 and 1 both active in second 0


def test_peak_in_flight_counts_every_outcome(records) -> None:
    assert peak_in_flight(records) == 3  # requests 1, 3 and 4 at t=0.55


def test_chosen_percentiles(records) -> None:
    m = compute_metrics(records, 2.0, percentiles=(25, 99.9))
    assert set(m.ttft.percentiles_ms) == {25, 99.9}
    assert m.ttft.percentiles_ms[25] == pytest.approx(150)


def test_no_completed_request_reports_zeros() -> None:
    failed = [RequestRecord(0, 5, 5, status=RequestStatus.FAILED, error="x", end_s=1.0)]
    m = compute_metrics(failed, 1.0)
    assert (m.completed, m.failed, m.ttft.mean_ms, m.max_output_tokens_per_s) == (0, 1, 0.0, 0.0)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "e2el:2000.5"]) == {"ttft": 500.0, "e2el": 2000.5}
    for bad in (["ttft"], ["foo:3"], ["tpot:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
