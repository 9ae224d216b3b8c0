"""benchmarks/decode_tail.py's split of decode latency, on hand-built finished requests."""

from types import SimpleNamespace

import pytest

from benchmarks.decode_tail import split_decode
from shared.engine_model.request import SimRequest


def finished(rid: str, outputs: int, decode_s: float, loss_s: float = 0.0, preemptions: int = 0) -> SimRequest:
    r = SimRequest(rid, prompt_len=16, max_tokens=outputs)
    r.num_output_tokens, r.first_token_time, r.finished_time = outputs, 1.0, 1.0 + decode_s
    r.preemption_loss_s, r.num_preemptions = loss_s, preemptions
    return r


def test_one_short_preempted_request_makes_most_of_the_mean():
    # 98 requests decode 100 tokens at 40 ms; one long one is preempted for 4 s; one of 2
    # tokens is preempted just after its first token and waits 30 s.
    requests = [finished(f"r{i}", 101, 4.0) for i in range(98)]
    requests.append(finished("long", 101, 8.0, loss_s=4.0, preemptions=1))
    requests.append(finished("short", 2, 30.04, loss_s=30.0, preemptions=1))
    result = SimpleNamespace(finished=requests, num_preemptions=2, migrations=SimpleNamespace(committed=0))

    split = split_decode(result, top=1, min_output=10)

    assert split["requests"] == 100 and split["preempted_requests"] == 2
    assert split["mean_ms"] == pytest.approx((98 * 40 + 80 + 30040) / 100)
    assert split["not_preempted_mean_ms"] == pytest.approx(40.0)
    assert split["mean_without_preemption_loss_ms"] == pytest.approx(40.0)  # the steps are all alike
    assert split["top1_share_of_mean_ms"] == pytest.approx(300.4)  # one request: 300 of the 341 ms mean
    assert split["mean_output_ge_10_ms"] == pytest.approx((98 * 40 + 80) / 99)
    assert split["preempted_output_lt_10"] == 1
    assert split["preempted_output_lt_10_share_of_mean_ms"] == pytest.approx(300.4)


def test_a_preemption_in_prefill_takes_out_no_more_than_the_decode_time():
    # Preempted before its first token: the loss lies before the decode; capped, not negative.
    result = SimpleNamespace(finished=[finished("r", 11, 0.4, loss_s=5.0, preemptions=1)], num_preemptions=1,
                             migrations=SimpleNamespace(committed=0))
    assert split_decode(result, top=1, min_output=10)["mean_without_preemption_loss_ms"] == pytest.approx(0.0)
