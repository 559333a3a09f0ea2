"""The generic runtime path (runtime/models/generic.py): transformers' own modeling code with qtk's
paged attention plugged in through the AttentionInterface. Against transformers' forward over the
whole sequence on the same weights, for every type of tests/zoo.py: prompts prefilled in 7-token
chunks beside decodes that run past an 8-token window, on each attention backend; softcap
(Gemma 2), sinks (gpt-oss) and windows shown to matter; the INT8 KV cache; the engine end to end."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from qtk.errors import InputError
from qtk.runtime.config import EngineConfig
from qtk.runtime.model_runner import ModelRunner, kv_cache_spec, measure_kv_scales
from qtk.runtime.models import build
from qtk.runtime.models.generic import GenericModel
from qtk.runtime.models.llama import LlamaModel
from test_model_families import backend_context, prompts
from test_runtime import greedy_through_runtime
from zoo import ZOO, saved, tiny, tiny_config

# model types of the zoo whose modeling code the generic path cannot run, and what its error says
UNSUPPORTED: dict[str, str] = {}
TYPES = sorted(set(ZOO) - set(UNSUPPORTED))
CPU_FEW = ["gemma2", "gemma3_text", "gpt_oss", "mixtral", "phi3"]  # the C++ backend, falling back where it must
TRITON_FEW = ["gemma3_text", "gpt_oss", "phi3"]  # the Triton kernels (interpreted), falling back where they must


def check_against_transformers(model, runtime=GenericModel, backend="torch", atol=2e-4, **kv):
    """Prompts of 23, 9 and 5 tokens, 7-token prefill chunks, 6 greedy decodes each (the 5-token
    prompt's decodes pass position 8): every sampling step's logits are transformers' there."""
    with backend_context(backend):
        seqs, logits, _ = greedy_through_runtime(model, prompts(23, 9, 5), new_tokens=6, backend=backend,
                                                 runtime=runtime, **kv)
    for s in seqs:
        with torch.no_grad():
            want = model(torch.tensor([s.token_ids])).logits[0, s.num_prompt_tokens - 1:len(s) - 1]
        torch.testing.assert_close(torch.stack(logits[s.seq_id]), want, atol=atol, rtol=1e-4)
    return seqs, logits


@pytest.mark.parametrize("model_type", TYPES)
def test_generic_path_gives_transformers_logits(model_type):
    check_against_transformers(tiny(model_type))


@pytest.mark.parametrize("model_type", CPU_FEW)
def test_generic_path_on_the_cpu_backend(model_type):
    check_against_transformers(tiny(model_type), backend="cpu")


@pytest.mark.parametrize("model_type", TRITON_FEW)
def test_generic_path_on_the_triton_backend(model_type):
    check_against_transformers(tiny(model_type), backend="triton")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("model_type", TYPES)
def test_generic_path_on_every_backend_sweep(model_type, backend):
    check_against_transformers(tiny(model_type), backend=backend)


def test_the_probe_reads_each_layers_window_softcap_and_sinks():
    gemma2, gpt_oss = GenericModel(tiny("gemma2")), GenericModel(tiny("gpt_oss"))
    assert (gemma2.windows, gemma2.softcaps, gemma2.has_sinks) == ([8, None], [50.0, 50.0], [False, False])
    assert (gpt_oss.windows, gpt_oss.softcaps, gpt_oss.has_sinks) == ([8, None], [None, None], [True, True])
    assert GenericModel(tiny("gemma3_text")).windows == [8, None]
    assert GenericModel(tiny("mistral")).windows == [8, 8]
    granite = GenericModel(tiny("granite"))
    assert (granite.num_heads, granite.num_kv_heads, granite.head_dim) == (4, 2, 16)


@pytest.mark.parametrize("model_type, overrides, without", [
    ("gemma2", dict(attn_logit_softcapping=0.5), dict(attn_logit_softcapping=None)),  # softcap
    ("gpt_oss", {}, None),  # sinks (set large below)
    ("gemma3_text", {}, dict(sliding_window=1000)),  # window (one no prompt reaches)
])
def test_softcap_sinks_and_windows_matter_and_are_transformers(model_type, overrides, without):
    """Each term, made large, changes the logits by far more than the tolerance, and the generic
    path still gives transformers' logits: the test would see a term dropped."""
    model = tiny(model_type, **overrides)
    for layer in model.model.layers:  # random weights give scores of ~1e-3, which no cap touches
        layer.self_attn.q_proj.weight.data *= 30
        if model_type == "gpt_oss":
            torch.nn.init.normal_(layer.self_attn.sinks, std=3.0)
    seqs, logits = check_against_transformers(model)
    if without is None:
        plain = tiny(model_type, **overrides)
        plain.load_state_dict(model.state_dict())
        for layer in plain.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)  # a sink of weight exp(-1e4) = 0: no sink
    else:
        plain = tiny(model_type, **without)
        plain.load_state_dict(model.state_dict())
    s = seqs[0]
    with torch.no_grad():
        other = plain(torch.tensor([s.token_ids])).logits[0, s.num_prompt_tokens - 1:len(s) - 1]
    assert (torch.stack(logits[s.seq_id]) - other).abs().max() > 1e-2


def test_int8_kv_cache_on_the_generic_path_stays_close():
    """INT8 KV cache with scales measured at load (per KV head), on Gemma 2 (softcap) and gpt-oss
    (sinks): close to transformers' float logits, and not equal to them (the cache is quantized)."""
    for model_type in ("gemma2", "gpt_oss"):
        model = tiny(model_type)
        runtime = GenericModel(model)
        scales = measure_kv_scales(runtime, prompts(40)[0], torch.int8, "cpu")
        assert len(scales) == 2 and scales[0][0].shape == (2, 1, 1)
        with pytest.raises(AssertionError):  # not the float cache's logits
            check_against_transformers(model, runtime, atol=1e-6, kv_dtype=torch.int8, kv_scales=scales)
        check_against_transformers(model, runtime, atol=5e-2, kv_dtype=torch.int8, kv_scales=scales)


def test_checkpoint_kv_scales_are_read_from_the_attention_modules():
    from qtk.kv_scales import cache_scheme

    runtime = GenericModel(tiny("gemma2"))
    for i, attn in enumerate(runtime.attentions):
        attn.register_buffer("k_scale", torch.full((2, 1, 1), 0.01 * (i + 1)))
        attn.register_buffer("v_scale", torch.full((2, 1, 1), 0.02 * (i + 1)))
        attn.kv_scheme = cache_scheme(torch.int8)
    dtype, scales = kv_cache_spec(runtime, "int8", torch.float32, "cpu", tokenizer=None)
    assert dtype == torch.int8
    assert [t.flatten()[0].item() for pair in scales for t in pair] == pytest.approx([0.01, 0.02, 0.02, 0.04])


def test_native_families_go_through_llama_model_and_others_through_generic():
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"):
        assert type(build(tiny(model_type))) is LlamaModel
    for model_type in ("olmo2", "cohere", "gpt_neox"):
        assert type(build(tiny(model_type))) is GenericModel


def test_model_impl_chooses_the_path_as_vllms_does():
    """model_impl "transformers" runs a Llama-family model on the generic path; "qtk" refuses a type
    qtk has no native forward for, in one line naming it."""
    assert type(build(tiny("qwen3"), "transformers")) is GenericModel
    assert type(build(tiny("qwen3"), "qtk")) is LlamaModel
    with pytest.raises(InputError, match="no native forward for model_type 'olmo2'"):
        build(tiny("olmo2"), "qtk")
    with pytest.raises(InputError, match="model_impl must be one of"):
        EngineConfig("m", model_impl="vllm")


def test_generic_path_of_a_llama_model_agrees_with_the_native_path():
    """The same Llama weights through LlamaModel and GenericModel: the same logits at every step."""
    model = tiny("mistral")  # with its 8-token window
    _, native = greedy_through_runtime(model, prompts(23, 9, 5), new_tokens=6, backend="torch")[:2]
    _, generic = greedy_through_runtime(model, prompts(23, 9, 5), new_tokens=6, backend="torch",
                                        runtime=GenericModel)[:2]
    for a, b in zip(native.values(), generic.values()):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", TYPES)
def test_the_engines_build_keeps_transformers_logits(model_type):
    """The engine's build packs every float32 Linear for oneDNN (and the lm_head into bf16 where its
    weight is bf16 numbers): the modeling code still runs and gives transformers' logits (against an
    unpacked twin), on the backend the runner picks."""
    model, twin = tiny(model_type), tiny(model_type)
    runtime = build(model)
    seqs, logits, _ = greedy_through_runtime(model, prompts(12), new_tokens=4, runtime=runtime)
    with torch.no_grad():
        want = twin(torch.tensor([seqs[0].token_ids])).logits[0, 11:-1]
    torch.testing.assert_close(torch.stack(logits[seqs[0].seq_id]), want, atol=2e-4, rtol=1e-4)


def test_longrope_is_fixed_at_load_on_the_generic_path():
    """longrope's factors, which transformers picks per forward by its last position, are fixed at
    load (the long ones, past original_max_position_embeddings 32): a 50-token prompt prefilled in
    7-token chunks (the first ones below position 32) and its decodes get the logits of transformers'
    one-shot forward (on an unpinned twin)."""
    from test_model_families import LONGROPE

    model, twin = (tiny("llama", rope_scaling=LONGROPE) for _ in range(2))
    seqs, logits, _ = greedy_through_runtime(model, prompts(50), new_tokens=3, backend="torch", runtime=GenericModel)
    with torch.no_grad():
        want = twin(torch.tensor([seqs[0].token_ids])).logits[0, 49:-1]
    torch.testing.assert_close(torch.stack(logits[seqs[0].seq_id]), want, atol=2e-4, rtol=1e-4)


def test_a_model_whose_code_drops_the_kwargs_gets_the_step_on_its_attention_modules():
    """Nemotron's decoder layer does not pass the forward's kwargs on to attention: the step goes to
    its two attention modules for each forward instead (and is gone after it); its logits are
    transformers' (the zoo sweep). Models that pass the kwargs hold nothing."""
    nemotron = GenericModel(tiny("nemotron"))
    assert nemotron._step_holders == nemotron.attentions and len(nemotron.attentions) == 2
    assert all("qtk_step" not in m.__dict__ for m in nemotron.attentions)
    assert GenericModel(tiny("gemma"))._step_holders == []


def test_recurrent_and_linear_attention_layers_fail_at_construction():
    model = tiny("gemma", layer_types=["linear_attention", "full_attention"])  # as Qwen3-Next's config names them
    with pytest.raises(InputError, match=r"layers of type linear_attention: qtk runs attention-only decoders"):
        build(model)


def test_a_model_without_attention_interface_support_fails_at_construction():
    model = tiny("gemma")
    type(model)._supports_attention_backend, old = False, type(model)._supports_attention_backend
    try:
        with pytest.raises(InputError, match="does not support transformers' attention interface"):
            build(model)
    finally:
        type(model)._supports_attention_backend = old


def test_graphs_are_off_on_the_generic_path_with_the_reason():
    runner = ModelRunner(GenericModel(tiny("gemma")), 4, 4, attention_backend="triton")
    assert "the generic path" in runner.capture_graphs(4, 64, record=None)


@pytest.mark.parametrize("model_type", ["cohere2", "qwen3_moe"])
def test_engine_end_to_end_with_prefix_caching(model_type, tmp_path):
    """LLM(path) on a non-Llama type: greedy tokens and prompt logprobs are transformers', and a
    second prompt sharing the first's prefix hits the prefix cache."""
    from transformers import AutoModelForCausalLM

    from qtk import LLM, SamplingParams

    path = saved(tiny(model_type), tmp_path / model_type)
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22, block_size=4, max_num_batched_tokens=16)
    assert type(llm.model) is GenericModel
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    first, = prompts(30)
    second = first[:24] + [7, 8, 9]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for prompt, params in ((first, replace(greedy, prompt_logprobs=0)), (second, greedy)):
        out = llm.generate([prompt], params)[0]
        with torch.no_grad():
            lp = ref(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].log_softmax(-1)
        assert out.outputs[0].token_ids == lp[len(prompt) - 1:-1].argmax(-1).tolist()
        for i, entry in enumerate((out.prompt_logprobs or [])[1:], start=1):
            assert abs(entry[prompt[i]] - lp[i - 1, prompt[i]].item()) < 1e-4
        assert len(out.prompt_logprobs or []) == (len(prompt) if params.prompt_logprobs is not None else 0)
    assert llm.stats().prefix_cache_hits == 24  # the second prompt's first six 4-token blocks


def test_engine_int8_kv_cache_on_the_generic_path(tmp_path, monkeypatch, caplog):
    """gpt-oss (sinks, a window) through LLM with an INT8 KV cache whose scales are measured at load:
    its prompt logprobs stay within 0.05 of transformers' float ones."""
    from transformers import AutoModelForCausalLM

    import qtk.loading
    from qtk import LLM, SamplingParams

    path = saved(tiny("gpt_oss"), tmp_path / "gpt_oss")
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22, block_size=4, max_num_batched_tokens=16,
              kv_cache_dtype="int8")
    assert llm.kv_dtype == torch.int8 and "measuring them on built-in text at load" in caplog.text
    prompt, = prompts(30)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        lp = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)
    errors = [abs(entry[prompt[i]] - lp[i - 1, prompt[i]].item()) for i, entry in enumerate(out.prompt_logprobs)
              if i > 0]
    assert 0 < max(errors) < 0.05
