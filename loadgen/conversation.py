"""A seeded synthetic long-prompt multi-turn conversation workload.

Shaped like long-context chat traffic (Mooncake's conversation traces): each session opens
with a long context (a document or system prompt plus the first question), and every further
turn re-sends the whole conversation so far — the previous prompt, the previous answer and a
new question — so prompts grow turn by turn (well past 8k tokens: an instance's maximum
sequence length cuts them, as it cuts a trace's). Sessions start as a Poisson process; a turn
follows the previous one after the answer's expected generation time plus a think time, so
many sessions overlap and many long prefills run at once.

Each request carries its arrival time (`timestamp_s`: replay with `--trace-timestamps`,
rescaled to `--rate` when one is given) and Mooncake-style `hash_ids` (512-token prefix blocks,
one id sequence per session), so a session's turns share their common prefix in `loadgen run`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.records import RequestSpec

PREFIX_BLOCK_TOKENS = 512  # as loadgen.datasets (Mooncake's hash block)


@dataclass(frozen=True)
class ConversationProfile:
    """Lengths in tokens, times in seconds; lognormal lengths are given by their median."""

    context_median: float  # first turn's context (document/system prompt + first question)
    context_sigma: float
    question_median: float  # each later turn's new user message
    question_sigma: float
    answer_median: float  # output length of every turn
    answer_sigma: float
    answer_cap: int
    mean_turns: float  # geometric, at least 1
    max_turns: int
    session_rate: float  # sessions started per second (before any --rate rescaling)
    think_mean_s: float  # user's pause after an answer (exponential)
    decode_s_per_token: float  # expected answer time, to place the next turn after it


PROFILES: dict[str, ConversationProfile] = {
    # Long contexts, several turns: prompts reach 8k tokens after a few turns.
    "long": ConversationProfile(
        context_median=2500, context_sigma=0.6, question_median=120, question_sigma=0.8,
        answer_median=220, answer_sigma=0.7, answer_cap=1024, mean_turns=4.0, max_turns=12,
        session_rate=1.0, think_mean_s=15.0, decode_s_per_token=0.04,
    ),
}


def generate_conversations(profile: ConversationProfile, num_requests: int, seed: int) -> list[RequestSpec]:
    """`num_requests` turns in arrival order, deterministic in `seed`."""
    rng = np.random.default_rng([seed, 7])
    turns: list[tuple[float, int, int, int, int]] = []  # (time, session, turn, input, output)
    block_ids: dict[int, int] = {}  # session -> first hash id of its blocks
    next_block = 0
    start = 0.0
    session = 0
    horizon = float("inf")  # the N-th arrival so far: a session starting after it adds none
    while len(turns) < num_requests or start < horizon:
        start += rng.exponential(1.0 / profile.session_rate)
        num_turns = min(int(rng.geometric(1.0 / profile.mean_turns)), profile.max_turns)
        prompt = max(int(rng.lognormal(np.log(profile.context_median), profile.context_sigma)), 16)
        block_ids[session] = next_block
        next_block += 1 + 64  # room for a session's blocks (prompts are cut long before 64 × 512)
        at = start
        for turn in range(num_turns):
            answer = min(max(int(rng.lognormal(np.log(profile.answer_median), profile.answer_sigma)), 1),
                         profile.answer_cap)
            turns.append((at, session, turn, prompt, answer))
            question = max(int(rng.lognormal(np.log(profile.question_median), profile.question_sigma)), 1)
            at += answer * profile.decode_s_per_token + rng.exponential(profile.think_mean_s)
            prompt += answer + question
        session += 1
        if len(turns) >= num_requests:
            horizon = sorted(t[0] for t in turns)[num_requests - 1]
    # Turns of different sessions interleave: the first N arrivals, in time order.
    turns.sort(key=lambda t: (t[0], t[1], t[2]))
    out = []
    for at, session, turn, prompt, answer in turns[:num_requests]:
        first = block_ids[session]
        blocks = tuple(range(first, first + min(-(-prompt // PREFIX_BLOCK_TOKENS), 64)))
        out.append(RequestSpec(prompt, answer, timestamp_s=at, hash_ids=blocks, source_id=f"s{session}t{turn}"))
    t0 = out[0].timestamp_s if out else 0.0
    return [RequestSpec(r.input_len, r.output_len, timestamp_s=r.timestamp_s - t0, hash_ids=r.hash_ids,
                        source_id=r.source_id) for r in out]
