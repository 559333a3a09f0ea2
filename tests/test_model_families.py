"""Config features of the Llama family the runtime must read as transformers does: sliding-window
attention (Mistral on every layer, Qwen2/Qwen3 on the layers past max_window_layers) and RoPE
scalings whose frequencies transformers picks per forward (longrope). Each against transformers'
forward over the whole sequence, through chunked prefills, decodes and every attention backend."""
from __future__ import annotations

import contextlib

import pytest
import torch

from interop import TINY, byte_tokenizer
from qtk.runtime.model_runner import ModelRunner
from qtk.runtime.models.native import sliding_windows
from test_runtime import greedy_through_runtime

CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
WINDOWED = {"mistral": dict(sliding_window=8),  # every layer
            "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),  # layer 1 only
            "qwen3": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, head_dim=16)}
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}


def tiny(family: str, **overrides):
    """A seeded random model of the family (TINY's sizes), eval mode, float32."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[family])
    torch.manual_seed(0)
    return model_cls(config_cls(**{**TINY, **overrides})).eval()


def saved(model, path) -> str:
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def backend_context(backend: str):
    if backend == "cpu":
        from qtk.kernels import cpu as cpu_kernels

        if cpu_kernels.ops() is None:
            pytest.skip("no C++ compiler: no qtk CPU ops")
    if backend == "triton":
        pytest.importorskip("triton")
        from test_kernels_interp import exact_interpretation

        return exact_interpretation()
    return contextlib.nullcontext()


def test_sliding_windows_are_read_as_transformers_reads_them():
    assert sliding_windows(tiny("mistral", sliding_window=8).config) == [8, 8]
    assert sliding_windows(tiny("mistral", sliding_window=None).config) == [None, None]
    assert sliding_windows(tiny("qwen2", **WINDOWED["qwen2"]).config) == [None, 8]
    assert sliding_windows(tiny("qwen2", use_sliding_window=False, sliding_window=8).config) == [None, None]
    assert sliding_windows(tiny("llama").config) == [None, None]


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_window_attention_is_transformers(family, backend):
    """A window of 8 over prompts of 23 and 5 tokens prefilled in 7-token chunks beside decodes
    that grow past the window: every sampling step's logits are transformers' at that position
    (the runtime used to attend to the whole context)."""
    model = tiny(family, **WINDOWED[family])
    with backend_context(backend):
        seqs, logits, _ = greedy_through_runtime(model, prompts(23, 5), new_tokens=6, backend=backend)
    for s in seqs:
        with torch.no_grad():
            want = model(torch.tensor([s.token_ids])).logits[0, s.num_prompt_tokens - 1:len(s) - 1]
        torch.testing.assert_close(torch.stack(logits[s.seq_id]), want, atol=2e-4, rtol=1e-4)


def test_engine_sliding_window_prompt_logprobs_and_greedy_text(tmp_path):
    """Mistral with sliding_window 16 and a 50-token prompt through the engine (16-token prefill
    chunks): prompt logprobs and greedy tokens are transformers'; decodes past the window run
    with no CUDA graph to skip it (the graphs replay kernels that have no window)."""
    from transformers import AutoModelForCausalLM

    from qtk import LLM, SamplingParams

    path = saved(tiny("mistral", sliding_window=16), tmp_path / "mistral")
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22, block_size=8, max_num_batched_tokens=16)
    [prompt] = prompts(50)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0))[0]
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        lp = ref(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].log_softmax(-1)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(entry[prompt[i]] - lp[i - 1, prompt[i]].item()) < 1e-4
    assert out.outputs[0].token_ids == lp[len(prompt) - 1:-1].argmax(-1).tolist()
    runner = ModelRunner(llm.model, 4, 4, attention_backend="triton")
    assert "sliding window 16 < max_model_len 64" in runner.capture_graphs(4, 64, record=None)


def test_longrope_frequencies_do_not_depend_on_the_chunk_or_the_batch(tmp_path):
    """transformers picks longrope's short or long factors per forward by its last position; the
    runtime fixes them at load (the long ones, as vLLM where max_model_len > the original 32): a
    50-token prompt prefilled in 16-token chunks gets transformers' one-shot prompt logprobs, and
    a short prompt's are the same alone and beside a long one (they used to differ by ~3e-3)."""
    from transformers import AutoModelForCausalLM

    from qtk import LLM, SamplingParams

    path = saved(tiny("llama", rope_scaling=LONGROPE), tmp_path / "longrope")
    long, short = prompts(50, 20)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    chunks = LLM(path, dtype="float32", kv_cache_memory=2**22, block_size=8, max_num_batched_tokens=16)
    chunked = chunks.generate([long], params)[0].prompt_logprobs
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        lp = ref(torch.tensor([long])).logits[0].log_softmax(-1)
    for i, entry in enumerate(chunked[1:], start=1):
        assert abs(entry[long[i]] - lp[i - 1, long[i]].item()) < 2e-5  # before: 1.3e-4
    llm = LLM(path, dtype="float32", kv_cache_memory=2**22, block_size=8)  # both prompts in one step
    alone = llm.generate([short], params)[0].prompt_logprobs
    beside = llm.generate([short, long], params)[0].prompt_logprobs
    for a, b, token in zip(alone[1:], beside[1:], short[1:]):
        assert abs(a[token] - b[token]) < 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_triton_forward_is_the_eager_one_in_bf16(family, monkeypatch):
    """NativeModel._forward_triton (on CUDA: kernels/fused.py's add + RMSNorm, RoPE and GLU)
    against the eager forward over the same Triton attention, in bf16, where every rounding shows:
    the same greedy tokens and logits within a few bf16 units (the two may sum the norm's mean in
    another order; here they agree exactly, and a sign flip in RoPE moves them by 1e-2 of the
    largest). In float32 the tests above hold it to transformers' logits."""
    from qtk.runtime.models.native import NativeModel

    model = tiny(family).to(torch.bfloat16)
    runs = []
    with backend_context("triton"):
        for fusable in (True, False):
            monkeypatch.setattr(NativeModel, "triton_fusable", property(lambda self, f=fusable: f))
            seqs, logits, _ = greedy_through_runtime(model, prompts(9, 4), new_tokens=4, backend="triton")
            runs.append(([s.token_ids for s in seqs], logits))
    (fused_ids, fused_logits), (eager_ids, eager_logits) = runs
    assert fused_ids == eager_ids
    for fused_rows, eager_rows in zip(fused_logits.values(), eager_logits.values()):  # seqs in the same order
        a, b = torch.stack(fused_rows).float(), torch.stack(eager_rows).float()
        assert (a - b).abs().max() <= 2e-3 * b.abs().max()


def test_concatenated_projections_through_the_fused_triton_forward():
    """On CUDA the engine concatenates plain sibling Linears (packed_linear.concatenated: q/k/v into
    qkv_proj, gate/up into gate_up_proj); the fused Triton forward then rotates q and k side by side
    in qkv's output and splits gate_up in the GLU kernel: the unconcatenated model's greedy tokens and
    logits, in bf16, with a bias on q/k/v (Qwen2)."""
    import copy

    from qtk.runtime.packed_linear import concatenated

    model = tiny("qwen2").to(torch.bfloat16)
    joined = copy.deepcopy(model)
    for layer in joined.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = concatenated([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_proj = concatenated([mlp.gate_proj, mlp.up_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    runs = []
    with backend_context("triton"):
        for m in (model, joined):
            seqs, logits, _ = greedy_through_runtime(m, prompts(9, 4), new_tokens=4, backend="triton")
            runs.append(([s.token_ids for s in seqs], list(logits.values())))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        a, b = torch.stack(a).float(), torch.stack(b).float()
        assert (a - b).abs().max() <= 2e-3 * b.abs().max()
