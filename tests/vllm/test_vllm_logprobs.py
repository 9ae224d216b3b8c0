"""Logprobs through the real vLLM engine (CPU build): what OpenAI's `logprobs`/`top_logprobs` ask
for comes back per output token, as vLLM computed it."""

from __future__ import annotations

import math

import pytest

from tests.vllm.test_vllm_engine import make_request, random_prompt, run_until_idle

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning")]


async def test_greedy_tokens_come_with_their_logprob_and_the_top_alternatives(vllm_engine):
    vllm_engine.add_request(make_request("lp", random_prompt(30, seed=11), temperature=0.0, max_tokens=6,
                                         ignore_eos=True, logprobs=3))
    vllm_engine.add_request(make_request("plain", random_prompt(30, seed=12), temperature=0.0, max_tokens=3,
                                         ignore_eos=True))
    collector = await run_until_idle(vllm_engine)
    outputs = [o for o in collector.outputs if o.request_id == "lp" and o.token_ids]
    assert sum(len(o.token_ids) for o in outputs) == 6
    for output in outputs:
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
        for token_id, logprob in zip(output.token_ids, output.logprobs):
            assert len(logprob.top) == 3
            ids, values = [t for t, _ in logprob.top], [v for _, v in logprob.top]
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
            assert ids[0] == token_id and math.isclose(logprob.logprob, values[0])  # greedy: the best one
            assert sum(math.exp(v) for v in values) <= 1 + 1e-6  # probabilities of distinct tokens
    assert all(o.logprobs is None for o in collector.outputs if o.request_id == "plain")


async def test_zero_top_logprobs_gives_the_sampled_token_only(vllm_engine):
    vllm_engine.add_request(make_request("only", random_prompt(20, seed=13), temperature=0.0, max_tokens=3,
                                         ignore_eos=True, logprobs=0))
    collector = await run_until_idle(vllm_engine)
    logprobs = [lp for o in collector.outputs for lp in (o.logprobs or [])]
    assert len(logprobs) == 3 and all(lp.top == [] and lp.logprob <= 0 for lp in logprobs)


def test_a_nan_logprob_goes_out_as_minus_infinity():
    """NaN is refused on the wire (and is no JSON); -inf is what the gateway floors to -9999.0."""
    from types import SimpleNamespace

    from services.llumlet.engines.vllm.params import logprobs_of

    position = {4: SimpleNamespace(logprob=math.nan, rank=1), 9: SimpleNamespace(logprob=-math.inf, rank=2)}
    (logprob,) = logprobs_of([4], [position], top=2)
    assert logprob.logprob == -math.inf and logprob.top == [(4, -math.inf), (9, -math.inf)]
