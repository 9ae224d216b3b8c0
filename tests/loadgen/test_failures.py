"""The error summary counts every failure, groups messages that differ only in ids and numbers,
and says so, and says what it leaves out."""

from __future__ import annotations

from loadgen.failures import failure_lines, group_failures, message_shape
from loadgen.metrics import compute_metrics
from loadgen.records import RequestRecord, RequestStatus
from loadgen.report import metrics_fields


def test_shape_masks_ids_and_numbers_but_keeps_the_http_status() -> None:
    assert message_shape("HTTP 503: instance llumlet-3 (3fa2c9d1e0) gone after 12.5 s") == \
        "HTTP 503: instance llumlet-<n> (<id>) gone after <n> s"
    assert message_shape("HTTP 429: busy") == "HTTP 429: busy"
    assert message_shape("request 0b6e3c1f-8a1d-4c2e-9f00-123456789abc aborted") == "request <id> aborted"
    assert message_shape("ReadTimeout: utf8 stream") == "ReadTimeout: utf8 stream"


def test_groups_count_every_failure() -> None:
    counts = {f"HTTP 503: instance {i} is gone": 2 for i in range(100)}
    counts |= {"HTTP 400: bad prompt": 5, "HTTP 404: no model 7": 1}
    groups = group_failures(counts)
    assert [(g.count, g.distinct) for g in groups] == [(200, 100), (5, 1), (1, 1)]
    assert groups[0].shape == "HTTP 503: instance <n> is gone"
    assert sum(g.count for g in groups) == sum(counts.values())


def test_summary_says_it_grouped_and_what_it_left_out() -> None:
    counts = {f"kind{k} failure at step {i}": 1 for k in range(14) for i in range(k + 1)}  # 105 failures
    lines = failure_lines(counts, shown=10)
    assert lines[0] == "105 requests did not complete, 105 distinct message(s)"
    assert lines[1] == "grouped into 14 kind(s): ids shown as <id>, numbers as <n>"
    shown = lines[2:-1]
    assert len(shown) == 10 and shown[0].split()[0] == "14"
    left = sum(range(1, 5))  # the four smallest kinds: 1 + 2 + 3 + 4 requests
    assert lines[-1].startswith(f"... 4 more kind(s) covering {left} request(s) not shown")
    assert sum(int(line.split()[0]) for line in shown) + left == 105


def test_summary_without_grouping_lists_messages_as_they_are() -> None:
    lines = failure_lines({"HTTP 429: busy": 3, "engine died": 1})
    assert lines == ["4 requests did not complete, 2 distinct message(s)", "     3 x HTTP 429: busy",
                     "     1 x engine died"]


def test_result_json_keeps_every_message_and_the_groups() -> None:
    records = [RequestRecord(i, 4, 4, send_s=0.0, end_s=0.1, status=RequestStatus.FAILED, error=f"gone {i}")
               for i in range(30)]
    records.append(RequestRecord(30, 4, 4, send_s=0.0, chunk_s=[0.05, 0.1], end_s=0.1, status=RequestStatus.OK))
    fields = metrics_fields(compute_metrics(records, 1.0))
    assert len(fields["errors_summary"]) == 30
    assert fields["error_groups"] == [{"shape": "gone <n>", "count": 30, "distinct_messages": 30, "example": "gone 0"}]
