"""qtk as an lm-evaluation-harness model: its loglikelihood, rolling loglikelihood and greedy
generation against transformers (the referee) on the tiny Llama, lm-eval's own HFLM on the
bundled model (slow), and lm-eval's entry points: simple_evaluate over qtk's local tasks and the
`lm_eval` command line with `--model qtk`."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")  # the optional lm-eval extra

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from qtk.errors import InputError  # noqa: E402
from qtk.evals.lm_eval_adapter import (TASKS_DIR, QtkLM, install_lm_eval_hook, run_lm_eval,  # noqa: E402
                                       sampling_params)

MAX_LEN = 64  # short, so that long inputs are truncated and documents span several windows
ENGINE = dict(dtype="float32", device="cpu", max_model_len=MAX_LEN, kv_cache_memory=2**22)


@pytest.fixture(scope="module")
def lm(tiny_dir):
    return QtkLM(pretrained=str(tiny_dir), **ENGINE)


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory):
    """The tiny random Llama (vocab 256) with a Llama-2-style tokenizer: SentencePiece's Metaspace
    pieces ("▁the"), BOS added, and a decoder that drops the space a text's first piece starts with."""
    import string

    from interop import TINY
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in " \x0b\x0c\r"]
    vocab = ["<unk>", "<s>", "</s>", "▁", *chars, *("▁" + c for c in string.ascii_letters)]
    vocab += [f"<extra_{i}>" for i in range(TINY["vocab_size"] - len(vocab))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>",
                               merges=[("▁", c) for c in string.ascii_letters]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = tmp_path_factory.mktemp("metaspace")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(d)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY, "bos_token_id": 1, "eos_token_id": 2})).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def metaspace(metaspace_dir):
    """(qtk, lm-eval's HFLM) on that model. HFLM one request at a time: in a batch, a row its
    stopping criterion has stopped generates on until every row has stopped."""
    from lm_eval.models.huggingface import HFLM

    ref = HFLM(pretrained=str(metaspace_dir), dtype="float32", device="cpu", batch_size=1, max_length=MAX_LEN)
    return QtkLM(pretrained=str(metaspace_dir), **ENGINE), ref


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@torch.no_grad()
def score(hf, ids: list[int], start: int) -> tuple[float, bool]:
    """transformers: (sum log p(ids[i] | ids[:i]) for i >= start, each ids[i] the argmax)."""
    logprobs = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)  # [len - 1, V]
    targets = torch.tensor(ids[start:])
    rows = logprobs[start - 1:]
    return rows.gather(1, targets[:, None]).sum().item(), bool((rows.argmax(-1) == targets).all())


def hflm_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """HFLM's tokenization written out: the context's trailing whitespace moves to the
    continuation, the whole is encoded and split at the context's length; an empty context is BOS."""
    if not context:
        return [tokenizer.bos_token_id], tokenizer.encode(continuation, add_special_tokens=False)
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    whole, ctx = tokenizer.encode(stripped + continuation), tokenizer.encode(stripped)
    return ctx, whole[len(ctx):]


def test_loglikelihood_matches_transformers(lm, hf, tokenizer):
    """Plain, trailing-space, empty and over-long contexts: the sums agree to 1e-4, is_greedy exactly."""
    pairs = [("The capital of France is", " Paris"), ("Question: what is 2 + 2?\nAnswer: ", "4"),
             ("", "Hello world, again"), ("word " * 80, "the end of a long story")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        ctx, cont = hflm_pair(tokenizer, context, continuation)
        whole = (ctx + cont)[-(MAX_LEN - 1):]  # left-truncated: the engine keeps a slot to sample
        want, want_greedy = score(hf, whole, len(whole) - len(cont))
        assert logprob == pytest.approx(want, abs=1e-4), (context, continuation)
        assert greedy == want_greedy


def test_is_greedy_on_the_argmax_continuation(lm, hf, tokenizer):
    context = tokenizer.encode("Once upon a time")
    ids = list(context)
    for _ in range(5):
        with torch.no_grad():
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = ids[len(context):]
    other = greedy[:-1] + [(greedy[-1] + 1) % len(tokenizer)]
    (_, is_greedy), (_, not_greedy) = lm._loglikelihood_tokens([(None, context, greedy), (None, context, other)])
    assert is_greedy and not not_greedy


def test_loglikelihood_rolling_matches_transformers(lm, hf, tokenizer):
    """A short text is one window: transformers' summed log p of all its tokens after BOS. A long
    one spans lm-eval's disjoint windows of MAX_LEN - 2 predicted tokens, each scored alike."""
    short, long = "A short text to score.", " ".join(f"sentence number {i} goes here." for i in range(30))
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), 0) for t in (short, long)])
    ids = tokenizer.encode(short)
    assert got[0] == pytest.approx(score(hf, [tokenizer.bos_token_id] + ids, 1)[0], abs=1e-4)
    ids = tokenizer.encode(long)
    windows = list(map(make_disjoint_window, get_rolling_token_windows(ids, tokenizer.bos_token_id, MAX_LEN - 2, 1)))
    assert len(windows) >= 3 and sum(len(cont) for _, cont in windows) == len(ids)
    want = sum(score(hf, ctx + cont, len(ctx))[0] for ctx, cont in windows)
    assert got[1] == pytest.approx(want, abs=1e-3)


def test_generate_until_matches_transformers_greedy(lm, hf, tokenizer):
    """Greedy text of 12 tokens; with a stop string taken from that text, the text before it."""
    contexts = ["The weather today is", "My favourite food is"]
    texts = []
    for context in contexts:
        ids = torch.tensor([tokenizer.encode(context)])
        out = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    stop = texts[1][4:6]
    reqs = [Instance("generate_until", {}, (contexts[0], {"until": [], "max_gen_toks": 12, "do_sample": False}), 0),
            Instance("generate_until", {}, (contexts[1], {"until": [stop], "max_gen_toks": 12}), 1)]
    assert lm.generate_until(reqs) == [texts[0], texts[1][:texts[1].index(stop)]]


def test_generate_until_text_is_hflms_on_a_sentencepiece_tokenizer(metaspace):
    """HFLM decodes the generated tokens alone, so a first piece "▁P" reads "P"; the engine decodes
    them after the prompt's, " P". Greedy answers equal HFLM's, the prompts chosen so that some do
    begin with such a piece."""
    from qtk.runtime.sampling_params import SamplingParams

    lm, ref = metaspace
    contexts = ["The b", "A d", "So b", "It c"]
    engine = lm.llm.generate([lm.tok_encode(c) for c in contexts], SamplingParams(max_tokens=6, temperature=0.0))
    assert any(out.outputs[0].text.startswith(" ") for out in engine)
    greedy = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    reqs = [Instance("generate_until", {}, (c, greedy), i) for i, c in enumerate(contexts)]
    assert lm.generate_until(reqs) == ref.generate_until(reqs)


def test_generate_until_stops_at_a_special_token_in_until(metaspace):
    """An `until` that is a special token other than EOS ("<s>" here; "</s>" or "<|endoftext|>" in
    task YAMLs) stops HFLM, whose stopping criterion decodes with special tokens, and stops qtk at
    the same token although the answer's text leaves special tokens out."""
    from qtk.runtime.sampling_params import SamplingParams

    lm, ref = metaspace
    contexts = ["My q", "x y", "My s"]
    engine = lm.llm.generate([lm.tok_encode(c) for c in contexts], SamplingParams(max_tokens=12, temperature=0.0))
    assert all(lm.tokenizer.bos_token_id in out.outputs[0].token_ids[:-1] for out in engine)  # "<s>", then more
    until = {"until": ["<s>"], "max_gen_toks": 12, "do_sample": False}
    reqs = [Instance("generate_until", {}, (c, until), i) for i, c in enumerate(contexts)]
    assert lm.generate_until(reqs) == ref.generate_until(reqs)


def test_sampling_params_from_gen_kwargs():
    greedy = sampling_params({"do_sample": False, "temperature": 0.0}, ["\n"], 8)
    assert (greedy.temperature, greedy.max_tokens, greedy.stop) == (0.0, 8, ("\n",))
    sampled = sampling_params({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5}, [], 4)
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.7, 0.9, 5)
    assert sampling_params({"do_sample": True}, [], 4).temperature == 1.0
    with pytest.raises(InputError, match="num_beams"):
        sampling_params({"do_sample": False, "num_beams": 4}, [], 4)


def test_model_args_errors_and_a_shared_engine(lm, tiny_dir):
    with pytest.raises(InputError, match="unknown qtk model_args bogus.*kv_cache_dtype"):
        QtkLM.create_from_arg_string(f"pretrained={tiny_dir},bogus=1", {"batch_size": 1, "device": "cuda:0"})
    with pytest.raises(InputError, match="pretrained="):
        QtkLM(dtype="float32")
    assert QtkLM(pretrained=lm.llm).llm is lm.llm  # run_lm_eval(llm, ...) scores on the caller's engine
    with pytest.raises(InputError, match="dtype set how qtk loads a model"):
        QtkLM(pretrained=lm.llm, dtype="float32")


def test_model_args_as_lm_eval_parses_them(tiny_dir):
    """max_length is lm-eval's name for the context length (HFLM's and its vLLM model's), and
    lm-eval parses kv_cache_memory=4e6 into the float 4e6: both reach the engine."""
    lm = QtkLM.create_from_arg_string(f"pretrained={tiny_dir},dtype=float32,max_length=48,kv_cache_memory=4e6"
                                      ",trust_remote_code=True",  # what `lm_eval --trust_remote_code` adds
                                      {"batch_size": "auto", "max_batch_size": None, "device": "cpu"})
    assert lm.max_length == 48 and lm.get_model_info()["kv_cache_memory"] == 4_000_000
    with pytest.raises(InputError, match="max_length and max_model_len"):
        QtkLM(pretrained=str(tiny_dir), max_length=48, max_model_len=64)
    with pytest.raises(InputError, match="kv_cache_memory must be an integer, got 4.5"):
        QtkLM(pretrained=str(tiny_dir), kv_cache_memory=4.5)


def test_unknown_task_names_close_matches(tiny_dir):
    with pytest.raises(InputError, match="'qtk_mcq'.*qtk_mc.*local tasks are qtk_gen"):
        run_lm_eval(str(tiny_dir), ["qtk_gen", "qtk_mcq"], limit=1)


def test_run_lm_eval_on_local_tasks(lm, tiny_dir):
    """Every local task runs, and its metrics are what the adapter's own scores give."""
    out = run_lm_eval(str(tiny_dir), ["qtk_local"], limit=4, **ENGINE)
    res = out["results"]
    assert set(res) == {"qtk_mc", "qtk_paragraphs", "qtk_gen"}
    assert out["versions"]["tasks"]["qtk_mc"] == 1.0 and out["versions"]["lm_eval"]

    import json

    docs = [json.loads(line) for line in (TASKS_DIR / "qtk_paragraphs.jsonl").read_text().splitlines()[:4]]
    ll = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", d, (d["text"],), 0) for d in docs])
    n_bytes = sum(len(d["text"].encode()) for d in docs)
    assert res["qtk_paragraphs"]["bits_per_byte"] == pytest.approx(-sum(ll) / n_bytes / math.log(2), rel=1e-9)
    assert res["qtk_paragraphs"]["byte_perplexity"] == pytest.approx(2 ** res["qtk_paragraphs"]["bits_per_byte"])

    docs = [json.loads(line) for line in (TASKS_DIR / "qtk_mc.jsonl").read_text().splitlines()[:4]]
    reqs = [Instance("loglikelihood", d, (f"Question: {d['question']}\nAnswer:", f" {c}"), 0)
            for d in docs for c in d["choices"]]
    ll = [logprob for logprob, _ in lm.loglikelihood(reqs)]
    picks = [max(range(4), key=lambda j: ll[4 * i + j]) for i in range(len(docs))]
    assert res["qtk_mc"]["acc"] == sum(p == d["answer"] for p, d in zip(picks, docs)) / len(docs)
    assert 0 <= res["qtk_gen"]["exact_match,strip"] <= 1


def test_chat_template_hooks(lm, tokenizer):
    """--apply_chat_template: lm-eval renders the conversation with the model's template and runs it."""
    import lm_eval

    from qtk.evals.lm_eval_adapter import task_manager

    chat = [{"role": "user", "content": "hi"}]
    want = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert lm.apply_chat_template(chat) == want
    assert lm.chat_template(True) == tokenizer.chat_template and lm.tokenizer_name
    out = lm_eval.simple_evaluate(model=lm, tasks=["qtk_gen"], task_manager=task_manager(["qtk_gen"]),
                                  limit=2, apply_chat_template=True, num_fewshot=0, log_samples=True)
    prompt, _ = out["samples"]["qtk_gen"][0]["arguments"][0]  # (context, gen_kwargs)
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")


def test_lm_eval_command_line(tiny_dir, tmp_path):
    """`python -m lm_eval --model qtk` with the registration hook in a site dir (as
    `install-hook` puts it in site-packages): it runs and prints the metric; "hf" still resolves."""
    site_dir = install_lm_eval_hook(tmp_path).parent
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("QTK_TEST_THREADS", "1")}  # as conftest's torch threads
    as_lm_eval = ("import runpy, site, sys; site.addsitedir(sys.argv.pop(1)); "
                  "runpy.run_module('lm_eval', run_name='__main__', alter_sys=True)")
    model_args = f"pretrained={tiny_dir},dtype=float32,device=cpu,max_model_len={MAX_LEN},kv_cache_memory=4194304"
    args = [sys.executable, "-c", as_lm_eval, str(site_dir), "--model", "qtk", "--model_args", model_args,
            "--tasks", "qtk_mc", "--limit", "4", "--include_path", str(TASKS_DIR)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout.replace(" ", "")
    assert "|qtk_mc|" in table and "|acc|" in table
    check = ("import site, sys; site.addsitedir(sys.argv[1]); from lm_eval.api.registry import get_model; "
             "print(get_model('qtk').__name__, get_model('hf').__name__)")
    names = subprocess.run([sys.executable, "-c", check, str(site_dir)], capture_output=True, text=True, timeout=60,
                           env=env)
    assert names.stdout.split() == ["QtkLM", "HFLM"], names.stderr[-3000:]


@pytest.mark.slow
def test_matches_hflm_on_the_bundled_model(bundled_dir, monkeypatch):
    """The bundled model's qtk_mc and qtk_paragraphs scores through qtk equal lm-eval's HFLM's
    (transformers, float32) request by request, and so do its greedy qtk_gen answers. In float32
    throughout (QTK_CPU_BF16=0: no bf16 matmuls for many rows, which move a continuation's
    log-likelihood by ~0.05; tests/test_prefill_paths.py bounds them), so that what is compared is
    the adapter's requests, not the matmul dtype."""
    monkeypatch.setenv("QTK_CPU_BF16", "0")
    import json

    from lm_eval.models.huggingface import HFLM

    qtk = QtkLM(pretrained=str(bundled_dir), dtype="float32", device="cpu", max_model_len=2048,
                kv_cache_memory=2**27)
    ref = HFLM(pretrained=str(bundled_dir), dtype="float32", device="cpu", batch_size=16)
    mc = [json.loads(line) for line in (TASKS_DIR / "qtk_mc.jsonl").read_text().splitlines()]
    reqs = [Instance("loglikelihood", d, (f"Question: {d['question']}\nAnswer:", f" {c}"), 0)
            for d in mc for c in d["choices"]]
    reqs += [Instance("loglikelihood", {}, ("", "Paris is the capital of France."), 0)]
    for (got, got_greedy), (want, want_greedy) in zip(qtk.loglikelihood(reqs), ref.loglikelihood(reqs)):
        assert got == pytest.approx(want, abs=5e-4) and got_greedy == want_greedy
    texts = [json.loads(line)["text"] for line in (TASKS_DIR / "qtk_paragraphs.jsonl").read_text().splitlines()[:5]]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts]
    assert qtk.loglikelihood_rolling(rolling) == pytest.approx(ref.loglikelihood_rolling(rolling), abs=2e-3)
    gen = [json.loads(line) for line in (TASKS_DIR / "qtk_gen.jsonl").read_text().splitlines()[:8]]
    shots = "".join(f"Q: {d['question']}\nA: {d['answer']}\n\n" for d in gen[-3:])
    greedy = {"until": ["\n"], "max_gen_toks": 16, "do_sample": False}
    reqs = [Instance("generate_until", d, (f"{shots}Q: {d['question']}\nA:", greedy), 0) for d in gen]
    assert qtk.generate_until(reqs) == ref.generate_until(reqs)
