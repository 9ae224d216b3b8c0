"""VllmEngine against the real vLLM (CPU build): outputs, sampling, preemption, aborts, load views.

One engine serves the whole module (a start costs tens of seconds); every test leaves it idle.
Its KV cache is tiny (23 blocks of 32 tokens), so long requests compete for blocks.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from services.llumlet.engine import Engine
from shared.engine_model.views import EngineError, RequestPhase, StepOutput
from shared.messages import FinishReason, GenerateRequest, SamplingParams
from tests.vllm.helpers import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, start_reference_run

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning")]

MAX_STEPS = 5000


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 384) for _ in range(length)]  # past the special tokens


def make_request(request_id: str, prompt: list[int], **sampling) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(**sampling),
        reply_subject=f"test.{request_id}",
    )


class Collector:
    """Gathers step outputs per request and checks they arrive in order, without gaps."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason] = {}
        self.outputs: list[StepOutput] = []

    def add(self, output: StepOutput) -> None:
        tokens = self.tokens.setdefault(output.request_id, [])
        assert output.request_id not in self.finish, f"output after the end: {output}"
        assert output.start_index == len(tokens), output
        tokens.extend(output.token_ids)
        self.outputs.append(output)
        if output.finish_reason is not None:
            self.finish[output.request_id] = output.finish_reason


async def run_until_idle(engine: Engine, collector: Collector | None = None, on_step=None) -> Collector:
    collector = collector or Collector()
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            assert collector.tokens.keys() == collector.finish.keys(), "a request stopped without finishing"
            return collector
        for output in await engine.step():
            collector.add(output)
        if on_step is not None:
            on_step(engine)
    raise AssertionError("the engine did not become idle")


async def wait_for_free_blocks(engine: Engine, expected: int, timeout_s: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine.num_free_blocks() != expected:
        assert asyncio.get_running_loop().time() < deadline, (engine.num_free_blocks(), expected)
        await asyncio.sleep(0.01)


GREEDY_PROMPTS = [random_prompt(9, seed=1), random_prompt(40, seed=2), random_prompt(120, seed=3)]
GREEDY_SAMPLING = dict(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def reference_run(small_engine_config):
    """`vllm.LLM.generate` on the same prompts, started before the shared engine builds."""
    run = start_reference_run(small_engine_config, GREEDY_PROMPTS, GREEDY_SAMPLING)
    yield run
    run.close()


@pytest.fixture(scope="module")
def engine(reference_run, vllm_engine):
    return vllm_engine


async def test_engine_reports_its_kv_geometry(engine):
    assert isinstance(engine, Engine)
    assert engine.kind == "vllm"
    assert engine.block_size == BLOCK_SIZE
    assert engine.num_blocks_total == NUM_BLOCKS - 1
    assert engine.num_free_blocks() == engine.num_blocks_total
    assert engine.max_model_len == MAX_MODEL_LEN
    assert engine.model_name == "tiny-llama"


async def test_engine_runs_inside_this_process(engine, reference_run):
    import psutil

    # vLLM's engine core would be a python child; the suite's own nats-server (and the
    # reference run's subprocess) are not the engine.
    children = {
        child.pid for child in psutil.Process().children(recursive=True)
        if child.pid != reference_run.process.pid and "nats-server" not in child.name()
    }
    assert children == set()


async def test_greedy_output_matches_vllm_llm_generate(engine, reference_run):
    for i, prompt in enumerate(GREEDY_PROMPTS):
        engine.add_request(make_request(f"greedy-{i}", prompt, **GREEDY_SAMPLING))
    collector = await run_until_idle(engine)
    expected = reference_run.result()
    got = [collector.tokens[f"greedy-{i}"] for i in range(len(GREEDY_PROMPTS))]
    assert got == expected
    assert all(len(tokens) > 0 for tokens in got)


async def test_outputs_carry_prompt_length_and_stream_one_token_per_step(engine):
    prompt = random_prompt(50, seed=4)
    engine.add_request(make_request("stream", prompt, temperature=0.0, max_tokens=6, ignore_eos=True))
    collector = await run_until_idle(engine)
    assert [len(o.token_ids) for o in collector.outputs] == [1] * 6
    assert {o.num_prompt_tokens for o in collector.outputs} == {50}


async def test_max_tokens_ends_with_length(engine):
    engine.add_request(make_request("short", random_prompt(20, seed=5), max_tokens=5, ignore_eos=True))
    collector = await run_until_idle(engine)
    assert len(collector.tokens["short"]) == 5
    assert collector.finish["short"] is FinishReason.LENGTH


async def greedy_run_and_a_fresh_token(engine, prompt: list[int]) -> tuple[list[int], int]:
    """A greedy run, and the index of its first token (two or more tokens in) not seen before it."""
    engine.add_request(make_request("free", prompt, temperature=0.0, max_tokens=16, ignore_eos=True))
    free_run = (await run_until_idle(engine)).tokens["free"]
    return free_run, next(i for i in range(2, len(free_run)) if free_run[i] not in free_run[:i])


async def test_stop_token_ends_with_stop(engine):
    prompt = random_prompt(30, seed=6)
    free_run, stop_at = await greedy_run_and_a_fresh_token(engine, prompt)
    stop_token = free_run[stop_at]
    engine.add_request(
        make_request("stopped", prompt, temperature=0.0, max_tokens=16, stop_token_ids=[stop_token])
    )
    collector = await run_until_idle(engine)
    assert collector.tokens["stopped"] == free_run[: stop_at + 1]
    assert collector.finish["stopped"] is FinishReason.STOP


async def test_min_tokens_holds_back_a_stop_token(engine):
    prompt = random_prompt(30, seed=6)
    free_run, stop_at = await greedy_run_and_a_fresh_token(engine, prompt)
    min_tokens = stop_at + 3
    engine.add_request(
        make_request(
            "held", prompt, temperature=0.0, max_tokens=16, min_tokens=min_tokens, stop_token_ids=[free_run[stop_at]]
        )
    )
    tokens = (await run_until_idle(engine)).tokens["held"]
    assert tokens[:stop_at] == free_run[:stop_at]
    assert len(tokens) >= min_tokens
    assert free_run[stop_at] not in tokens[:min_tokens]


async def test_seeded_sampling_is_reproducible_within_a_batch(engine):
    prompt = random_prompt(25, seed=7)
    sampling = dict(temperature=1.0, top_p=0.95, top_k=50, max_tokens=32, ignore_eos=True)
    engine.add_request(make_request("seed7-a", prompt, seed=7, **sampling))
    engine.add_request(make_request("seed7-b", prompt, seed=7, **sampling))
    engine.add_request(make_request("seed8", prompt, seed=8, **sampling))
    tokens = (await run_until_idle(engine)).tokens
    assert tokens["seed7-a"] == tokens["seed7-b"]
    assert tokens["seed7-a"] != tokens["seed8"]


async def test_repetition_penalty_changes_greedy_output(engine):
    prompt = random_prompt(25, seed=8)
    engine.add_request(make_request("plain", prompt, temperature=0.0, max_tokens=24, ignore_eos=True))
    engine.add_request(
        make_request("penalised", prompt, temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=2.0)
    )
    tokens = (await run_until_idle(engine)).tokens
    assert tokens["plain"] != tokens["penalised"]


async def test_small_kv_cache_preempts_and_the_views_show_it(engine):
    before = engine.num_preemptions_total()
    preempted_views = []

    def watch(e):
        preempted_views.extend(v for v in e.request_views() if v.num_preemptions and v.phase is RequestPhase.WAITING)

    # 4 x 300 tokens = 40 blocks of 32 tokens, far more than the 23 there are.
    for i in range(4):
        engine.add_request(make_request(f"long-{i}", random_prompt(100, seed=10 + i), max_tokens=200, ignore_eos=True))
    collector = await run_until_idle(engine, on_step=watch)

    assert engine.num_preemptions_total() > before
    assert preempted_views, "no preempted request was ever seen waiting"
    for view in preempted_views:
        assert view.physical_blocks == 0  # vLLM frees a preempted request's blocks (recompute)
        assert view.demand_blocks == -(-(view.num_tokens + 1) // BLOCK_SIZE)
    assert all(len(collector.tokens[f"long-{i}"]) == 200 for i in range(4))
    assert all(reason is FinishReason.LENGTH for reason in collector.finish.values())
    assert any(o.num_preemptions > 0 for o in collector.outputs)
    assert engine.num_preemptions_total() - before >= max(o.num_preemptions for o in collector.outputs)
    assert engine.num_free_blocks() == engine.num_blocks_total


async def test_abort_frees_the_requests_blocks(engine):
    baseline = engine.num_free_blocks()
    engine.add_request(make_request("doomed", random_prompt(200, seed=20), max_tokens=200, ignore_eos=True))
    for _ in range(3):
        await engine.step()
    (view,) = engine.request_views()
    assert view.phase is RequestPhase.RUNNING
    assert view.physical_blocks == -(-view.num_tokens // BLOCK_SIZE)
    assert view.num_output_tokens == view.num_tokens - 200 >= 1  # (admission's `predicted` reads it)
    assert engine.num_free_blocks() == baseline - view.physical_blocks

    assert engine.abort_request("doomed") is True
    assert engine.abort_request("doomed") is False
    assert engine.request_views() == []
    # Without another step: the engine thread applies the abort on its own.
    await wait_for_free_blocks(engine, baseline)
    assert not engine.has_work()


async def test_abort_of_a_request_not_yet_applied(engine):
    baseline = engine.num_free_blocks()
    engine.add_request(make_request("gone", random_prompt(10, seed=21), max_tokens=4))
    assert engine.abort_request("gone") is True
    collector = await run_until_idle(engine)
    assert "gone" not in collector.tokens
    assert engine.num_free_blocks() == baseline


async def test_views_show_the_waiting_heads_demand(engine):
    baseline = engine.num_free_blocks()
    # Each needs ceil(301 / 32) = 10 blocks: two fit in 23, the third must wait.
    ids = [f"big-{i}" for i in range(3)]
    for i, request_id in enumerate(ids):
        engine.add_request(make_request(request_id, random_prompt(300, seed=30 + i), max_tokens=100, ignore_eos=True))
    queued = engine.request_views()
    assert [v.request_id for v in queued] == ids
    assert all(v.phase is RequestPhase.WAITING and v.demand_blocks == 10 for v in queued)

    await engine.step()
    views = engine.request_views()
    waiting = [v for v in views if v.phase is RequestPhase.WAITING]
    running = [v for v in views if v.phase is RequestPhase.RUNNING]
    assert views[: len(waiting)] == waiting  # waiting first, head of line first
    assert [v.request_id for v in waiting] == ["big-2"]
    assert (waiting[0].demand_blocks, waiting[0].physical_blocks) == (10, 0)
    assert [v.physical_blocks for v in running] == [10, 10]
    assert engine.num_free_blocks() == baseline - 20

    for request_id in ids:
        assert engine.abort_request(request_id)
    await wait_for_free_blocks(engine, baseline)


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], {}, "prompt is empty"),
        ([5, 384], {}, "outside the vocabulary"),
        ([5, -1], {}, "outside the vocabulary"),
        ([5] * 500, {"max_tokens": 20}, "exceeds max_model_len"),
        ([5], {"max_tokens": 0}, "max_tokens"),
        ([5], {"temperature": -1.0}, "temperature"),
        ([5], {"top_p": 0.0}, "top_p"),
    ],
)
async def test_rejects_requests_it_cannot_run(engine, prompt, sampling, message):
    with pytest.raises(EngineError, match=message):
        engine.add_request(make_request("bad", prompt, **sampling))
    assert not engine.has_work()


async def test_rejects_a_duplicate_request_id(engine):
    engine.add_request(make_request("twice", random_prompt(5, seed=40), max_tokens=2))
    with pytest.raises(EngineError, match="already"):
        engine.add_request(make_request("twice", random_prompt(5, seed=40), max_tokens=2))
    collector = await run_until_idle(engine)
    assert len(collector.tokens["twice"]) <= 2
