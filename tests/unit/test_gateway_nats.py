"""The gateway against fake llumlets and a fake scheduler over a real nats-server: dispatch, the
scheduler's decisions and refusals, limits by instance. (Streams, failures and lifecycle:
test_gateway_nats_streams.py; harness: gateway_nats_harness.py.)"""

from __future__ import annotations

import logging
import time

import pytest

from shared.messages import DispatchReply, Refusal
from tests.unit.gateway_nats_harness import CHAT, HELLO, OUTPUT, cluster, text_of, tokenizer


async def test_bypass_mode_dispatches_from_load_reports(cluster, tokenizer, caplog):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    with caplog.at_level(logging.WARNING, logger="services.gateway.dispatcher"):
        bodies = [(await cluster.client.post(CHAT, json={"messages": HELLO})).json() for _ in range(2)]
    assert [b["choices"][0]["message"]["content"] for b in bodies] == [text_of(tokenizer, OUTPUT)] * 2
    assert len(llumlet.requests) == 2
    assert sum("bypass mode" in r.message for r in caplog.records) == 1  # once per episode
    assert "corral:gateway_bypass_dispatches_total 2.0" in cluster.gateway.metrics.render().decode()


async def test_generate_request_carries_everything_the_llumlet_needs(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    await cluster.client.post(CHAT, json={"messages": HELLO, "max_tokens": 3, "temperature": 0, "seed": 7,
                                          "priority": "high"})
    [request] = llumlet.requests
    assert request.reply_subject == cluster.gateway.output_subject
    assert request.priority == -1 and abs(request.arrival_time - time.time()) < 5
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.seed) == (3, 0.0, 7)
    assert request.prompt_token_ids == cluster.gateway.tokenizer.apply_chat_template(HELLO)


async def test_scheduler_decision_is_followed(cluster, tokenizer):
    a, b = await cluster.llumlet("a"), await cluster.llumlet("b")
    scheduler = await cluster.scheduler(lambda request: DispatchReply(instance_id=b.instance_id))
    await cluster.until_alive(2)
    body = (await cluster.client.post(CHAT, json={"messages": HELLO, "max_tokens": 4, "priority": 2})).json()
    assert body["choices"][0]["message"]["content"] == text_of(tokenizer, OUTPUT[:4])
    assert (len(a.requests), len(b.requests)) == (0, 1)
    [dispatch] = scheduler.requests
    assert (dispatch.num_prompt_tokens, dispatch.max_tokens, dispatch.priority) == (len(b.requests[0].prompt_token_ids), 4, 2)
    assert "corral:gateway_bypass_dispatches_total 0.0" in cluster.gateway.metrics.render().decode()


async def test_scheduler_rejection_is_a_429_with_retry_after(cluster):
    await cluster.scheduler(lambda request: DispatchReply(rejected="all instances are overloaded", retry_after_s=2.5))
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    error = response.json()["error"]
    assert error["type"] == "RateLimitError" and "overloaded" in error["message"]


@pytest.mark.parametrize("path, body, param", [(CHAT, {"messages": HELLO}, "messages"),
                                                 ("/v1/completions", {"prompt": "hello"}, "prompt")])
async def test_prompt_too_long_for_every_instance_is_a_400_naming_the_prompt(cluster, path, body, param):
    await cluster.scheduler(lambda request: DispatchReply(rejected="prompt is longer than any instance's max_model_len",
                                                          reason=Refusal.TOO_LONG))
    response = await cluster.client.post(path, json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and "max_model_len" in error["message"] and error["param"] == param


async def test_no_live_instance_is_a_503(cluster):
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 503 and response.json()["error"]["type"] == "ServiceUnavailableError"


async def test_vanished_instance_is_excluded_and_dispatch_retried(cluster, tokenizer):
    live = await cluster.llumlet("a")
    scheduler = await cluster.scheduler(
        lambda request: DispatchReply(instance_id="ghost-1" if not request.exclude else live.instance_id))
    body = (await cluster.client.post(CHAT, json={"messages": HELLO})).json()
    assert body["choices"][0]["message"]["content"] == text_of(tokenizer, OUTPUT)
    assert [r.exclude for r in scheduler.requests] == [[], ["ghost-1"]]
    assert cluster.gateway.instances.is_silent("ghost-1", since=time.monotonic())


@pytest.mark.parametrize("reason, status", [(Refusal.TOO_LONG, 400), (Refusal.INVALID, 400), (Refusal.DUPLICATE, 409)])
async def test_llumlet_refusals_map_to_http_errors_by_reason_not_words(cluster, reason, status):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    llumlet.ack_error, llumlet.ack_reason = "words that say nothing about the cause", reason
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == status and "words that say nothing" in response.json()["error"]["message"]
    assert len(llumlet.requests) == 1  # the client's fault: not tried elsewhere
    label = f'corral:gateway_rejections_total{{endpoint="{CHAT}",model_name="tiny-tok",reason="{reason.value}"}} 1.0'
    assert label in cluster.gateway.metrics.render().decode()


async def test_a_leaving_instance_refusal_is_tried_on_another(cluster, tokenizer):
    leaving, staying = await cluster.llumlet("leaving"), await cluster.llumlet("staying")
    await cluster.until_alive(2)
    leaving.ack_error, leaving.ack_reason = "instance is shutting down", Refusal.DRAINING
    await cluster.scheduler(
        lambda request: DispatchReply(instance_id=staying.instance_id if request.exclude else leaving.instance_id))
    body = (await cluster.client.post(CHAT, json={"messages": HELLO})).json()
    assert body["choices"][0]["message"]["content"] == text_of(tokenizer, OUTPUT)
    assert len(leaving.requests) == 1 and len(staying.requests) == 1


async def test_every_instance_leaving_is_a_503(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    llumlet.ack_error, llumlet.ack_reason = "instance is shutting down", Refusal.DRAINING
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 503 and response.json()["error"]["type"] == "ServiceUnavailableError"
    assert len(llumlet.requests) == 1  # excluded from the second try, which finds no other instance


async def test_max_tokens_fits_the_instance_context(cluster):
    llumlet = await cluster.llumlet("a", max_model_len=40)
    await cluster.until_alive(1)
    await cluster.client.post(CHAT, json={"messages": HELLO})
    [request] = llumlet.requests
    assert len(request.prompt_token_ids) + request.sampling.max_tokens == 40
