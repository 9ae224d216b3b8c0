"""A llumlet says why it refuses a generate order, as a typed reason the gateway maps to HTTP
(no reading of the words): invalid payload, too long, duplicate id, shutting down."""

from __future__ import annotations

import uuid

import nats
import pytest

from services.llumlet.config import LlumletConfig
from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.service import Llumlet
from shared import subjects
from shared.messages import Ack, Refusal, decode, encode
from shared.nats_client import flush_in_order
from tests.unit.migration_helpers import gen, sim_config

MAX_MODEL_LEN = 256


@pytest.fixture
async def nc(nats_url):
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest.fixture
async def llumlet(nats_url):
    config = LlumletConfig(f"refuse-{uuid.uuid4().hex[:6]}", nats_url, report_interval_s=0.05)
    llumlet = Llumlet(config, SimEngine(sim_config(time_scale=0.01, num_blocks=256, max_model_len=MAX_MODEL_LEN)))
    await llumlet.start()
    await flush_in_order(llumlet.nc)  # its subscriptions are on the server before another client asks
    yield llumlet
    if llumlet.nc is not None and not llumlet.nc.is_closed:
        await llumlet.stop()


async def order(nc, llumlet: Llumlet, payload: bytes) -> Ack:
    reply = await nc.request(subjects.llumlet(llumlet.instance_id, "generate"), payload, timeout=2)
    return decode(reply.data, Ack)


async def test_a_payload_that_is_no_generate_request_is_invalid(nc, llumlet):
    ack = await order(nc, llumlet, b"\x93not a request")
    assert (ack.ok, ack.reason) == (False, Refusal.INVALID)


async def test_a_prompt_the_context_cannot_hold_is_too_long(nc, llumlet):
    ack = await order(nc, llumlet, encode(gen("long", MAX_MODEL_LEN, 4)))
    assert (ack.ok, ack.reason) == (False, Refusal.TOO_LONG) and str(MAX_MODEL_LEN) in ack.error


async def test_an_id_already_running_here_is_a_duplicate(nc, llumlet):
    assert (await order(nc, llumlet, encode(gen("dup", 20, 2000)))).ok
    ack = await order(nc, llumlet, encode(gen("dup", 20, 5)))
    assert (ack.ok, ack.reason) == (False, Refusal.DUPLICATE)


async def test_a_leaving_instance_refuses_new_requests_as_draining(nc, llumlet):
    assert (await order(nc, llumlet, encode(gen("before", 20, 5)))).ok
    await llumlet._announce_leaving()  # the first step of stop(): its last report says draining
    ack = await order(nc, llumlet, encode(gen("after", 20, 5)))
    assert (ack.ok, ack.reason) == (False, Refusal.DRAINING) and "shutting down" in ack.error


async def test_logprobs_on_the_simulated_engine_are_invalid_not_invented(nc, llumlet):
    request = gen("lp", 20, 5)
    request.sampling.logprobs = 2
    ack = await order(nc, llumlet, encode(request))
    assert (ack.ok, ack.reason) == (False, Refusal.INVALID) and "vLLM engine" in ack.error
