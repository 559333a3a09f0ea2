"""The runtime against transformers (the referee): packed ragged batches over the paged KV cache
give transformers' logits for each family, and the engine's greedy text is transformers'."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from interop import TINY
from qtk.runtime.block_manager import BlockManager
from qtk.runtime.model_runner import ModelRunner
from qtk.runtime.models.native import NativeModel
from qtk.runtime.scheduler import Scheduler, SchedulerConfig
from qtk.runtime.sequence import Sequence


def hf_model(family: str, **overrides):
    import transformers

    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}
    torch.manual_seed(0)
    cfg = getattr(transformers, cls[0])(**{**TINY, **extra, **overrides})
    model = getattr(transformers, cls[1])(cfg).eval()
    if family == "qwen2":  # its q/k/v carry biases: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model


def greedy_through_runtime(model, prompts, new_tokens, budget=7, num_blocks=64, block_size=4, backend=None,
                           runtime=NativeModel, **kv):
    """Greedy decoding through scheduler + runner (attention `backend`, or the device's), recording
    the logits of every sampling step. runtime: the runtime model class (or one built already);
    kv: the runner's kv_dtype and kv_scales."""
    runtime = runtime(model) if isinstance(runtime, type) else runtime
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), bm)
    runner = ModelRunner(runtime, num_blocks, block_size, attention_backend=backend, **kv)
    seqs = [Sequence(p, block_size=block_size) for p in prompts]
    for s in seqs:
        sched.add(s)
    logits = {s.seq_id: [] for s in seqs}
    while sched.has_unfinished():
        batch = sched.schedule()
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        out, _ = runner.run(batch)
        for s, row in zip(sampling, out):
            logits[s.seq_id].append(row)
        sched.finish_step(batch, {s.seq_id: int(row.argmax()) for s, row in zip(sampling, out)})
        for s in list(sched.running):
            if s.num_generated_tokens >= new_tokens:
                sched.finish(s)
    return seqs, logits, sched


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_packed_paged_forward_matches_transformers(family):
    """Prompts of 1..23 tokens, prefills chunked by a 7-token budget beside decodes, a 4-token
    block: every sampling step's logits equal transformers' at that position."""
    model = hf_model(family)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 1, 9, 4)]
    seqs, logits, _ = greedy_through_runtime(model, prompts, new_tokens=6)
    for s in seqs:
        with torch.no_grad():
            ref = model(torch.tensor([s.token_ids])).logits[0]
        got = torch.stack(logits[s.seq_id])
        want = ref[s.num_prompt_tokens - 1:len(s) - 1]  # the positions that produced each new token
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert s.generated_token_ids == want.argmax(-1).tolist()


def test_preemption_and_prefix_sharing_keep_the_logits():
    """A pool too small for all at once (preemption, recompute) and prompts sharing a prefix
    (prefix-cache hits): same tokens as with a big pool."""
    model = hf_model("llama")
    shared = list(range(40, 60))
    prompts = [shared + [i, i + 1] for i in range(5)]
    big, _, _ = greedy_through_runtime(model, prompts, new_tokens=8, budget=64, num_blocks=256)
    small, _, sched = greedy_through_runtime(model, prompts, new_tokens=8, budget=16, num_blocks=14)
    assert sched.num_preemptions > 0 and sched.bm.prefix_hits > 0
    assert [s.generated_token_ids for s in small] == [s.generated_token_ids for s in big]


def test_engine_greedy_equals_transformers_generate(tiny_dir):
    from transformers import AutoModelForCausalLM

    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8,
              max_num_batched_tokens=20)
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    prompts = ["Hello there", "The capital of France is a city that", "a"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                            do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == llm.tokenizer.decode(want, skip_special_tokens=True)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_engine_input_errors(tiny_dir):
    from qtk import LLM, SamplingParams
    from qtk.errors import InputError

    llm = LLM(str(tiny_dir), max_model_len=64, kv_cache_memory=2**22)
    with pytest.raises(InputError, match="the prompt is empty"):
        llm.add_request([])
    with pytest.raises(InputError, match="the prompt has 70 tokens; max_model_len is 64"):
        llm.add_request([5] * 70)
    with pytest.raises(InputError, match="max_tokens must be at least 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InputError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(InputError, match="seed must fit in 64 bits"):  # torch's generator would fail in a step
        SamplingParams(seed=2 ** 70)
    with pytest.raises(InputError, match="top_k must be an integer, got 2.5"):  # so would topk()
        SamplingParams(top_k=2.5)
    with pytest.raises(InputError, match="temperature must be a number, got '1'"):
        SamplingParams(temperature="1")
    with pytest.raises(InputError, match="temperature must be finite, got inf"):
        SamplingParams(temperature=float("inf"))
    assert SamplingParams(n=np.int64(2), stop_token_ids=[np.int32(7)]) == SamplingParams(n=2, stop_token_ids=[7])
    with pytest.raises(InputError, match="holds .* tokens, fewer than max_model_len 256"):
        LLM(str(tiny_dir), max_model_len=256, kv_cache_memory=2**14)
    V = llm.vocab_size
    with pytest.raises(InputError, match=f"token id {V} \\(position 1 of the prompt\\) is outside this model's "
                                         f"vocabulary: ids run from 0 to {V - 1}"):
        llm.generate([[1, 2], [1, V, 3]])  # would fail inside a step, with the batch's other requests
    assert not llm.has_unfinished_requests()  # all or nothing: [1, 2] was let go
    with pytest.raises(InputError, match="outside this model's vocabulary"):
        llm.add_request({"prompt_token_ids": [-1]})
    with pytest.raises(InputError, match="position 1 of the prompt holds 2.5"):
        llm.add_request([1, 2.5])
    with pytest.raises(InputError, match="a prompt dict needs 'prompt'"):
        llm.generate({"text": "hi"})
    with pytest.raises(InputError, match=f"stop_token_ids: token ids \\[{V}\\] are outside"):  # min_tokens masks them by id
        llm.generate([[1, 2]], SamplingParams(min_tokens=2, stop_token_ids=[V]))
    with pytest.raises(InputError, match=f"logit_bias: token ids \\[{V}\\] are outside"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={V: 1.0}))
    with pytest.raises(InputError, match="logit_bias values must be finite numbers"):
        SamplingParams(logit_bias={5: float("nan")})
    with pytest.raises(InputError, match="logit_bias token id must be an integer, got '5'"):
        SamplingParams(logit_bias={"5": 1.0})
    with pytest.raises(InputError, match="logprobs=21 is more than max_logprobs=20"):
        llm.generate([[1, 2]], SamplingParams(logprobs=21))
    with pytest.raises(InputError, match="prompt_logprobs=21 is more than max_logprobs=20"):
        llm.generate([[1, 2]], SamplingParams(prompt_logprobs=21))
    with pytest.raises(InputError, match="n=300 is more than max_num_seqs=256"):
        llm.generate([[1, 2]], SamplingParams(n=300))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))  # and it goes on serving
    assert len(out[0].outputs[0].token_ids) <= 3
    same = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0))
    assert same[0].outputs[0].token_ids == out[0].outputs[0].token_ids  # vLLM's prompt dicts
    text = llm.generate({"prompt": "Hello"}, SamplingParams(max_tokens=2, temperature=0))
    assert text[0].prompt_token_ids == llm.tokenizer("Hello").input_ids
    with pytest.raises(InputError, match="3 prompts but 2 sampling params"):  # not 2 outputs for 3 prompts
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])
    with pytest.raises(InputError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": "Hello", "cache_salt": ""})


def test_request_ids_are_never_shared(tiny_dir):
    """A given id already running is refused (it would orphan the first request, which then never
    ends); a generated id skips the ids given by hand."""
    from qtk import LLM, SamplingParams
    from qtk.errors import InputError

    llm = LLM(str(tiny_dir), max_model_len=64, kv_cache_memory=2**22)
    params = SamplingParams(max_tokens=3, temperature=0)
    assert llm.add_request([1, 2], params, request_id="1") == "1"
    with pytest.raises(InputError, match="request id '1' is already running"):
        llm.add_request([3, 4], params, request_id="1")
    ids = [llm.add_request([3, 4], params) for _ in range(3)]
    assert "1" not in ids and len(set(ids)) == 3
    done = {}
    for _ in range(20):
        for out in llm.step():
            assert out.error is None
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == sorted(["1", *ids]) and not llm.has_unfinished_requests()


def test_cache_salt_keeps_tenants_apart(tiny_dir):
    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), max_model_len=128, kv_cache_memory=2**22, block_size=4)
    prompt = list(range(5, 30))
    params = SamplingParams(max_tokens=2, temperature=0)
    first = llm.generate({"prompt_token_ids": prompt, "cache_salt": "a"}, params)[0]
    hits = llm.block_manager.prefix_hits
    other = llm.generate({"prompt_token_ids": prompt, "cache_salt": "b"}, params)[0]
    assert llm.block_manager.prefix_hits == hits  # another tenant's blocks are not found
    same = llm.generate({"prompt_token_ids": prompt, "cache_salt": "a"}, params)[0]
    assert llm.block_manager.prefix_hits == hits + 24  # the same tenant's are
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids


def test_logit_bias_is_added_before_the_choice(tiny_dir):
    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), max_model_len=128, kv_cache_memory=2**22)
    kw = dict(max_tokens=6, temperature=0, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], SamplingParams(**kw))[0].outputs[0].token_ids
    banned = llm.generate([[5, 6, 7]], SamplingParams(**kw, logit_bias={plain[0]: -100}))[0].outputs[0].token_ids
    assert plain[0] not in banned
    forced = llm.generate([[5, 6, 7]], SamplingParams(**kw, logit_bias={42: 100}))[0].outputs[0].token_ids
    assert forced == [42] * 6
    sampled = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                                                       logit_bias={42: 100}))
    assert sampled[0].outputs[0].token_ids == [42] * 6
    logged = llm.generate([[5, 6, 7]], SamplingParams(**kw, logprobs=0, logit_bias={42: 100}))[0].outputs[0]
    assert logged.logprobs[0][42] < -1  # logprobs are the model's own, before the bias (as vLLM reports them)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_dir):
    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), max_model_len=128, kv_cache_memory=2**22)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate(["tell me"], p)[0].outputs[0].token_ids
    busy = llm.generate(["x y z", "tell me", "another prompt"],
                        [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True), p,
                         SamplingParams(max_tokens=5, temperature=0.5, ignore_eos=True)])
    assert busy[1].outputs[0].token_ids == alone
    three = llm.generate(["tell me"], SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3, ignore_eos=True))
    choices = [c.token_ids for c in three[0].outputs]
    assert len({tuple(c) for c in choices}) == 3  # choice i draws from seed + i, as in vLLM
    again = llm.generate(["tell me"], SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))
    assert again[0].outputs[0].token_ids == choices[1]


@pytest.mark.parametrize("extreme", [dict(top_p=1e-300), dict(temperature=1e-40), dict(temperature=1e-320),
                                     dict(repetition_penalty=1e-40, temperature=1.0), dict(min_tokens=2, temperature=1e-40),
                                     dict(top_p=1e-46, min_p=1.0)])
def test_extreme_sampling_values_draw_a_token_and_the_engine_goes_on(tiny_dir, extreme):
    """Values in range whose arithmetic overflows float32 (a tiny temperature, top_p or repetition
    penalty) used to leave torch.multinomial no distribution, fail the step and stop the engine."""
    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), max_model_len=128, kv_cache_memory=2**22)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, **extreme))
    assert len(out[0].outputs[0].token_ids) == 4
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    if "repetition_penalty" not in extreme and "min_tokens" not in extreme:  # tiny temperature / top_p: the argmax
        assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize("penalty", [1e38, 1e39, 1e300])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_huge_repetition_penalty_lowers_seen_tokens_never_excludes_them(penalty, temperature):
    """vLLM bounds repetition_penalty only below (> 0, finite). Tokens 1-3, all in the prompt, are
    the only ones a grammar allows (the others -inf): a penalty overflowing float32 used to send
    them to -inf too, so the choice fell on a forbidden token and broke the grammar (a 500)."""
    from qtk import SamplingParams
    from qtk.runtime.sampler import Sampler
    from qtk.runtime.sequence import Sequence

    logits = torch.full((1, 8), float("-inf"))
    logits[0, 1:4] = torch.tensor([-5.0, -4.0, -3.5])
    seq = Sequence([1, 2, 3], SamplingParams(repetition_penalty=penalty, temperature=temperature, seed=0))
    assert Sampler()(logits, [seq])[0] in (1, 2, 3)


@pytest.mark.parametrize("draw", ["kernel", "torch"])
def test_a_batch_draws_each_row_with_its_own_probabilities(draw, monkeypatch):
    """The sampler draws the whole batch at once (by inverse CDF, in qtk's CPU kernel or in torch):
    each row's tokens come with its own temperature-scaled probabilities, top-k'd rows only among
    their k, greedy rows take the argmax, and a seeded row its own generator's draws whatever else
    is in the batch."""
    from qtk.kernels import cpu
    from qtk.runtime.sampler import Sampler
    from qtk.runtime.sampling_params import SamplingParams
    from qtk.runtime.sequence import Sequence

    if draw == "kernel" and cpu.ops() is None:
        pytest.skip("qtk's CPU kernels do not run here (no compiler)")
    if draw == "torch":
        monkeypatch.setattr(Sampler, "_kernels", lambda self, rows: None)

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    torch.manual_seed(0)
    n = 20000
    kinds = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=2),
             SamplingParams(temperature=0.0)]
    seqs = [Sequence([1], kinds[i % 4]) for i in range(4 * n)]
    tokens = torch.tensor(Sampler()(logits.repeat(4 * n, 1), seqs))
    sharp = probs ** 2 / (probs ** 2).sum()
    top2 = torch.tensor([0.5, 0.3, 0, 0]) / 0.8
    for i, want in enumerate([probs, sharp, top2, torch.tensor([1.0, 0, 0, 0])]):
        got = torch.bincount(tokens[i::4], minlength=4) / n
        assert (got - want).abs().max() < 0.015, (i, got, want)
    seeded = [Sequence([1], SamplingParams(temperature=1.0, seed=7)) for _ in range(2)]
    one, many = Sampler(), Sampler()
    alone = [one(logits[None], [seeded[0]])[0] for _ in range(30)]
    others = [Sequence([1], kinds[0]), Sequence([1], kinds[1])]
    in_batch = [many(logits.repeat(3, 1), [others[0], seeded[1], others[1]])[1] for _ in range(30)]
    assert alone == in_batch and len(set(alone)) > 1


def test_the_batch_filters_keep_what_a_full_sort_of_each_row_keeps():
    """top-k, top-p and min-p on the whole batch (top-p's nucleus sought among each row's likeliest
    256, then 4096, then all) keep exactly the tokens of their definitions on one fully sorted row:
    peaked and flat rows (nuclei from 1 token to most of the vocabulary), a masked row, an empty one,
    ties at the cut, in float64 so both sum alike."""
    from qtk.runtime.sampler import filter_logits, filter_rows

    def by_sorting(logits, top_k, top_p, min_p):
        if top_k and top_k < logits.numel():
            logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
        if top_p < 1.0:
            ordered = logits.sort(descending=True).values
            probs = ordered.softmax(-1)
            kept = int(((probs.cumsum(-1) - probs) < top_p).sum().clamp(min=1))  # the smallest prefix reaching top_p
            logits = logits.masked_fill(logits < ordered[kept - 1], float("-inf"))
        if min_p > 0.0:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
        return logits

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(48, 49152, generator=g, dtype=torch.float64) * torch.linspace(0.2, 9, 48, dtype=torch.float64)[:, None]
    rows[3, 100:] = float("-inf")  # a grammar's mask
    rows[5] = float("-inf")  # nothing left
    rows[7, :6] = rows[7].max() + 1  # six tied likeliest: top-p 0.5 keeps all six
    top_k = [0, 40, 0, 5, 0, 0] * 8
    top_p = [0.95, 0.9, 0.5, 1.0, 0.999, 0.1, 0.95, 0.5] * 6
    min_p = [0.0, 0.0, 0.05, 0.0] * 12
    got = filter_rows(rows, top_k, top_p, min_p)
    kept = torch.isfinite(got).sum(-1)
    assert kept.min() == 0 and kept.max() > 30000 and ((kept > 256) & (kept <= 4096)).any() and kept[7] == 6
    for i in range(len(rows)):
        want = by_sorting(rows[i], top_k[i], top_p[i], min_p[i])
        assert torch.equal(got[i], want) and torch.equal(filter_logits(rows[i], top_k[i], top_p[i], min_p[i]), want)


def test_the_kernel_draws_the_tokens_torch_draws(monkeypatch):
    """qtk's CPU draw (sample_rows) and torch's (softmax, cumsum, searchsorted) give the same tokens
    for the same seeds: temperatures, top-k / top-p / min-p, a logit bias and a grammar-like mask,
    over a vocabulary the size of the bundled model's. Both sum in float32 (torch's cumsum in order,
    the kernel by blocks), so where u falls within their rounding of each other (~1e-6 of the mass)
    on a token rarer than that, they pick neighbours: all but one in 240 agree here."""
    from qtk.kernels import cpu
    from qtk.runtime.sampler import Sampler
    from qtk.runtime.sampling_params import SamplingParams
    from qtk.runtime.sequence import Sequence

    if cpu.ops() is None:
        pytest.skip("qtk's CPU kernels do not run here (no compiler)")
    g = torch.Generator().manual_seed(1)
    kinds = [dict(temperature=1.0), dict(temperature=0.3), dict(temperature=1.7, top_p=0.9), dict(temperature=0.8, top_k=40),
             dict(temperature=1.0, min_p=0.05), dict(temperature=1.0, logit_bias={7: 5.0})]
    logits = torch.randn(12, 49152, generator=g) * 3
    logits[5, 1000:] = float("-inf")  # a grammar's mask

    def draws(kernel: bool) -> list[list[int]]:
        if not kernel:
            monkeypatch.setattr(Sampler, "_kernels", lambda self, rows: None)
        seqs = [Sequence([1], SamplingParams(seed=i, **kinds[i % len(kinds)])) for i in range(12)]
        sampler = Sampler()
        out = [sampler(logits, seqs) for _ in range(20)]
        monkeypatch.undo()
        return out

    ours, torchs = draws(kernel=True), draws(kernel=False)
    pairs = [(a, b) for x, y in zip(ours, torchs) for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) >= len(pairs) - 2 and all(abs(a - b) <= 1 for a, b in pairs)


def test_incremental_detokenization_is_the_whole_decode_and_never_half_a_character(tokenizer):
    """Random token ids of the bundled byte-level BPE tokenizer (multi-byte characters split over
    several tokens included): the pieces add up to the full decode, and no piece ends inside a
    character."""
    from qtk.runtime.detokenizer import IncrementalDetokenizer, fast_backend

    g = torch.Generator().manual_seed(0)
    text = "Grüße, 東京 👋 naïve café — ok"
    backend = fast_backend(tokenizer)
    assert backend is not None  # the bundled tokenizer decodes in Rust (tokenizers' DecodeStream)
    for trial in range(20):
        prompt = tokenizer(text).input_ids[: trial % 5 + 1]
        out = tokenizer(text[trial % 7:]).input_ids + torch.randint(0, len(tokenizer), (30,), generator=g).tolist()
        out += [tokenizer.eos_token_id, len(tokenizer) + 5]  # a special token, an id past the vocabulary
        if trial % 2:
            out += tokenizer("👋", add_special_tokens=False).input_ids[:1]  # ends inside a character
        skip = trial % 3 != 0
        detoks = [IncrementalDetokenizer(tokenizer, prompt, skip), IncrementalDetokenizer(tokenizer, prompt, skip, backend)]
        ids, pieces = list(prompt), [[], []]
        for i, t in enumerate(out):
            ids.append(t)
            for d, p in zip(detoks, pieces):
                p.append(d.step(ids, final=i == len(out) - 1))
        assert pieces[0] == pieces[1]  # the Rust stream gives the same pieces as transformers' decode
        assert "".join(pieces[1]) == tokenizer.decode(out, skip_special_tokens=skip)
        assert not any(p.endswith("\ufffd") for p in pieces[1][:-1])
        assert pieces[1][-1].endswith("\ufffd") == bool(trial % 2)  # the unfinished one, emitted at the end


@pytest.mark.parametrize("primed_by", ["ids", "steps"])
def test_detokenizer_streams_with_the_prompt_as_context(primed_by, monkeypatch):
    """A SentencePiece-style decoder drops the space of a text's first word: the first generated word's
    space shows only in the context of the prompt's last tokens, on both paths (the stream primed with
    them as tokenizers >= 0.22 takes them, or by feeding them, as before)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.decoders import DecodeStream
    from transformers import PreTrainedTokenizerFast

    from qtk.runtime import detokenizer
    from qtk.runtime.detokenizer import IncrementalDetokenizer, fast_backend

    if primed_by == "steps":
        def older_stream(skip_special_tokens=False, **kwargs):
            if kwargs:
                raise TypeError("DecodeStream() takes no ids")
            return DecodeStream(skip_special_tokens=skip_special_tokens)
        monkeypatch.setattr(detokenizer, "_decode_stream", lambda: older_stream)

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3}, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert tok.decode([2]) == "world" and fast_backend(tok) is not None
    for fast in (None, fast_backend(tok)):
        detok, ids = IncrementalDetokenizer(tok, [1], backend=fast), [1]
        pieces = [detok.step(ids := ids + [t]) for t in (2, 3, 2)]
        assert pieces == [" world", "!", " world"]


def test_detokenizer_streams_what_transformers_decodes_with_byte_fallback_tokens():
    """A Llama-style decoder (byte-fallback tokens, fused): a byte that is no character makes the Rust stream
    refuse the next text ("Invalid prefix": vLLM's issue 17448), and a prompt that ends inside a character
    would make it emit the prompt's own text. Both go through transformers' decode, the same pieces."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from qtk.runtime.detokenizer import IncrementalDetokenizer, fast_backend

    vocab = ["<unk>", "\u2581Hi", "<0x41>", "<0x80>", "b", "<0xF0>", "<0x9F>", "<0x91>", "<0x8B>", "\u2581there"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert fast_backend(tok) is not None
    for prompt, out in (([1], [2, 3, 4, 9]),          # "A", a lone continuation byte, "b", " there"
                        ([1, 5, 6], [7, 8, 9, 2])):  # the prompt ends inside a 4-byte character
        pieces = []
        for fast in (None, fast_backend(tok)):
            detok, ids = IncrementalDetokenizer(tok, prompt, backend=fast), list(prompt)
            pieces.append([detok.step(ids := ids + [t], final=i == len(out) - 1) for i, t in enumerate(out)])
        assert pieces[0] == pieces[1]


def test_detokenizer_decodes_through_transformers_where_its_decode_adds_something(tokenizer):
    """clean_up_tokenization_spaces rewrites the backend's text (" ." -> "."), so such a tokenizer keeps the
    transformers decode."""
    import copy

    from qtk.runtime.detokenizer import fast_backend

    tidy = copy.copy(tokenizer)
    tidy.clean_up_tokenization_spaces = True
    assert fast_backend(tokenizer) is not None and fast_backend(tidy) is None

    class Rewrites(type(tokenizer)):  # a subclass with a decode of its own (as CPM's)
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).replace(" ", "")

    rewrites = copy.copy(tokenizer)
    rewrites.__class__ = Rewrites
    assert fast_backend(rewrites) is None


def test_a_snapshot_copies_every_field_and_shares_no_list():
    import dataclasses

    from qtk.runtime.output_processor import CompletionOutput, RequestOutput

    done = CompletionOutput(1, "text", [4, 5], "stop", [{4: -0.5}])
    out = RequestOutput("r", [1, 2, 3], [done], [None, {2: -1.0}], 0.25, "an error")
    assert all(getattr(out, f.name) != f.default for f in dataclasses.fields(out) if f.default is not dataclasses.MISSING)
    assert all(getattr(done, f.name) != f.default for f in dataclasses.fields(done) if f.default is not dataclasses.MISSING)
    snap = out.snapshot()
    assert dataclasses.asdict(snap) == dataclasses.asdict(out)  # a field the snapshot missed would be its default
    done.token_ids.append(6)
    done.logprobs.append({6: -0.1})
    out.outputs.append(CompletionOutput(2, "", []))
    assert snap.outputs[0].token_ids == [4, 5] and len(snap.outputs[0].logprobs) == 1 and len(snap.outputs) == 1


def test_stop_strings_cut_the_text_exactly(tiny_dir):
    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=128, kv_cache_memory=2**22)
    full = llm.generate(["Hello"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].outputs[0]
    stop = full.text[5:8]
    assert len(stop) == 3 and full.finish_reason == "length"
    cut = llm.generate(["Hello"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop, "\x00"]))[0]
    done = cut.outputs[0]
    assert done.finish_reason == "stop" and done.text == full.text[:full.text.index(stop)]
    assert full.token_ids[:len(done.token_ids)] == done.token_ids and len(done.token_ids) < 24
    first = llm.tokenizer.decode(full.token_ids[:1])  # min_tokens exempts the first tokens' text, as vLLM's
    early = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, stop=[first],
                                                   min_tokens=1))[0].outputs[0]
    assert len(early.token_ids) > 1 and early.text.startswith(first)
    kept = llm.generate(["Hello"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)] and kept.token_ids == done.token_ids


def test_a_stop_string_is_looked_for_only_where_the_new_text_could_end_it():
    """Each stop string in its own window (vLLM's): an 'a' passed over while min_tokens held stops
    back is not found later because a longer stop string in the list widens the search."""
    from qtk.runtime.detokenizer import find_stop

    stops = ("a", "bbbbbbbbbb")
    assert find_stop("xa", stops, new=1) == (1, "a")
    assert find_stop("xayzw", stops, new=1) is None
    assert find_stop("xayzw", ("a", "yz"), new=1) is None and find_stop("xayzw", ("a", "yz"), new=2) == (2, "yz")
    assert find_stop("abcab", ("ab", "cab"), new=2) == (2, "cab")  # the earliest start wins


def test_logprobs_of_sampled_tokens_are_the_models(tiny_dir):
    from transformers import AutoModelForCausalLM

    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=128, kv_cache_memory=2**22)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3))[0]
    done = out.outputs[0]
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    with torch.no_grad():
        lp = ref(torch.tensor([out.prompt_token_ids + done.token_ids])).logits[0].log_softmax(-1)
    for i, (token, entry) in enumerate(zip(done.token_ids, done.logprobs)):
        row = lp[len(out.prompt_token_ids) - 1 + i]
        assert set(entry) == set(row.topk(3).indices.tolist()) and token in entry  # greedy: the top one
        for t, v in entry.items():
            assert abs(v - row[t].item()) < 1e-4


def test_prompt_logprobs_through_chunks_are_the_models(tiny_dir):
    """prompt_logprobs over a prompt prefilled in 16-token chunks: log p(token_i | before) for
    every i >= 1, transformers' within 1e-4, and the same again for a second, identical prompt
    (which must not take the first one's cached prefix: it has no logits)."""
    from transformers import AutoModelForCausalLM

    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8,
              max_num_batched_tokens=16)
    prompt = list(range(300, 370))
    outs = llm.generate([prompt, prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    with torch.no_grad():
        lp = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for out in outs:
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert abs(entry[prompt[i]] - lp[i - 1, prompt[i]].item()) < 1e-4
            assert set(lp[i - 1].topk(2).indices.tolist()) <= set(entry)


def test_prompt_logprobs_survive_preemption(tiny_dir):
    """Three 30-token prompts growing to 70 tokens in a pool of 96 token slots: requests get
    preempted and recomputed, and each prompt's logprobs are still reported once per position,
    equal to transformers'."""
    from transformers import AutoModelForCausalLM

    from qtk import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=96, kv_cache_memory=96 * 512, block_size=8,
              max_num_batched_tokens=32)
    prompts = [list(range(100 + 7 * k, 130 + 7 * k)) for k in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=0))
    assert llm.scheduler.num_preemptions > 0
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            lp = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert len(out.prompt_logprobs) == len(prompt) and len(out.outputs[0].token_ids) == 40
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert list(entry) == [prompt[i]] and abs(entry[prompt[i]] - lp[i - 1, prompt[i]].item()) < 1e-4


def test_bench_engine_runs_qtk_and_transformers_on_the_same_requests(tiny_dir, tmp_path):
    """`qtk bench engine` on the tiny model with transformers as the peer: every engine produced
    exactly the output tokens asked for (EOS ignored), and the JSON records the run."""
    import json

    from click.testing import CliRunner

    from qtk.cli import main

    r = CliRunner().invoke(main, ["bench", "engine", str(tiny_dir), "--num-prompts", "4", "--output-len", "5",
                                  "--input-len", "16", "--batch1-output-len", "6", "--sequential", "2",
                                  "--dtype", "float32", "--out", str(tmp_path), "--name", "tiny"])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "tiny.json").read_text())
    qtk, hf = res["engines"]["qtk"], res["engines"]["transformers"]
    assert qtk["throughput"]["tokens"] == 4 * 5 and qtk["batch1"]["tokens"] == 6 and qtk["startup_s"] > 0
    assert hf["sequential"]["tokens"] == 2 * 5 and hf["static_16"]["tokens"] == 4 * 5 and hf["batch1"]["tokens"] == 6
    assert res["cpu_capability"] and res["commit"] and "transformers batch 16" in r.output


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_packed_linears_compute_the_same_products(monkeypatch):
    """pack_linears swaps plain float32 Linears for oneDNN-packed ones and marks QuantLinears, whose
    Dense runtime then holds the packed weight: outputs equal the plain ones to fp32 rounding. (A
    weight-only QuantLinear runs qtk's CPU kernel where it is built; off here to reach Dense.)"""
    monkeypatch.setenv("QTK_CPU_KERNEL", "off")
    from qtk.kernels import dispatch
    from qtk.quant_linear import QuantLinear
    from qtk.runtime.packed_linear import PackedLinear, pack_linears
    from qtk.schemes import preset

    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 48)
    ql = QuantLinear.from_codes(torch.randint(-8, 8, (40, 64), dtype=torch.int8), torch.rand(40, 2) / 10 + 0.01,
                                None, preset("w4a16", group_size=32), dtype=torch.float32)
    model = torch.nn.Sequential(plain, torch.nn.ReLU(), torch.nn.Linear(48, 64, bias=False), ql)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        want = model(x)
        del ql._qtk_runtime
        assert pack_linears(model) == 2 and isinstance(model[0], PackedLinear) and isinstance(model[2], PackedLinear)
        got = model(x)
    assert dispatch.runtime_for(ql, x.reshape(-1, 64)).weight.is_mkldnn
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_packed_projections_keep_the_logits(family):
    """The engine's q/k/v and gate/up fused into one packed matmul each (qwen2: with biases): the
    packed, ragged forward gives the unfused model's logits."""
    import copy

    from qtk.runtime.models.native import FUSED
    from qtk.runtime.packed_linear import pack_linears

    model = hf_model(family)
    fused = copy.deepcopy(model)
    assert pack_linears(fused, fuse=FUSED) > 0
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert hasattr(attn, "qkv_proj") and not hasattr(attn, "q_proj") and hasattr(mlp, "gate_up_proj")
    prompts = [list(range(30, 41)), list(range(60, 63))]
    _, want, _ = greedy_through_runtime(model, prompts, new_tokens=4)
    _, got, _ = greedy_through_runtime(fused, prompts, new_tokens=4)
    for a, b in zip(want.values(), got.values()):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme,family", [("w4a16", "qwen2"), ("w4a16_asym", "qwen2"), ("w8a16", "qwen2"),
                                           ("w4a16_asym", "qwen3")])
def test_fused_weight_only_projections_keep_the_logits(scheme, family):
    """Weight-only QuantLinears (q/k/v, gate/up) that qtk's CPU kernel runs are fused into one
    kernel call each (WOQLinear): the logits equal the unfused model's (Qwen2: q/k/v biases;
    Qwen3: q/k norms between the projection and RoPE)."""
    from qtk.kernels import cpu as cpu_kernels
    from qtk.runtime.packed_linear import WOQLinear
    from qtk.schemes import preset

    if cpu_kernels.ops() is None:
        pytest.skip("no C++ compiler: weight-only layers run Dense")
    model = quantized_projections(hf_model(family), preset(scheme, group_size=None if scheme == "w8a16" else 16))
    fused = assert_fusing_keeps_the_logits(model)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, WOQLinear) and isinstance(mlp.gate_up_proj, WOQLinear)


@pytest.mark.parametrize("activations", ["token", "static same", "static each"])
def test_w8a8_projections_on_the_vnni_kernel_keep_the_logits(activations):
    """W8A8 int8 QuantLinears run qtk's VNNI kernel straight from the module (W8A8Linear); q/k/v and
    gate/up are joined where their activations are quantized alike (per token, or one static scale),
    and each keeps its own otherwise. The logits equal the model's through QuantLinear's dispatch."""
    from dataclasses import replace

    from qtk.kernels import cpu as cpu_kernels
    from qtk.runtime.packed_linear import W8A8Linear
    from qtk.schemes import preset

    lib = cpu_kernels.ops()
    if lib is None or not lib.compiled_vnni():
        pytest.skip("qtk's VNNI kernel needs a CPU with AVX-512 + VNNI (the avx512 build)")
    s = preset("w8a8")
    if activations != "token":
        s = replace(s, input_activations=replace(s.input_activations, strategy="tensor", dynamic=False))
    step = 0.01 if activations == "static each" else 0.0  # the j-th projection of a module: 0.02 + j * step
    static = None if activations == "token" else lambda j: torch.tensor([0.02 + step * j])
    fused = assert_fusing_keeps_the_logits(quantized_projections(hf_model("qwen2"), s, static))
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    if activations == "static each":
        assert not hasattr(attn, "qkv_proj") and isinstance(attn.q_proj, W8A8Linear)
    else:
        assert isinstance(attn.qkv_proj, W8A8Linear) and isinstance(mlp.gate_up_proj, W8A8Linear)
    # the norms and the GLU hand the joined layers their input quantized, gate_up's kernel takes the GLU in
    # its epilogue (I = 128 here): the same logits to the bit
    prompts = [list(range(30, 41)), list(range(60, 63))]
    logits, plans = {}, {}
    for producers, glu in ((True, True), (True, False), (False, False)):
        runtime = NativeModel(fused)
        runtime.quantize_in_producers, runtime.glu_in_products = producers, glu
        logits[producers, glu] = greedy_through_runtime(fused, prompts, new_tokens=4, runtime=runtime)[1]
        plans[producers, glu] = runtime._quant_plan[0]
    quantized = [entry is not None for entry in plans[True, True]]
    assert quantized == ([False] * 3 if activations == "static each" else [True] * 3)
    if activations != "static each":  # down's input quantized by w8a8_quantize after the GLU kernel, not the GLU op
        assert plans[True, True][2][2] is not plans[True, False][2][2]
    for key in ((True, False), (False, False)):
        for a, b in zip(logits[True, True].values(), logits[key].values()):
            assert torch.equal(torch.stack(a), torch.stack(b)), key


def quantized_projections(model, scheme, input_scale=None):
    """Every Linear of the model's attention and MLP as a float32 QuantLinear of `scheme` (RTN);
    input_scale(j): the static activation scale of a module's j-th projection."""
    from qtk.quant import quantize_weight
    from qtk.quant_linear import QuantLinear

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for j, (name, lin) in enumerate(list(parent.named_children())):
                if isinstance(lin, torch.nn.Linear):
                    q, scale, zp = quantize_weight(lin.weight.detach(), scheme.weights)
                    static = None if input_scale is None else input_scale(j)
                    setattr(parent, name, QuantLinear.from_codes(q, scale, zp, scheme, bias=lin.bias,
                                                                 input_scale=static, dtype=torch.float32))
    return model


def assert_fusing_keeps_the_logits(model):
    """The engine's packing and fusing (pack_linears) of a copy keeps the greedy logits; the copy."""
    import copy

    from qtk.runtime.models.native import FUSED
    from qtk.runtime.packed_linear import pack_linears

    fused = copy.deepcopy(model)
    pack_linears(fused, fuse=FUSED)
    prompts = [list(range(30, 41)), list(range(60, 63))]
    _, want, _ = greedy_through_runtime(model, prompts, new_tokens=4)
    _, got, _ = greedy_through_runtime(fused, prompts, new_tokens=4)
    for a, b in zip(want.values(), got.values()):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), atol=2e-4, rtol=1e-4)
    return fused


def test_a_peers_root_cause_is_read_from_its_workers_stderr():
    """vLLM's front end says only that a worker failed; under torch.compile the worker's traceback
    names the exception without its message, after the user code that raised it."""
    from qtk.bench.engine import root_causes

    stderr = """Process EngineCore:
Traceback (most recent call last):
RuntimeError: Worker failed with error 'Observed exception
  Developer debug context: raised exception AttributeError()

from user code:
   File "vllm/model_executor/layers/linear.py", line 610, in forward
    output_parallel = self.quant_method.apply(self, input_, bias)
                      ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "vllm/_custom_ops.py", line 4453, in cpu_gemm_wna16
    torch.ops._C.cpu_gemm_wna16(

Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace
"""
    assert root_causes(stderr) == ["AttributeError() raised at `torch.ops._C.cpu_gemm_wna16(`",
                                   "RuntimeError: Worker failed with error 'Observed exception"]
    assert root_causes("ValueError: no such scheme\n") == ["ValueError: no such scheme"]


def test_a_max_model_len_past_the_context_is_cut_with_a_warning(tiny_dir, caplog):
    from qtk import LLM

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=1000, kv_cache_memory=2**22)
    assert llm.max_model_len == 256
    assert "max_model_len 1000 is longer than the model's context (max_position_embeddings 256)" in caplog.text
