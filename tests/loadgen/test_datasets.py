"""Dataset SPEC parsing and the trace parsers, on the real fixtures in ../shared/data/traces."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadgen.datasets import load_dataset, parse_dataset_spec
from loadgen.errors import LoadgenError
from loadgen.lengths import TABLE1

from .conftest import trace_path


def test_spec_kinds_parse() -> None:
    assert parse_dataset_spec("burstgpt:/tmp/x.csv").path.name == "x.csv"
    synthetic = parse_dataset_spec("synthetic:S-L")
    assert (synthetic.input_dist, synthetic.output_dist) == ("s", "l")
    assert parse_dataset_spec("synthetic:sharegpt").output_dist == "sharegpt"
    fixed = parse_dataset_spec("random:256:128")
    assert (fixed.fixed_input, fixed.fixed_output) == (256, 128)


@pytest.mark.parametrize(
    "spec", ["nosuch:/x", "sharegpt", "synthetic:S-X", "random:10", "random:0:5", "random:a:b"]
)
def test_bad_specs_raise_a_clear_error(spec: str) -> None:
    with pytest.raises(LoadgenError):
        parse_dataset_spec(spec)


def test_missing_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(LoadgenError, match="no such file"):
        load_dataset(f"mooncake:{tmp_path / 'absent.jsonl'}")


def test_malformed_mooncake_line_names_the_line(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [0]}\n{oops\n')
    with pytest.raises(LoadgenError, match=":2:"):
        load_dataset(f"mooncake:{path}")


def test_burstgpt_drops_failed_rows_and_keeps_time() -> None:
    records = load_dataset(f"burstgpt:{trace_path('BurstGPT_1.csv')}")
    assert len(records) == 42 - 4  # the fixture has 4 rows with Response tokens == 0
    assert all(r.output_len and r.output_len > 0 for r in records)
    first, second = records[0], records[1]
    assert (first.input_len, first.output_len, first.timestamp_s) == (472, 18, 0.0)
    assert (second.input_len, second.output_len, second.timestamp_s) == (1087, 230, 40.0)
    stamps = [r.timestamp_s for r in records]
    assert stamps == sorted(stamps)


def test_azure_trace_parses_seven_digit_timestamps() -> None:
    records = load_dataset(f"azure:{trace_path('AzureLLMInferenceTrace_conv.csv')}")
    with trace_path("AzureLLMInferenceTrace_conv.csv").open() as handle:
        rows = sum(1 for _ in handle) - 1
    assert len(records) == rows  # no row of this trace has a zero length
    assert (records[0].input_len, records[0].output_len, records[0].timestamp_s) == (374, 44, 0.0)
    assert records[1].input_len == 396
    assert records[1].timestamp_s == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    assert 3400 < records[-1].timestamp_s < 3600  # 18:15 … 19:14


def test_mooncake_lengths_times_and_hash_ids() -> None:
    records = load_dataset(f"mooncake:{trace_path('mooncake_synthetic_first400.jsonl')}")
    assert len(records) == 400
    assert (records[0].input_len, records[0].output_len) == (40160, 6)
    assert records[2].timestamp_s == pytest.approx(0.040)
    assert all(len(r.hash_ids) == math.ceil(r.input_len / 512) for r in records)


def test_sharegpt_sample_uses_the_gpt_reply_for_output_length() -> None:
    path = trace_path("sharegpt_sample.json")
    items = {item["conversation_id"]: item for item in json.loads(path.read_text())}
    records = load_dataset(f"sharegpt:{path}")
    assert len(records) == 50
    for record in records:
        item = items[record.source_id]
        assert record.prompt == item["conversations"][0]["value"]
        assert (record.input_len, record.output_len) == (item["prompt_tokens"], item["response_tokens"])


def test_sharegpt_conversations_counted_with_a_tokenizer(tmp_path, tokenizer) -> None:
    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "the quick brown fox"},
                                      {"from": "gpt", "value": "jumps over the lazy dog"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hello"},
                                      {"from": "human", "value": "a model"}]},
        {"id": "c", "conversations": []},
    ]
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(conversations))
    records = {r.source_id: r for r in load_dataset(f"sharegpt:{path}", tokenizer=tokenizer)}
    assert set(records) == {"a", "b"}
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert records["a"].input_len == count("the quick brown fox")
    assert records["a"].output_len == count("jumps over the lazy dog")
    assert records["b"].prompt == "a model" and records["b"].output_len is None


def test_sharegpt_prompt_only_file_has_no_output_length() -> None:
    records = load_dataset(f"sharegpt:{trace_path('ShareGPT_V3_filtered_1000.json')}")
    assert len(records) == 1000
    assert all(r.output_len is None and r.prompt for r in records)


def test_sharegpt_length_csv() -> None:
    records = load_dataset(f"sharegpt:{trace_path('sharegpt_val_10k_llama2.csv')}")
    assert len(records) == 10000
    pairs = {(r.input_len, r.output_len) for r in records}
    assert {(3742, 284), (18, 243)} <= pairs


def test_same_seed_same_requests_other_seed_other_order() -> None:
    spec = f"sharegpt:{trace_path('ShareGPT_V3_filtered_1000.json')}"
    first = [r.source_id for r in load_dataset(spec, num_requests=50, seed=3)]
    again = [r.source_id for r in load_dataset(spec, num_requests=50, seed=3)]
    other = [r.source_id for r in load_dataset(spec, num_requests=50, seed=4)]
    assert first == again and first != other


def test_cycling_a_trace_keeps_time_moving_forward() -> None:
    records = load_dataset(f"burstgpt:{trace_path('BurstGPT_1.csv')}", num_requests=100)
    stamps = [r.timestamp_s for r in records]
    assert len(records) == 100 and stamps == sorted(stamps)
    assert stamps[38] > stamps[37]


def test_random_spec_gives_fixed_lengths() -> None:
    records = load_dataset("random:64:16", num_requests=5)
    assert [(r.input_len, r.output_len) for r in records] == [(64, 16)] * 5


@pytest.mark.parametrize("name", ["s", "m", "l", "sharegpt", "burstgpt"])
def test_synthetic_distributions_match_table1(name: str) -> None:
    records = load_dataset(f"synthetic:{name}", num_requests=40000, seed=11)
    for side, lengths in (("in", [r.input_len for r in records]), ("out", [r.output_len for r in records])):
        row = TABLE1[name if name in "sml" else f"{name}-{side}"]
        values = np.asarray(lengths)
        assert values.min() >= 1 and values.max() <= row.cap
        assert np.mean(values) == pytest.approx(row.mean, rel=0.05)
        for p, expected in ((50, row.p50), (80, row.p80), (95, row.p95), (99, row.p99)):
            assert np.percentile(values, p) == pytest.approx(expected, rel=0.06, abs=2)


def test_synthetic_pairs_input_and_output_distributions() -> None:
    records = load_dataset("synthetic:S-L", num_requests=20000, seed=5)
    assert np.mean([r.input_len for r in records]) == pytest.approx(128, rel=0.05)
    assert np.mean([r.output_len for r in records]) == pytest.approx(512, rel=0.05)
    assert load_dataset("synthetic:S-L", num_requests=100, seed=5) == records[:100]
