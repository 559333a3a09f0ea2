"""The scheduler with no model: a fake next-token function of the whole prefix stands in for the
forward, so any scheduling mistake (a token computed twice or skipped, a lost request, a wrong
recompute after preemption) changes the generated text."""
from __future__ import annotations

import random

import pytest

from qtk.runtime.block_manager import BlockManager
from qtk.runtime.scheduler import Scheduler, SchedulerConfig
from qtk.runtime.sequence import Sequence, Status


def fake_next(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97


def run(prompts, max_tokens, num_blocks=512, block_size=4, budget=64, max_num_seqs=8, check=None, arrive=None,
        per_decode=0, max_step=0):
    """Drive the scheduler to the end with fake_next as the model; prompt i arrives at step
    arrive[i] (default 0). Returns the generated tokens, the scheduler and the sequences."""
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      prompt_tokens_per_decode=per_decode, max_step_tokens=max_step), bm)
    budget = max(budget, max_step)
    seqs = [Sequence(p, block_size=block_size) for p in prompts]
    arrive = arrive or [0] * len(seqs)
    steps = 0
    while steps <= max(arrive) or sched.has_unfinished():
        for s, at in zip(seqs, arrive):
            if at == steps:
                sched.add(s)
        batch = sched.schedule()
        assert batch.total_tokens <= budget and len(sched.running) <= max_num_seqs
        if check:
            check(sched, batch, seqs)
        sampled = {s.seq_id: fake_next(s.token_ids) for i, s in enumerate(batch.seqs) if batch.samples(i)}
        sched.finish_step(batch, sampled)
        for s in list(sched.running):
            if s.num_generated_tokens >= max_tokens:
                sched.finish(s)
        steps += 1
        assert steps < 10_000
    assert bm.num_free_blocks == bm.num_blocks
    return [s.generated_token_ids for s in seqs], sched, seqs


def expected(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_next(tokens))
    return tokens[len(prompt):]


PROMPTS = [[random.Random(i).randrange(97) for _ in range(n)] for i, n in enumerate([5, 37, 3, 120, 16, 64, 9, 200, 1, 50])]


def test_every_request_gets_exactly_the_tokens_of_one_at_a_time_decoding():
    out, _, _ = run(PROMPTS, max_tokens=12)
    assert out == [expected(p, 12) for p in PROMPTS]


def test_a_tiny_pool_preempts_and_recomputes_without_losing_or_changing_anything():
    def first_come_first_served(sched, batch, seqs):  # the preempted go back to the front of the queue
        assert [s.seq_id for s in sched.waiting] == sorted(s.seq_id for s in sched.waiting)

    out, sched, _ = run(PROMPTS, max_tokens=12, num_blocks=70, budget=32, check=first_come_first_served)
    assert sched.num_preemptions > 0
    assert out == [expected(p, 12) for p in PROMPTS]


def test_small_chunks_and_prefix_sharing_change_nothing():
    shared = PROMPTS[7][:96]
    prompts = [shared + p for p in PROMPTS]
    out, sched, _ = run(prompts, max_tokens=6, budget=7, max_num_seqs=3)
    assert out == [expected(p, 6) for p in prompts]
    assert sched.bm.prefix_hits >= 96 * 5  # later requests reuse the shared prompt's blocks


def test_prefix_cache_metrics_count_each_admission_once():
    """A request that waits many steps for room is looked up at each try, but counted once: when
    it is admitted, with the tokens it was admitted with."""
    shared = list(range(40))
    prompts = [shared + [90 + i] for i in range(4)]
    _, sched, _ = run(prompts, max_tokens=8, num_blocks=24, budget=64, max_num_seqs=4)
    if sched.num_preemptions == 0:
        assert sched.bm.prefix_queries == sum(map(len, prompts))
    assert sched.bm.prefix_queries <= sum(map(len, prompts)) + sched.num_preemptions * (41 + 8)
    assert 0 < sched.bm.prefix_hits <= sched.bm.prefix_queries


def test_decodes_go_first_and_a_long_prompt_is_chunked_around_them():
    """A 300-token prompt arrives while two requests decode: every step still decodes both, and
    the prompt goes in chunks of what the 16-token budget leaves."""
    chunks = []

    def check(sched, batch, seqs):
        long_seq = seqs[2]
        decoding = [s for s in sched.running if not s.is_prefill]
        assert all(s in batch.seqs for s in decoding), "a running decode was left out of a step"
        if long_seq in batch.seqs and long_seq.is_prefill:
            chunks.append((batch.num_tokens[batch.seqs.index(long_seq)], len(decoding)))

    prompts = [[1, 2, 3], [4, 5], [7] * 300]
    out, _, _ = run(prompts, max_tokens=40, budget=16, check=check, arrive=[0, 0, 2])
    assert out == [expected(p, 40) for p in prompts]
    assert sum(c for c, _ in chunks) == 300 and len(chunks) > 300 // 16
    assert all(c + d <= 16 for c, d in chunks) and any(d == 2 for _, d in chunks)


def test_the_budget_grows_with_the_decodes():
    """With prompt_tokens_per_decode, a step under d decodes spends max(base, per_decode x d) tokens at
    most, capped: a long prompt arriving behind many decodes gets the chunk that leaves, not the few tokens
    a fixed budget would; the text is still one-at-a-time decoding's."""
    chunks = []

    def check(sched, batch, seqs):
        d = sum(1 for s in batch.seqs if not s.is_prefill)
        assert batch.total_tokens <= sched.config.budget(d)
        long_seq = seqs[-1]
        if long_seq in batch.seqs and long_seq.is_prefill:
            chunks.append((batch.num_tokens[batch.seqs.index(long_seq)], d))

    prompts = [[i, i + 1] for i in range(6)] + [[7] * 300]
    out, sched, _ = run(prompts, max_tokens=30, budget=8, per_decode=4, max_step=20, check=check,
                        arrive=[0] * 6 + [3])
    assert out == [expected(p, 30) for p in prompts]
    assert sum(c for c, _ in chunks) == 300
    assert all(c == min(max(8, 4 * d), 20) - d for c, d in chunks[:-1])  # every chunk but the last is full
    assert any(d == 6 and c == 14 for c, d in chunks)  # 6 decodes: a 24-token budget capped at 20
    assert [sched.config.budget(d) for d in (0, 1, 2, 3, 4, 5, 6)] == [8, 8, 8, 12, 16, 20, 20]
    with pytest.raises(ValueError, match="max_step_tokens"):
        SchedulerConfig(max_num_batched_tokens=64, prompt_tokens_per_decode=4, max_step_tokens=32)


def test_the_engine_grows_its_cpu_budget_only_by_default():
    """The CPU default: 512 tokens a step, 32 more per decode up to 2048; a max_num_batched_tokens the caller
    gives is fixed, and CUDA's default too."""
    from qtk.runtime.config import EngineConfig

    grows = EngineConfig("m").scheduler_config(4096)
    assert [grows.budget(d) for d in (0, 16, 17, 64, 256)] == [512, 512, 544, 2048, 2048]
    fixed = EngineConfig("m", max_num_batched_tokens=256).scheduler_config(4096)
    assert [fixed.budget(d) for d in (0, 64, 256)] == [256, 256, 256]
    cuda = EngineConfig("m", device="cuda").scheduler_config(4096)
    assert [cuda.budget(d) for d in (0, 256, 1024)] == [8192, 8192, 8192]


def test_max_num_seqs_and_first_come_first_served():
    order = []

    def check(sched, batch, seqs):
        for s in batch.seqs:
            if s.seq_id not in order:
                order.append(s.seq_id)
        assert len(sched.running) <= 2

    prompts = [[i] * (40 if i == 1 else 3) for i in range(6)]
    out, _, _ = run(prompts, max_tokens=4, max_num_seqs=2, num_blocks=12, check=check)
    assert order == sorted(order)  # admitted in arrival order, the big one (second) not overtaken
    assert out == [expected(p, 4) for p in prompts]


def test_abort_frees_everything_at_once():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    a, b = Sequence(list(range(30)), block_size=4), Sequence(list(range(50, 60)), block_size=4)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.finish_step(batch, {s.seq_id: 1 for i, s in enumerate(batch.seqs) if batch.samples(i)})
    assert bm.num_free_blocks < 64
    sched.finish(a)
    sched.finish(b)
    assert bm.num_free_blocks == 64 and not sched.has_unfinished() and a.status is Status.FINISHED


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least 1"):
        SchedulerConfig(max_num_batched_tokens=0)
