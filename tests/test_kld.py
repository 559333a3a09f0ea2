"""The kld task and the gates' standard errors: the engine's full prompt distributions against
transformers' forward, the KL divergence against its definition (float16 storage of the
baseline included), the kld gate end to end with the baseline's log-probabilities cached beside
its numbers, and the bootstrap's standard errors against their closed forms."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from qtk.cli import main
from qtk.evals import bootstrap
from qtk.evals.gates import GatesFile, verdict
from qtk.evals.kld import kl_divergence
from qtk.evals.tasks import Gate


def _llm(path, **kw):
    from qtk import LLM

    return LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8, **kw)


def test_prompt_log_probs_are_transformers_log_softmax_in_chunks(tiny_dir):
    """Every row of LLM.prompt_log_probs is log_softmax of transformers' logits at that position,
    the prompts computed in chunks of 24 tokens (chunked prefill) and batched together; the
    prompt_logprobs entries read the same numbers."""
    from transformers import AutoModelForCausalLM

    from qtk import SamplingParams

    llm = _llm(tiny_dir, max_num_batched_tokens=24)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (61, 2, 30)]
    rows = llm.prompt_log_probs(prompts)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    for p, r in zip(prompts, rows):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([p])).logits[0, :-1].float().log_softmax(-1)
        assert r.shape == ref.shape and r.dtype == torch.float32
        torch.testing.assert_close(r, ref, atol=2e-4, rtol=0)
    entries = llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert [e[t] for e, t in zip(entries.prompt_logprobs[1:], prompts[0][1:])] == \
        pytest.approx([rows[0][i, t].item() for i, t in enumerate(prompts[0][1:])], abs=1e-6)
    with pytest.raises(Exception, match="at least 2"):
        llm.prompt_log_probs([[5]])


def test_kl_divergence_is_its_definition_and_float16_storage_is_close():
    """KL(p || q) = sum p (log p - log q) per row, argmaxes compared; the baseline rounded to
    float16 (as the gates keep it) moves the mean KL by less than 1e-4 of itself plus 1e-5 nats."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49152, generator=g) * 3
    base = logits.log_softmax(-1)
    cand = (logits + 0.3 * torch.randn(64, 49152, generator=g)).log_softmax(-1)
    kl, agree = kl_divergence(base, cand)
    want = (base.double().exp() * (base.double() - cand.double())).sum(-1)
    torch.testing.assert_close(kl, want, rtol=1e-4, atol=1e-5)  # float32 log-softmax: ~1e-6 per value
    assert torch.equal(agree, base.argmax(-1) == cand.argmax(-1))
    half, _ = kl_divergence(base.half(), cand)
    assert abs(half.double().mean() - want.mean()) < 1e-4 * want.mean() + 1e-5
    same, agree = kl_divergence(base.half(), base)
    assert same.max() < 1e-5 and agree.all()
    with pytest.raises(Exception, match="share the tokenizer"):
        kl_divergence(base[:, :100], cand)


def test_kld_gate_end_to_end_with_the_baseline_cached(tiny_dir, tmp_path, monkeypatch):
    """The kld gate: a model against itself reads KL 0 and top-1 agreement 1 and passes; a
    perturbed copy fails `max` with a KL that matches transformers' own; the baseline's
    log-probabilities come back from the cache (tensors beside the numbers), and a cache whose
    tensors are lost is recomputed."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("QTK_CACHE", str(tmp_path / "cache"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.down_proj.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    perturbed = tmp_path / "perturbed"
    hf.save_pretrained(perturbed)
    for f in tiny_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            (perturbed / f.name).write_bytes(f.read_bytes())
    gates = tmp_path / "kld.yaml"
    gates.write_text("gates:\n"
                     "  kld: {task: kld, args: {seq_len: 64, limit: 3}, max: 1.0e-4}\n"
                     "  top1: {task: kld, args: {seq_len: 64, limit: 3}, metric: top1_agreement, min: 0.999}\n")
    out = tmp_path / "v.json"
    args = ["--baseline", str(tiny_dir), "--gates", str(gates), "--dtype", "float32", "--json", str(out)]
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), *args])
    assert r.exit_code == 0, r.output
    rows = {x["gate"]: x for x in json.loads(out.read_text())["rows"]}
    assert rows["kld"]["candidate"] < 1e-5 and rows["top1"]["candidate"] == 1.0
    assert "±" in r.output
    [tensors] = list((tmp_path / "cache" / "gates").glob("*.safetensors"))

    r = CliRunner().invoke(main, ["eval", str(perturbed), *args])
    assert r.exit_code == 1 and "[baseline] kld: cached" in r.output, r.output
    rows = {x["gate"]: x for x in json.loads(out.read_text())["rows"]}
    from qtk.evals.perplexity import eval_windows
    from qtk.loading import load_tokenizer

    windows = eval_windows(load_tokenizer(str(tiny_dir)), "builtin", 64, 3)
    base_hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        p = base_hf(input_ids=windows).logits[:, :-1].log_softmax(-1)
        q = hf(input_ids=windows).logits[:, :-1].log_softmax(-1)
    want = (p.exp() * (p - q)).sum(-1)
    assert rows["kld"]["candidate"] == pytest.approx(want.mean().item(), rel=1e-3, abs=1e-5)  # float16 storage
    assert rows["kld"]["passed"] is False and 0 < rows["kld"]["candidate_se"] < rows["kld"]["candidate"]

    tensors.unlink()  # the numbers without their tensors: recomputed, with a warning
    r = CliRunner().invoke(main, ["eval", str(perturbed), *args])
    assert r.exit_code == 1 and "[baseline] kld ..." in r.output, r.output


def test_bootstrap_matches_closed_forms():
    """The standard error of a mean of 0/1 outcomes is about sqrt(p (1 - p) / n); every
    aggregate over all units is the metric the task reports; draws are the same for one key."""
    values = [1] * 30 + [0] * 20
    u = bootstrap.units("mean", values)
    se = bootstrap.stderr(bootstrap.replicates(u, bootstrap.draws(50, "t")))
    assert se == pytest.approx(math.sqrt(0.6 * 0.4 / 50), rel=0.1)
    pairs = [[2.0, 10], [3.0, 10], [2.5, 20]]
    assert bootstrap.aggregate(bootstrap.units("exp_ratio", pairs)) == pytest.approx(math.exp(7.5 / 40))
    assert bootstrap.aggregate(bootstrap.units("bits_per_byte", [[-7.0, 5], [-3.0, 5]])) == \
        pytest.approx(1.0 / math.log(2))
    assert bootstrap.aggregate(bootstrap.units("p99", [[0.0] * 99, [1.0]])) == pytest.approx(np.percentile(
        [0.0] * 99 + [1.0], 99))
    assert (bootstrap.draws(7, "a") == bootstrap.draws(7, "a")).all()
    assert not (bootstrap.draws(7, "a") == bootstrap.draws(7, "b")).all()
    with pytest.raises(ValueError, match="unknown aggregate"):
        bootstrap.units("mode", [1])


def test_verdict_rows_carry_paired_standard_errors():
    """Both models err on the same hard windows: each perplexity's own standard error is large,
    the recovery's (paired) small; a candidate identical to the baseline has a recovery error of
    0; a metric without units shows none; the soft score has one."""
    rng = np.random.default_rng(0)
    hard = rng.uniform(1.5, 3.5, size=12)  # each window's mean NLL
    base_units = bootstrap.units("exp_ratio", [[h * 100, 100] for h in hard])
    cand_units = bootstrap.units("exp_ratio", [[(h + 0.05) * 100, 100] for h in hard])
    gates = GatesFile([Gate("ppl", "ppl", {}, None, {"max_increase_pct": 10.0}, None),
                       Gate("same", "json", {}, "valid_rate", {}, 1.0),
                       Gate("bare", "needle", {}, None, {"min": 0.5}, None)], 90.0, "g.yaml")
    flags = bootstrap.units("mean", [1, 0, 1, 1])
    base = {"ppl": {"ppl": bootstrap.aggregate(base_units), "_units": {"ppl": base_units}},
            "same": {"valid_rate": 0.75, "_units": {"valid_rate": flags}}, "bare": {"accuracy": 1.0}}
    cand = {"ppl": {"ppl": bootstrap.aggregate(cand_units), "_units": {"ppl": cand_units}},
            "same": {"valid_rate": 0.75, "_units": {"valid_rate": flags}}, "bare": {"accuracy": 1.0}}
    v = verdict(gates, base, cand)
    ppl, same, bare = v.rows
    assert ppl.baseline_se > 1.0 and ppl.candidate_se > 1.0 and ppl.recovery_se_pct < 0.2
    assert same.recovery_se_pct == 0.0 and v.soft_score_se_pct == 0.0
    assert bare.baseline_se is None and bare.recovery_se_pct is None
    assert "± " in v.table() and "paired bootstrap" in v.table()


def test_lm_eval_samples_become_units():
    """lm-eval's logged samples -> units per TASK/METRIC[,FILTER] whose aggregate is lm-eval's own
    aggregation of them."""
    from lm_eval.api.metrics import bits_per_byte, mean

    from qtk.evals.lm_eval_adapter import _units

    samples = [{"doc_id": 1, "filter": "none", "metrics": ["acc", "bits_per_byte"], "acc": 0.0,
                "bits_per_byte": (-50.0, 40)},
               {"doc_id": 0, "filter": "none", "metrics": ["acc", "bits_per_byte"], "acc": 1.0,
                "bits_per_byte": (-30.0, 35)}]
    config = {"metric_list": [{"metric": "acc", "aggregation": "mean"},
                              {"metric": "bits_per_byte", "aggregation": "bits_per_byte"}]}
    u = _units("t", samples, config)
    assert u["t/acc"]["values"] == [1.0, 0.0]  # in document order
    assert bootstrap.aggregate(u["t/acc"]) == mean([1.0, 0.0])
    assert bootstrap.aggregate(u["t/bits_per_byte"]) == pytest.approx(bits_per_byte([(-50.0, 40), (-30.0, 35)]))
    gen = [{"doc_id": 0, "filter": "strip", "metrics": ["exact_match"], "exact_match": np.float64(1.0)}]
    assert _units("g", gen, {})["g/exact_match,strip"] == {"agg": "mean", "values": [1.0]}


def test_cli_task_against_a_baseline(tiny_dir, tmp_path, monkeypatch):
    """`qtk eval MODEL --baseline BASE --task T` runs T on both and prints each metric of both with
    its standard error (the flags given set the task's options); kld without a baseline, and
    --report without --gates, are usage errors."""
    monkeypatch.setenv("QTK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cmp.json"
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--baseline", str(tiny_dir), "--task", "ppl",
                                  "--seq-len", "64", "--limit", "3", "--dtype", "float32", "--json", str(out)])
    assert r.exit_code == 0 and "ppl: baseline " in r.output and "±" in r.output, r.output
    doc = json.loads(out.read_text())
    assert doc["args"] == {"seq_len": 64, "limit": 3}
    ppl = next(m for m in doc["metrics"] if m["metric"] == "ppl")
    assert ppl["baseline"] == ppl["candidate"] and ppl["candidate_se"] > 0
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--task", "kld", "--dtype", "float32"])
    assert r.exit_code == 2 and "--baseline BASE" in r.output, r.output
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--baseline", str(tiny_dir), "--task", "kld",
                                  "--report", str(tmp_path / "r")])
    assert r.exit_code == 2 and "--report: only with --gates" in r.output, r.output
