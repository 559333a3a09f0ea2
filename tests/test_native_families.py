"""The native forward (runtime/models/llama.py) of the families beyond Llama's: Gemma 1-3 ((1 + w)
norms, GeGLU, sandwich norms, attention and final soft-capping, alternating windows, Gemma 3's
local and global RoPE, q/k norms) and Phi-3/4 (q/k/v and gate/up fused in the checkpoint, a partial
RoPE). Against transformers' forward on the same weights (prompts prefilled in 7-token chunks beside
decodes past an 8-token window), on the torch and the C++ CPU backend; against the generic path on
the same weights; with an INT8 KV cache."""
from __future__ import annotations

import pytest
import torch

from qtk.runtime.model_runner import measure_kv_scales
from qtk.runtime.models.generic import GenericModel
from qtk.runtime.models.llama import FAMILIES, LlamaModel
from test_generic_runtime import check_against_transformers
from test_model_families import prompts
from test_runtime import greedy_through_runtime
from zoo import tiny

NEW = ["gemma", "gemma2", "gemma3_text", "phi3"]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("model_type", NEW)
def test_native_path_gives_transformers_logits(model_type, backend):
    check_against_transformers(tiny(model_type), runtime=LlamaModel, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_partial_rope_of_phi4_mini(backend):
    """Phi-4-mini rotates 3/4 of each head (partial_rotary_factor): the rest passes through."""
    model = tiny("phi3", partial_rotary_factor=0.5)
    runtime = LlamaModel(model)
    assert runtime.rotary_dim == runtime.head_dim // 2
    check_against_transformers(model, runtime=runtime, backend=backend)


def test_gemma3_has_a_rope_per_layer_type_and_gemma2_softcaps():
    gemma3 = LlamaModel(tiny("gemma3_text"))
    assert gemma3.rope_types == ["sliding_attention", "full_attention"] and gemma3.windows == [8, None]
    local, full = gemma3.rope_inv_freq_sliding_attention, gemma3.rope_inv_freq_full_attention
    assert not torch.equal(local, full)  # rope_local_base_freq vs rope_theta
    gemma2 = LlamaModel(tiny("gemma2"))
    assert [t.softcap for t in gemma2.terms] == [50.0, 50.0] and gemma2.final_softcap == 30.0
    assert gemma2.why_no_graphs and gemma3.why_no_graphs is None


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_native_and_generic_paths_agree_on_the_cpu_backend(model_type):
    model = tiny(model_type)
    runs = [greedy_through_runtime(model, prompts(23, 9, 5), new_tokens=6, backend="cpu", runtime=r)[1]
            for r in (LlamaModel, GenericModel)]
    for a, b in zip(*(r.values() for r in runs)):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), atol=1e-5, rtol=1e-5)


def test_int8_kv_cache_on_the_native_gemma2_stays_close():
    model = tiny("gemma2")
    runtime = LlamaModel(model)
    scales = measure_kv_scales(runtime, prompts(40)[0], torch.int8, "cpu")
    with pytest.raises(AssertionError):  # not the float cache's logits
        check_against_transformers(model, runtime, backend="cpu", atol=1e-6, kv_dtype=torch.int8, kv_scales=scales)
    check_against_transformers(model, runtime, backend="cpu", atol=5e-2, kv_dtype=torch.int8, kv_scales=scales)


def test_triton_backend_runs_gemma3_natively():
    check_against_transformers(tiny("gemma3_text"), runtime=LlamaModel, backend="triton")


def test_every_native_family_is_in_the_zoo():
    from zoo import ZOO

    assert set(FAMILIES) <= set(ZOO)
