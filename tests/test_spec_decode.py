"""Speculative decoding: drafts verified in one step keep greedy output identical to plain decoding
(with stops, logprobs, n > 1, grammars, prefix caching and preemption), rejection sampling keeps the
target's distribution exactly, rejected drafts' blocks go back to the pool, and the prompt-lookup
proposer finds what it should."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from qtk import LLM, SamplingParams
from qtk.errors import InputError
from qtk.kernels import cpu
from qtk.runtime.block_manager import BlockManager
from qtk.runtime.rejection_sampler import RejectionSampler
from qtk.runtime.sampler import Sampler
from qtk.runtime.scheduler import Scheduler, SchedulerConfig
from qtk.runtime.sequence import Sequence
from qtk.runtime.spec_decode import AdaptiveDraftLength, SpeculativeConfig, ngram_lookup
from qtk.runtime.structured_outputs import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# text that repeats, so prompt lookup finds n-grams in it and the tiny model's own loops
PROMPTS = ["one two three four five one two three four five one two three", "a b a b a b a b a b a b",
           "The cat sat on the mat. The cat sat on the", "x"]


def engines(tiny_dir, **options):
    common = {**dict(dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8), **options}
    return LLM(str(tiny_dir), **common), LLM(str(tiny_dir), speculative_config=NGRAM, **common)


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return engines(tiny_dir)


def test_ngram_lookup_takes_the_longest_latest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert ngram_lookup(tokens, 1, 3, 3) == [7, 8, 5]  # "2 3" last seen at 5-6, then 7 8 5
    assert ngram_lookup(tokens, 3, 3, 3) == []  # "5 2 3" never came before
    assert ngram_lookup(np.array([4, 4]), 1, 2, 5) == [4]  # what follows is cut at the end
    assert ngram_lookup(np.array([4]), 1, 1, 5) == []


def test_config_takes_vllms_names_and_refuses_what_it_does_not_know(tiny_dir):
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig.parse({"prompt_lookup_max": 4}).prompt_lookup_min == 4
    for bad in ({"method": "eagle"}, {"num_speculative_tokens": 0}, {"prompt_lookup_min": 4, "prompt_lookup_max": 2},
                {"draft_tensor_parallel_size": 1}, "ngram"):
        with pytest.raises(InputError):
            SpeculativeConfig.parse(bad)


def test_the_draft_length_follows_the_acceptance_rate_and_the_cost():
    lengths = AdaptiveDraftLength(max_k=8, cost_per_token=0.1)
    start = lengths.length(0)
    for _ in range(20):
        lengths.update(0, 8, 8)  # every draft kept
        lengths.update(1, 8, 0)  # none kept
        lengths.update(2, 8, 6)  # 6 of 8 kept, then one rejected: a rate of 6/7
    assert lengths.length(0) == 8 and 1 < start < 8 and lengths.length(2) >= 6
    probes = [i + 1 for i in range(64) if lengths.length(1)]
    assert probes == [8, 16, 32, 64]  # none pays: a probe now and then, ever more seldom
    lengths.cost_per_token = 0.5  # a draft costs half a step (a draft model): fewer drafts pay
    assert 1 < lengths.length(2) < 6


@pytest.mark.parametrize("n", [1, 2])
def test_greedy_output_is_plain_decodings_and_drafts_were_kept(pair, n):
    plain, spec = pair
    params = SamplingParams(max_tokens=40, temperature=0, n=n, ignore_eos=True, logprobs=2)
    want, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    for a, b in zip(want, got):
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids and y.text == x.text and y.finish_reason == x.finish_reason
            assert len(y.logprobs) == len(x.logprobs) == 40
            for lx, ly in zip(x.logprobs, y.logprobs):
                assert lx.keys() == ly.keys()
                np.testing.assert_allclose(list(ly.values()), list(lx.values()), atol=1e-4)
    stats = spec.stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens


def test_stops_cut_the_kept_drafts_where_plain_decoding_stops(pair):
    plain, spec = pair
    free = plain.generate(PROMPTS[:3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for out in free:  # a stop string and a stop token from the middle of each output
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        for params in (SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[text[len(text) // 2:][:3]]),
                       SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[ids[17]]),
                       SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)):
            a = plain.generate(out.prompt_token_ids, params)[0].outputs[0]
            b = spec.generate(out.prompt_token_ids, params)[0].outputs[0]
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)


def test_grammar_outputs_and_preemption_and_prefix_caching(tiny_dir):
    """A JSON schema (the grammar checks the drafts), a pool small enough to preempt, and prompts that
    share a prefix: the same tokens as plain decoding."""
    per_token = 2 * 2 * 2 * 16 * 4  # layers x K,V x kv heads x head dim x float32 bytes (interop.TINY)
    plain, spec = engines(tiny_dir, kv_cache_memory=48 * 8 * per_token)
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    shared = " ".join(["lorem ipsum dolor"] * 12)
    prompts = [shared + " sit", shared + " amet", shared + " elit"] + PROMPTS
    for params in (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0,
                                  structured_outputs=StructuredOutputsParams(json=schema))):
        want, got = plain.generate(prompts, params), spec.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.stats().num_preemptions > 0 and spec.stats().prefix_cache_hits > 0
    assert spec.stats().spec_decode.num_accepted_tokens > 0


def test_rejected_drafts_give_their_blocks_back():
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    seq = Sequence(list(range(6)), block_size=4)
    sched.add(seq)
    sched.finish_step(sched.schedule(), {seq.seq_id: 6})  # the prompt, then token 6
    seq.spec_token_ids = [7, 8, 9, 10, 11, 12]
    batch = sched.schedule()
    assert batch.num_tokens == [7] and len(seq.block_table) == 4  # positions 6..12
    sched.finish_step(batch, {seq.seq_id: [7, 99]})  # draft 7 kept, 8 rejected: 99 instead
    assert seq.token_ids[-3:] == [6, 7, 99] and seq.num_computed_tokens == 8
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 13  # 9 tokens: 3 blocks; the 4th back


def rows_with(p: list[float]) -> torch.Tensor:
    return torch.tensor(p).log()


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_sampling_keeps_the_targets_distribution(top_k):
    """Two rows of a 5-token vocabulary and a draft: the first token is distributed as the target's
    first row (after temperature and top-k), and after a kept draft the second as its second row."""
    p0, p1 = [0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.1, 0.2, 0.3]
    rows = torch.stack([rows_with(p0), rows_with(p1)]) * 2  # at temperature 2: p0, p1 again
    sampler = RejectionSampler(Sampler())
    seq = Sequence([0], SamplingParams(temperature=2.0, top_k=top_k, seed=0))
    seq.spec_token_ids = [2]
    n, first, second = 40000, np.zeros(5), np.zeros(5)
    for _ in range(n):
        tokens = sampler(rows, seq)
        first[tokens[0]] += 1
        if tokens[0] == 2:
            assert len(tokens) == 2
            second[tokens[1]] += 1
        else:
            assert len(tokens) == 1
    want0 = np.array([0, 0.4, 0.2, 0.25, 0]) / 0.85 if top_k else np.array(p0)  # top-3 of each row
    want1 = np.array([0.3, 0, 0, 0.2, 0.3]) / 0.8 if top_k else np.array(p1)
    for counts, want in ((first, want0), (second, want1)):
        freq = counts / counts.sum()
        se = np.sqrt(want * (1 - want) / counts.sum()) + 1e-9
        assert np.all(np.abs(freq - want) < 5 * se + 1e-12), (freq, want)


def test_sampled_outputs_stay_valid_under_a_grammar_and_seeds_repeat(pair):
    _, spec = pair
    schema = {"type": "object", "properties": {"k": {"type": "array", "items": {"type": "integer"}}},
              "required": ["k"]}
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=3,
                            structured_outputs=StructuredOutputsParams(json=schema))
    import json

    outs = spec.generate(PROMPTS, params)
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text)["k"], list)
    again = spec.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_the_cli_refuses_a_malformed_speculative_config(tiny_dir):
    from click.testing import CliRunner

    from qtk.cli import main

    for bad in ("{not json", "[1]", '{"method": "medusa"}'):
        r = CliRunner().invoke(main, ["generate", str(tiny_dir), "--prompt", "hi", "--speculative-config", bad])
        assert r.exit_code == 2, r.output
        assert "speculative" in r.output.lower(), r.output


def test_a_server_with_speculation_streams_what_it_answers_and_counts_the_drafts(tiny_dir):
    """Several tokens in one step reach a stream as one chunk: the chunks reassemble to the whole
    answer, the logprobs stay one per token, and /metrics has vLLM's spec_decode counters."""
    import re

    import httpx
    from openai import OpenAI
    from serving import serving

    from qtk.runtime.async_engine import AsyncLLM

    engine = AsyncLLM(LLM(str(tiny_dir), dtype="float32", max_model_len=128, kv_cache_memory=2**21, block_size=8,
                          speculative_config=NGRAM))
    with serving(engine, "tiny") as running:
        client = OpenAI(base_url=running[0] + "/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
        full = client.completions.create(**kw).choices[0]
        chunks = list(client.completions.create(**kw, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text
        assert len(full.logprobs.tokens) == 30
        text = httpx.get(running[0] + "/metrics").text
        drafts = float(re.search(r"^qtk:spec_decode_num_draft_tokens_total (\S+)$", text, re.M)[1])
        kept = float(re.search(r"^qtk:spec_decode_num_accepted_tokens_total (\S+)$", text, re.M)[1])
        assert 0 < kept <= drafts
        assert re.search(r'^qtk:spec_decode_num_accepted_tokens_per_pos_total\{position="0"\} ', text, re.M)


def test_blocks_filled_by_kept_drafts_enter_the_prefix_cache(tiny_dir):
    """A prompt that repeats a speculative answer finds its blocks cached, those the kept drafts
    filled included: the hash of each block is of its real tokens."""
    _, spec = engines(tiny_dir)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    out = spec.generate(PROMPTS[1], params)[0]
    assert spec.stats().spec_decode.num_accepted_tokens > 16  # drafts kept past a block or two
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    before = spec.stats().prefix_cache_hits
    spec.generate(ids + [5], SamplingParams(max_tokens=1))
    assert spec.stats().prefix_cache_hits - before == (len(ids) - 1) // 8 * 8  # every full block but the last


@pytest.mark.parametrize("draft", ["self", "self-quantized"])
def test_a_draft_model_keeps_greedy_output_and_its_cache_follows_the_target(tiny_dir, draft):
    """The target drafting for itself keeps nearly every draft; its int4 twin keeps some and has others
    rejected (the draft's shadows roll back); the text is plain decoding's either way, for several
    sequences in one batch, with a pool small enough that the target preempts."""
    per_token = 2 * 2 * 2 * 16 * 4
    plain = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=64 * 8 * per_token, block_size=8)
    spec = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=64 * 8 * per_token, block_size=8,
               speculative_config={"model": str(tiny_dir) if draft == "self" else draft, "num_speculative_tokens": 4})
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = PROMPTS + ["Once upon a time", "Numbers: 1, 2, 3,"] * 2
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = spec.stats().spec_decode
    assert stats.num_drafts > 0
    if draft == "self":
        assert stats.acceptance_rate > 0.95
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert not spec.spec.draft.shadows  # every finished sequence's shadow is gone
    assert spec.spec.draft.bm.num_free_blocks == spec.spec.draft.bm.num_blocks


def test_the_twin_is_int4_and_a_draft_must_share_the_tokenizer(tiny_dir, tiny_llama):
    from types import SimpleNamespace

    from qtk.quant_linear import QuantLinear
    from qtk.runtime.config import EngineConfig
    from qtk.runtime.draft_model import load_draft, quantized_twin

    twin = quantized_twin(tiny_llama())
    kinds = {type(m).__name__ for n, m in twin.named_modules() if n.endswith("_proj")}
    assert kinds == {"QuantLinear"} and isinstance(twin.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(twin.lm_head, QuantLinear) and type(twin.model.embed_tokens) is torch.nn.Embedding
    spec = SpeculativeConfig.parse({"model": str(tiny_dir)})
    with pytest.raises(InputError, match="tokenizer"):
        load_draft(spec, EngineConfig(str(tiny_dir)), torch.float32, 256, SimpleNamespace(get_vocab=lambda: {"a": 0}))
    with pytest.raises(InputError, match="context"):
        from transformers import AutoTokenizer

        load_draft(spec, EngineConfig(str(tiny_dir)), torch.float32, 4096, AutoTokenizer.from_pretrained(tiny_dir))


def test_verifying_many_drafts_keeps_the_numerics_of_a_plain_decode_step(tiny_dir, tmp_path):
    """A bf16 checkpoint run in float32: a plain batch-1 step multiplies in float32, while a step of
    5+ rows would round x to bf16 (packed_linear.BF16_DOT_ROWS, where the CPU has AVX512-BF16). A step
    verifying 7 drafts keeps the plain step's kernels (numerics_of) and attends each token in the decode
    kernel: each row's logits are those of the decode step at its position (to the bit where the kernel's
    gemv takes 8 rows), and the greedy text is plain decoding's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qtk.runtime.scheduler import Batch

    config = AutoConfig.from_pretrained(tiny_dir)
    # every layer past packed_linear.SMALL_FLOAT: qtk's kernels (F.linear's sums depend on the rows)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    common = dict(dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8)
    plain = LLM(str(tmp_path), **common)
    runner, ids = plain.runner, list(range(1000, 1060))

    def primed(n: int) -> Sequence:
        seq = Sequence(ids[:n], block_size=8)
        seq.block_table = list(range(9))
        runner.run(Batch([seq], [n]))
        seq.num_computed_tokens = n - 1
        return seq

    seq, decoded = primed(50), []
    for j in range(8):  # one token a step
        decoded.append(runner.run(Batch([seq], [1]))[0][0])
        seq.token_ids.append(ids[50 + j])
        seq.num_computed_tokens += 1
    seq = primed(50)
    seq.spec_token_ids = ids[50:57]
    verified = runner.run(Batch([seq], [8]))[0]
    lib = cpu.ops()
    if lib is not None and lib.compiled_avx512():  # 8 rows in the gemv, whose rows sum alone: to the bit
        assert torch.equal(verified, torch.stack(decoded))
    else:  # the avx2 build multiplies 6+ rows of a bf16 layer in decoded slices: another order of sums
        torch.testing.assert_close(verified, torch.stack(decoded), atol=1e-4, rtol=0)
    spec = LLM(str(tmp_path), speculative_config={"model": str(tmp_path), "num_speculative_tokens": 7}, **common)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        assert spec.generate(prompt, params)[0].outputs[0].token_ids == plain.generate(prompt, params)[0].outputs[0].token_ids


def test_sampling_with_a_draft_model_keeps_the_targets_distribution_end_to_end(tiny_dir):
    """3000 sampled continuations (temperature 0.5, top-k 3) with the target drafting for itself, a draft
    at the second token of each: the joint distribution of the first two tokens is the target's,
    p(t1) p(t2 | t1), within 5 standard errors in every cell."""
    common = dict(dtype="float32", max_model_len=64, kv_cache_memory=2**24, block_size=8)
    spec = LLM(str(tiny_dir), speculative_config={"model": str(tiny_dir), "num_speculative_tokens": 1}, **common)
    spec.spec.observe = lambda *a: None  # every step drafts (the measured cost would stop a self-draft)
    spec.spec.lengths.cost_per_token = 0.0
    prompt = spec.prompt_ids("The cat sat on")
    params = SamplingParams(max_tokens=3, temperature=0.5, top_k=3, n=250, ignore_eos=True)
    torch.manual_seed(0)
    outs = [o for r in spec.generate([prompt] * 12, params) for o in r.outputs]
    stats = spec.stats().spec_decode
    assert stats.num_drafts >= 3000 and 0 < stats.num_accepted_tokens < stats.num_drafts

    def target(ids: list[int]) -> dict[int, float]:  # the target's top-3 distribution at temperature 0.5
        row = spec.prompt_log_probs([ids + [0]])[0][-1]
        top = torch.topk(row, 3)
        p = torch.softmax(top.values.double() / 0.5, -1)
        return dict(zip(top.indices.tolist(), p.tolist()))

    first = target(prompt)
    want = {(a, b): pa * pb for a, pa in first.items() for b, pb in target(prompt + [a]).items()}
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        key = tuple(o.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(want)
    n = len(outs)
    for cell, p in want.items():
        se = (p * (1 - p) / n) ** 0.5
        assert abs(counts.get(cell, 0) / n - p) < 5 * se + 1e-9, (cell, counts.get(cell, 0) / n, p)


def test_drafts_share_a_small_step_budget_with_chunked_prefills(tiny_dir):
    """A 12-token step budget: prompts prefill in chunks while other sequences decode with drafts (each
    decode's drafts cut to what the budget leaves); the text is plain decoding's."""
    plain, spec = engines(tiny_dir, max_num_batched_tokens=12)
    prompts = [" ".join(["lorem ipsum"] * 20), *PROMPTS, " ".join(["dolor sit amet"] * 15)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.stats().spec_decode.num_accepted_tokens > 0
