"""Corral's vllm:* series are vLLM's: same names, types, labels and buckets, colons kept on the wire."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import GatewayMetrics, RequestTimeline
from services.llumlet.metrics import SCHEDULE_PROBE_INTERVAL_S, LlumletMetrics
from shared import vllm_metrics
from shared.engine_model.views import RequestPhase, RequestView, StepOutput
from shared.messages import FinishReason
from shared.metrics_server import CONTENT_TYPE, MetricsServer, render, serve_metrics
from tests.support.exported_metrics import exposition_texts, gateway_with_one_request, llumlet_after_one_request
from tests.unit.policy_helpers import make_load

# What Prometheus 2.x sends: OpenMetrics first (the format whose writer drops the colons).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def vllm_source(relative: str) -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed: nothing to compare with")
    return Path(spec.submodule_search_locations[0]) / relative


def vllm_declarations() -> dict[str, str]:
    """vLLM's metric name → its kind (gauge, counter, histogram), read from its stat logger."""
    source = vllm_source("v1/metrics/loggers.py").read_text()
    found = re.findall(r"self\._(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[a-z0-9_]+)\"", source)
    return {name: kind for kind, name in found}


def vllm_buckets():
    """vLLM's buckets module, loaded alone (importing the vllm package takes seconds)."""
    spec = importlib.util.spec_from_file_location("vllm_buckets", vllm_source("v1/metrics/buckets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_every_vllm_series_has_vllms_name_kind_and_labels():
    declared = vllm_declarations()
    assert len(declared) > 30  # the regex still reads vLLM's source
    exported = {}
    for text in exposition_texts():
        for family in text_string_to_metric_families(text):
            # `_created` timestamps come with every counter and histogram (vLLM's too).
            if family.name.startswith("vllm:") and not family.name.endswith("_created"):
                exported[family.name] = family
    for name, family in exported.items():
        vllm_name = name if name in declared else name.removesuffix("_total")  # a counter's family name
        assert declared.get(vllm_name) == family.type, name
        for sample in family.samples:
            assert {"model_name", "engine"} <= set(sample.labels), sample
    expected = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
                "vllm:generation_tokens", "vllm:request_success", "vllm:time_to_first_token_seconds",
                "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
                "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
                "vllm:request_max_num_generation_tokens", "vllm:request_params_n", "vllm:iteration_tokens_total",
                "vllm:request_inference_time_seconds", "vllm:request_num_preemptions",
                "vllm:request_prefill_kv_computed_tokens", "vllm:num_requests_waiting_by_reason",
                "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached", "vllm:prompt_tokens_cached_by_source"}
    assert expected <= set(exported), expected - set(exported)


def test_buckets_are_vllms():
    theirs = vllm_buckets()
    assert vllm_metrics.TIME_TO_FIRST_TOKEN_BUCKETS == theirs.TIME_TO_FIRST_TOKEN_BUCKETS
    assert vllm_metrics.INTER_TOKEN_LATENCY_BUCKETS == theirs.INTER_TOKEN_LATENCY_BUCKETS
    assert vllm_metrics.REQUEST_LATENCY_BUCKETS == theirs.REQUEST_LATENCY_BUCKETS
    assert vllm_metrics.ITERATION_TOKENS_BUCKETS == theirs.ITERATION_TOKENS_BUCKETS
    assert vllm_metrics.REQUEST_PARAMS_N_BUCKETS == theirs.REQUEST_PARAMS_N_BUCKETS
    assert vllm_metrics.REQUEST_NUM_PREEMPTIONS_BUCKETS == theirs.REQUEST_NUM_PREEMPTIONS_BUCKETS
    for max_model_len in (1, 7, 2048, 4096, 131072):
        assert vllm_metrics.request_tokens_buckets(max_model_len) == theirs.build_1_2_5_buckets(max_model_len)
    text = gateway_with_one_request().render().decode()
    bounds = [s.labels["le"] for s in families(text)["vllm:request_prompt_tokens"].samples
              if s.name.endswith("_bucket")]
    assert bounds[:3] == ["1.0", "2.0", "5.0"] and bounds[-2:] == ["2000.0", "+Inf"]


def test_the_exposition_keeps_the_colons():
    for text in exposition_texts():
        samples = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert samples
        assert not [line for line in samples if line.startswith(("vllm_", "corral_"))]
        assert all(line.startswith(("vllm:", "corral:")) for line in samples), text


def test_the_metrics_server_answers_prometheus_with_the_text_format():
    """prometheus_client's own server would answer this Accept header with OpenMetrics and
    `vllm_num_requests_running`: ours always sends the text format, names untouched."""
    metrics = LlumletMetrics("tiny", "llumlet-0")
    server = serve_metrics(metrics.registry, 0, "127.0.0.1")
    assert server is None  # port 0: off
    server = MetricsServer(metrics.registry, 0, "127.0.0.1")
    try:
        reply = httpx.get(f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
        assert reply.status_code == 200
        assert reply.headers["content-type"] == CONTENT_TYPE
        assert 'vllm:num_requests_running{engine="llumlet-0",model_name="tiny"} 0.0' in reply.text
        assert "vllm_num_requests_running" not in reply.text
        assert httpx.get(f"http://127.0.0.1:{server.port}/other").status_code == 404
    finally:
        server.close()


def test_counters_are_there_at_zero_before_anything_happens():
    gateway = GatewayMetrics("tiny", 2048)
    gateway.watch_instances(lambda: ["llumlet-0", "llumlet-1"])
    seen = families(gateway.render().decode())
    success = {(s.labels["engine"], s.labels["finished_reason"]): s.value
               for s in seen["vllm:request_success"].samples if s.name.endswith("_total")}
    assert success == {(e, r): 0.0 for e in ("llumlet-0", "llumlet-1") for r in vllm_metrics.FINISHED_REASONS}
    assert seen["corral:gateway_instances_alive"].samples[0].value == 2
    llumlet = families(render(LlumletMetrics("tiny", "llumlet-0").registry).decode())
    for name in ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:prompt_tokens", "vllm:prompt_tokens_cached", "vllm:generation_tokens"):
        totals = [s for s in llumlet[name].samples if s.name.endswith("_total")]
        assert [s.value for s in totals] == [0.0], name
    directions = {s.labels["direction"] for s in llumlet["corral:llumlet_migrations"].samples}
    assert directions == {"in", "out"}
    holds = [s for s in llumlet["corral:llumlet_migration_commit_hold_seconds"].samples if s.name.endswith("_count")]
    assert [s.value for s in holds] == [0.0]


def value(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def test_the_gateway_measures_the_request_as_the_client_saw_it():
    text = gateway_with_one_request().render().decode()
    one = {"engine": "llumlet-1"}
    assert value(text, "vllm:time_to_first_token_seconds_sum", **one) == pytest.approx(0.2)
    assert value(text, "vllm:inter_token_latency_seconds_count", **one) == 4
    assert value(text, "vllm:request_decode_time_seconds_sum", **one) == pytest.approx(0.4)
    assert value(text, "vllm:request_time_per_output_token_seconds_sum", **one) == pytest.approx(0.1)
    assert value(text, "vllm:e2e_request_latency_seconds_sum", **one) == pytest.approx(1.0)
    assert value(text, "vllm:request_success_total", finished_reason="length", **one) == 1
    assert value(text, "vllm:request_success_total", finished_reason="stop", **one) == 0
    assert value(text, "vllm:request_prompt_tokens_sum", **one) == 30
    assert value(text, "vllm:request_generation_tokens_sum", **one) == 5
    assert value(text, "vllm:request_params_max_tokens_count", **one) == 1


def test_a_request_without_tokens_counts_its_end_but_no_token_timing():
    metrics = GatewayMetrics("tiny", 2048)
    metrics.request_finished(RequestTimeline("llumlet-0", 0.0, 0.5, 10, 0, None, "abort"))
    text = metrics.render().decode()
    assert value(text, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(text, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(text, "vllm:request_params_max_tokens_count") == 0  # the client gave none
    assert value(text, "vllm:time_to_first_token_seconds_count", engine="llumlet-0") == 0
    assert value(text, "vllm:inter_token_latency_seconds_count", engine="llumlet-0") == 0


def test_the_llumlet_reads_views_only_for_queued_requests_and_at_most_every_interval():
    metrics = LlumletMetrics("tiny", "llumlet-0")
    assert not metrics.wants_views(1.0)  # nothing queued
    metrics.request_arrived("r", 1.0)
    assert metrics.wants_views(1.0)
    assert not metrics.wants_views(1.0 + SCHEDULE_PROBE_INTERVAL_S / 2)
    assert metrics.wants_views(1.0 + SCHEDULE_PROBE_INTERVAL_S)
    metrics.step_done(1.0, 1.1, [], [RequestView("r", 0, RequestPhase.RUNNING, 1, 1, 10)])
    assert not metrics.wants_views(5.0)  # scheduled: nothing left to look for


def test_the_llumlet_times_queue_and_prefill_from_the_step_that_scheduled_it():
    text = render(llumlet_after_one_request().registry).decode()
    assert value(text, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(text, "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.4)
    assert value(text, "vllm:prompt_tokens_total") == 30
    assert value(text, "vllm:generation_tokens_total") == 2


def test_the_llumlet_forgets_requests_that_leave_and_times_none_it_did_not_queue():
    metrics = LlumletMetrics("tiny", "llumlet-0")
    metrics.request_arrived("gone", 5.0)
    assert metrics.wants_views(5.0)
    metrics.request_left("gone")
    assert not metrics.wants_views(6.0)
    # Migrated in mid-decode: its tokens count, it has no queue or prefill time here.
    metrics.step_done(1.0, 1.1, [StepOutput("migrated", 12, [3, 4])])
    text = render(metrics.registry).decode()
    assert value(text, "vllm:generation_tokens_total") == 2
    assert value(text, "vllm:prompt_tokens_total") == 0
    assert value(text, "vllm:request_queue_time_seconds_count") == 0


def test_prefix_cache_lookups_count_what_the_engine_found_and_nothing_without_a_cache():
    metrics = LlumletMetrics("tiny", "llumlet-0")
    metrics.step_done(1.0, 1.1, [StepOutput("cached", 0, [3], num_prompt_tokens=40, num_cached_tokens=32),
                                 StepOutput("no-cache", 0, [4], num_prompt_tokens=50)])  # None: no prefix cache
    text = render(metrics.registry).decode()
    assert value(text, "vllm:prefix_cache_queries_total") == 40
    assert value(text, "vllm:prefix_cache_hits_total") == 32
    assert value(text, "vllm:prompt_tokens_total") == 90
    assert value(text, "vllm:prompt_tokens_cached_total") == 32
    assert value(text, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 32
    assert value(text, "vllm:prompt_tokens_by_source_total", source="local_compute") == 58
    assert value(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0


def test_label_values_are_vllms():
    loggers, sources = (vllm_source(f"v1/metrics/{name}.py").read_text() for name in ("loggers", "cache_hit_source"))
    reasons = dict(re.findall(r'^(WAITING_REASON_[A-Z]+) = "([a-z]+)"$', loggers, re.M))
    assert (reasons["WAITING_REASON_CAPACITY"], reasons["WAITING_REASON_DEFERRED"]) == vllm_metrics.WAITING_REASONS
    sources = re.findall(r'^    [A-Z0-9_]+ = "([a-z0-9_]+)"$', sources, re.M)  # CacheHitSource, in order
    assert tuple(sources) == vllm_metrics.CACHE_HIT_SOURCES


def test_n_and_the_longest_output_are_recorded_once_per_client_request():
    metrics = GatewayMetrics("tiny", 2048)
    for engine, tokens in (("llumlet-0", 7), ("llumlet-1", 12), ("llumlet-0", 3)):
        metrics.request_finished(RequestTimeline(engine, 0.0, 1.0, 20, tokens, 12, "stop", 0.1, 0.9,
                                                 num_cached_tokens=16))
    metrics.choices_finished(3, [("llumlet-0", 7), ("llumlet-1", 12), ("llumlet-0", 3)])
    metrics.choices_finished(1, [])  # never reached an instance: nothing to say
    text = metrics.render().decode()
    assert value(text, "vllm:request_params_n_count", engine="llumlet-1") == 1
    assert value(text, "vllm:request_params_n_sum", engine="llumlet-1") == 3
    assert value(text, "vllm:request_params_n_bucket", engine="llumlet-1", le="2.0") == 0
    assert value(text, "vllm:request_params_n_bucket", engine="llumlet-1", le="5.0") == 1
    assert value(text, "vllm:request_max_num_generation_tokens_sum", engine="llumlet-1") == 12
    assert value(text, "vllm:request_params_n_count", engine="llumlet-0") == 0
    # Per choice, as vLLM counts its child requests: the prompt less what the cache held.
    assert value(text, "vllm:request_prefill_kv_computed_tokens_sum", engine="llumlet-0") == 8
    assert value(text, "vllm:request_params_max_tokens_count", engine="llumlet-0") == 2


def test_the_llumlet_counts_tokens_per_step_and_times_inference_to_the_last_token():
    text = render(llumlet_after_one_request().registry).decode()
    # Steps: a prefill chunk (nothing out), the prompt's 30 computed tokens with the first, one more.
    assert value(text, "vllm:iteration_tokens_total_count") == 3
    assert value(text, "vllm:iteration_tokens_total_sum") == 32
    assert value(text, "vllm:iteration_tokens_total_bucket", le="1.0") == 2
    assert value(text, "vllm:iteration_tokens_total_bucket", le="32.0") == 3
    assert value(text, "vllm:request_inference_time_seconds_sum") == pytest.approx(0.5)  # scheduled 100.5, last 101.0
    assert value(text, "vllm:request_num_preemptions_sum") == 1
    assert value(text, "vllm:request_num_preemptions_count") == 1


def test_cached_prompt_tokens_are_the_device_tier_and_computed_ones_fill_the_step():
    metrics = LlumletMetrics("tiny", "llumlet-0")
    metrics.step_done(1.0, 1.1, [StepOutput("cached", 0, [3], num_prompt_tokens=40, num_cached_tokens=32),
                                 StepOutput("decoding", 7, [4, 5])])
    text = render(metrics.registry).decode()
    assert value(text, "vllm:iteration_tokens_total_sum") == 8 + 1 + 2
    assert value(text, "vllm:prompt_tokens_cached_by_source_total", source="device") == 32
    for source in ("host", "p2p", "disk", "external_unspecified"):
        assert value(text, "vllm:prompt_tokens_cached_by_source_total", source=source) == 0


def test_a_migrated_in_request_counts_its_preemptions_but_no_inference_time_here():
    metrics = LlumletMetrics("tiny", "llumlet-0")
    metrics.step_done(1.0, 1.1, [StepOutput("migrated", 12, [3], FinishReason.STOP, num_preemptions=2)])
    text = render(metrics.registry).decode()
    assert value(text, "vllm:request_num_preemptions_sum") == 2
    assert value(text, "vllm:request_num_preemptions_bucket", le="1.0") == 0
    assert value(text, "vllm:request_inference_time_seconds_count") == 0


def test_waiting_requests_all_wait_for_capacity():
    metrics = LlumletMetrics("tiny", "llumlet-0")
    text = render(metrics.registry).decode()
    assert value(text, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert value(text, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert value(text, "vllm:iteration_tokens_total_count") == 0  # present before the first step
    metrics.observe_report(make_load("llumlet-0", waiting=[10, 10, 10]))
    text = render(metrics.registry).decode()
    assert value(text, "vllm:num_requests_waiting_by_reason", reason="capacity") == \
        value(text, "vllm:num_requests_waiting") == 3
    assert value(text, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
