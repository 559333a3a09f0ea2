"""The kernel each float layer runs by rows (runtime/packed_linear.py): a bf16 checkpoint's weights
kept in bf16, qtk's kernel for a few rows (float32 activations, the float32 products), oneDNN for
many (bf16 where the CPU has the units, QTK_CPU_BF16=1 forces it; float32 with QTK_CPU_BF16=0);
and the whole prompt's causal attention (runtime/attention.py)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from qtk.kernels import cpu as cpu_kernels
from tests.test_runtime import greedy_through_runtime, hf_model

pytestmark = [pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch"),
              pytest.mark.skipif(cpu_kernels.ops() is None, reason="no C++ compiler: qtk's CPU kernel is not built")]


def bf16_numbers(module: torch.nn.Module) -> torch.nn.Module:
    """Every float parameter rounded to bf16 and back: a bf16 checkpoint as the engine loads it."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.bfloat16().float())
    return module


@pytest.mark.parametrize("units", ["0", "1"])
def test_a_bf16_checkpoints_layer_takes_its_kernel_by_rows(monkeypatch, units):
    """A float32 Linear holding bf16 numbers becomes a WOQLinear. Below the first bf16 row count, qtk's
    float32 kernel gives F.linear's float32 result. With the units: where the CPU has AVX512-BF16, qtk's
    bf16 kernel from BF16_DOT_ROWS[0] rows (x rounded to bf16, float32 sums, y float32) and oneDNN
    from BF16_DOT_ROWS[1]; else oneDNN from many_rows (MANY_ROWS; float32 on AVX2-only CPUs,
    MANY_ROWS_AVX2); oneDNN in bf16 (x and y rounded to bf16,
    float32 sums). Without the units, oneDNN in float32. The module and the runtime's direct call agree."""
    monkeypatch.setenv("QTK_CPU_BF16", units)
    from qtk.runtime.packed_linear import BF16_DOT_ROWS, WOQLinear, many_rows, pack_linears

    torch.manual_seed(0)
    lin = bf16_numbers(torch.nn.Linear(256, 384))
    model = torch.nn.Sequential(copy.deepcopy(lin))
    assert pack_linears(model) == 1 and isinstance(model[0], WOQLinear)
    packed, direct, dot = model[0], model[0].direct(), model[0].dot
    dtype = torch.bfloat16 if units == "1" else torch.float32
    assert (dot is not None) == (units == "1" and cpu_kernels.ops().bf16_linear_runs())
    assert packed.many.packed.dtype == dtype
    assert packed.many.rows == (BF16_DOT_ROWS[1] if dot else many_rows(dtype))
    first = dot.lo if dot else packed.many.rows
    for rows in sorted({1, first - 1, first, packed.many.rows - 1, packed.many.rows, packed.many.rows + 7}):
        x = torch.randn(rows, 256)
        with torch.no_grad():
            got, want = packed(x), lin(x)
        assert torch.equal(direct(x), got)
        exact = x.bfloat16().float() @ lin.weight.T + lin.bias
        if rows < first or units == "0":
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        elif rows < packed.many.rows:  # qtk's bf16 kernel: the float32 sum of bf16 products, not rounded
            torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-5)
            assert not torch.equal(got, want)
        else:  # the float32 sum of bf16 products, rounded to bf16 (then the bias): within one bf16 step of it
            sums = (exact - lin.bias).detach()
            assert ((got - lin.bias - sums.bfloat16().float()).abs() <= sums.abs() * 2 ** -7 + 1e-6).all()
            assert not torch.equal(got, want)


def test_the_lm_head_multiplies_every_row_in_float32_and_offers_the_bf16_kernel(monkeypatch):
    """A bf16 lm_head (bf16_lm_head) gives the float32 products for any rows as a module (a quantized
    model's logits, a perplexity's); its `dot` (where the CPU has AVX512-BF16) is the runtime's, for a
    decode batch of a step in bf16: bf16-rounded rows, float32 sums and logits."""
    from qtk.runtime.packed_linear import BF16_DOT_ROWS, WOQLinear, bf16_lm_head

    monkeypatch.setenv("QTK_CPU_BF16", "1")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.lm_head = bf16_numbers(torch.nn.Linear(64, 1000, bias=False))
    weight = model.lm_head.weight.detach().clone()
    assert bf16_lm_head(model) and isinstance(model.lm_head, WOQLinear) and model.lm_head.many is None
    head, direct = model.lm_head, model.lm_head.direct()
    for rows in (1, BF16_DOT_ROWS[0], 300):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            got = head(x)
        assert torch.equal(direct(x), got)
        torch.testing.assert_close(got, x @ weight.T, atol=1e-5, rtol=1e-5)
    if head.dot is None:
        pytest.skip("CPU without AVX512-BF16: no bf16 kernel")
    x = torch.randn(BF16_DOT_ROWS[0], 64)
    got = head.dot(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.bfloat16().float() @ weight.T, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, x @ weight.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("units", ["0", "1"])
def test_prefill_in_bf16_keeps_the_logits_within_bf16_rounding(monkeypatch, units):
    """A bf16 checkpoint through the engine's build (q/k/v and gate/up fused, the MLP in bf16 from
    gate_up to down for many rows, the prefill attention in qtk's bf16 flash kernel where the CPU has
    AVX512-BF16, in its float32 math with QTK_CPU_BF16=0 on AVX-512): prompts of 24 tokens prefilled in
    one chunk (oneDNN), then decode steps of 2 rows (qtk's kernel). The logits follow the float32 model's:
    within float32 rounding with QTK_CPU_BF16=0, within bf16 rounding of the activations with the units."""
    monkeypatch.setenv("QTK_CPU_BF16", units)
    from qtk.runtime.models import build

    model = bf16_numbers(hf_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                  num_key_value_heads=2))
    runtime = build(copy.deepcopy(model))
    ops = runtime.cpu_ops
    assert ops is not None
    prompts = [list(range(30, 54)), list(range(70, 94))]
    _, want, _ = greedy_through_runtime(model, prompts, new_tokens=3, budget=64)
    calls = []
    kernel_runs = ops.prefill_attention_runs(bf16=units == "1")  # the flash kernel in the step's math
    if kernel_runs:
        kernel = ops.prefill_attention
        monkeypatch.setattr(ops, "prefill_attention", lambda *a, **k: calls.append(k["bf16"]) or kernel(*a, **k))
    _, got, _ = greedy_through_runtime(None, prompts, new_tokens=3, budget=64, runtime=runtime)
    many_mlp, bf16 = runtime._plan[0][-2:]
    assert (many_mlp is not None) == (bf16 is not None) == (units == "1")
    assert (runtime._bf16_rows is not None) == (units == "1")  # prefill steps in bf16 between the norms
    if kernel_runs:
        assert calls == [units == "1"] * 2 * len(runtime.layers)  # two prompts, every layer
    tol = dict(atol=2e-4, rtol=1e-4) if units == "0" else dict(atol=0.05, rtol=0.05)
    for a, b in zip(want.values(), got.values()):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), **tol)
    if units == "1":  # not the float32 numbers: the bf16 path ran
        assert any(not torch.allclose(torch.stack(b), torch.stack(a), atol=1e-5) for a, b in zip(want.values(), got.values()))
        # bf16 between the norms gives exactly the numbers of converting around each bf16 matmul
        runtime._bf16_rows = None
        _, per_matmul, _ = greedy_through_runtime(None, prompts, new_tokens=3, budget=64, runtime=runtime)
        for a, b in zip(per_matmul.values(), got.values()):
            assert torch.equal(torch.stack(a), torch.stack(b))


@pytest.mark.parametrize("units", ["0", "1"])
def test_a_bf16_decode_batch_attends_in_the_bf16_decode_kernel(monkeypatch, units):
    """Decode steps of 6 sequences of a bf16 checkpoint over a bf16 cache (at least BF16_DOT_ROWS[0] rows:
    the step's matmuls in bf16) attend in qtk's bf16 decode kernel where the CPU has AVX512-BF16, once
    per layer per step; with QTK_CPU_BF16=0 the float32-math kernel attends. Either way the logits
    follow the float32 model's within bf16 rounding."""
    monkeypatch.setenv("QTK_CPU_BF16", units)
    from qtk.runtime.models import build
    from qtk.runtime.packed_linear import BF16_DOT_ROWS

    model = bf16_numbers(hf_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                  num_key_value_heads=2))
    runtime = build(copy.deepcopy(model))
    ops = runtime.cpu_ops
    calls = []
    if hasattr(ops, "paged_decode_attention_bf16"):
        kernel = ops.paged_decode_attention_bf16
        monkeypatch.setattr(ops, "paged_decode_attention_bf16", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    head_rows = []
    if runtime.lm_head.dot is not None:  # the decode batches' logits on the lm_head's bf16 kernel
        dot = runtime.lm_head.dot
        monkeypatch.setattr(runtime.lm_head, "dot", dataclasses.replace(
            dot, op=lambda x, *a: head_rows.append(x.shape[0]) or dot.op(x, *a)))
    prompts = [list(range(10 + 7 * i, 30 + 9 * i)) for i in range(6)]
    assert len(prompts) >= BF16_DOT_ROWS[0]
    _, want, _ = greedy_through_runtime(model, prompts, new_tokens=4, budget=256)
    _, got, _ = greedy_through_runtime(None, prompts, new_tokens=4, budget=256, runtime=runtime, kv_dtype=torch.bfloat16)
    runs = units == "1" and ops.prefill_attention_runs()
    # 3 decode steps of 6 rows after the prefill step (which samples the first token), every layer
    assert calls == ([6] * 3 * len(runtime.layers) if runs else [])
    assert head_rows == ([6] * 4 if runs else [])  # and the 6 sampling rows of the prefill step (in bf16 too)
    for a, b in zip(want.values(), got.values()):  # the bf16 cache rounds K and V either way
        torch.testing.assert_close(torch.stack(b), torch.stack(a), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("budget", [64, 5])
def test_whole_prompt_and_chunked_prefill_attend_alike(budget):
    """A prompt in one chunk takes sdpa's causal flag, in chunks the offset mask: the same logits as
    transformers' either way (float32 weights, as a random model's)."""
    model = hf_model("llama")
    prompts = [list(range(30, 47)), list(range(60, 63))]
    _, got, _ = greedy_through_runtime(model, prompts, new_tokens=2, budget=budget)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        want = model(ids).logits[0, -1]
    first = next(iter(got.values()))[0]
    torch.testing.assert_close(first, want, atol=2e-4, rtol=1e-4)


def quant_linear(scheme: str, n: int = 384, k: int = 256, seed: int = 0):
    """A weight-only QuantLinear (round to nearest, groups of 32 for int4) with a bias, and its float layer."""
    from qtk.quant import quantize_weight
    from qtk.quant_linear import QuantLinear
    from qtk.schemes import preset

    g = torch.Generator().manual_seed(seed)
    s = preset(scheme, group_size=32 if "w4" in scheme else None)
    q, scale, zp = quantize_weight(torch.randn(n, k, generator=g) * 0.05, s.weights)
    layer = QuantLinear.from_codes(q, scale, zp, s, bias=torch.randn(n, generator=g), dtype=torch.float32)
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(layer.dequantized_weight(torch.float32))
        lin.bias.copy_(layer.bias)
    return layer, lin


@pytest.mark.parametrize("units", ["0", "1"])
@pytest.mark.parametrize("scheme", ["w4a16_asym", "w4a16", "w8a16"])
def test_a_bf16_checkpoints_weight_only_layer_multiplies_many_rows_in_bf16(monkeypatch, units, scheme):
    """A weight-only QuantLinear of a bf16 checkpoint (pack_linears' bf16) becomes a WOQLinear whose many
    rows, from QUANT_BF16_ROWS, run on qtk's bf16 kernel for its codes where the CPU has AVX512-BF16: x
    rounded to bf16, the dequantized weight exact, float32 sums. Fewer rows, QTK_CPU_BF16=0, or a
    checkpoint that is not bf16 (pack_linears' default): the float32 kernel, the float32 products."""
    monkeypatch.setenv("QTK_CPU_BF16", units)
    from qtk.runtime.packed_linear import QUANT_BF16_ROWS, QuantBF16Matmul, WOQLinear, pack_linears

    layer, lin = quant_linear(scheme)
    plain = torch.nn.Sequential(copy.deepcopy(layer))
    assert pack_linears(plain) == 1 and isinstance(plain[0], WOQLinear) and plain[0].many is None
    model = torch.nn.Sequential(copy.deepcopy(layer))
    assert pack_linears(model, bf16=True) == 1 and isinstance(model[0], WOQLinear)
    packed, direct, many = model[0], model[0].direct(), model[0].many
    runs = units == "1" and cpu_kernels.ops().bf16_linear_runs()
    assert isinstance(many, QuantBF16Matmul) == runs and (many is None) == (not runs)
    bits = 4 if "w4" in scheme else 8
    first = QUANT_BF16_ROWS[bits]
    assert "qtk bf16 dot products" in packed.weights if runs else packed.weights == f"int{bits}"
    for rows in (1, first - 1, first, first + 13, 300):
        x = torch.randn(rows, 256)
        with torch.no_grad():
            got, want = packed(x), lin(x)
            assert torch.equal(direct(x), got) and torch.equal(plain[0](x) if rows < first or not runs else got, got)
            exact = x.bfloat16().float() @ lin.weight.T + lin.bias
        if rows < first or not runs:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
            assert not torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_bf16_step_rounds_a_weight_only_layers_many_rows_to_bf16_as_onednn_does():
    """bf16_matmul of a weight-only layer on qtk's bf16 kernel (a step in bf16 between the norms): y float32
    below BF16_DOT_ROWS[1] rows, from there y rounded to bf16, as oneDNN gives a bf16 weight's; the sums
    are the same."""
    from qtk.runtime.packed_linear import BF16_DOT_ROWS, QuantBF16Matmul, bf16_matmul, pack_linears

    if not cpu_kernels.ops().bf16_linear_runs():
        pytest.skip("needs AVX512-BF16")
    model = torch.nn.Sequential(copy.deepcopy(quant_linear("w4a16_asym")[0]))
    pack_linears(model, bf16=True)
    assert isinstance(model[0].many, QuantBF16Matmul)
    rows, f = bf16_matmul(model[0])
    for T in (rows, BF16_DOT_ROWS[1] - 1, BF16_DOT_ROWS[1], 300):
        x = torch.randn(T, 256)
        y, full = f(x), model[0].many(x)
        assert full.dtype == torch.float32
        if T < BF16_DOT_ROWS[1]:
            assert torch.equal(y, full)
        else:
            assert y.dtype == torch.bfloat16 and torch.equal(y, full.bfloat16())


@pytest.mark.parametrize("units", ["0", "1"])
@pytest.mark.parametrize("scheme", ["w4a16", "w8a8"])
def test_a_quantized_bf16_checkpoint_prefills_in_bf16_within_bf16_rounding(monkeypatch, units, scheme):
    """A bf16 checkpoint quantized (its embedding and lm_head bf16 numbers) through the engine's build, with
    the units: its KV cache is bf16 ("auto", as a bf16 float checkpoint's) and its prefill chunks of 24
    rows attend in qtk's bf16 flash kernel; W4A16: every layer multiplies the chunk's 48 rows on qtk's bf16
    kernel for the codes (the step in bf16 between the norms, bf16_matmul), decode steps of 2 rows in the
    float32 kernel; W8A8: the int8 kernel as ever (W8A8Linear.bf16 marks the checkpoint). The logits follow
    the module forward's within bf16 rounding. QTK_CPU_BF16=0: the float32 path, within float32 rounding."""
    monkeypatch.setenv("QTK_CPU_BF16", units)
    from qtk.calibrate import quantize_model
    from qtk.recipe import from_flags
    from qtk.runtime.models import build
    from qtk.runtime.model_runner import kv_cache_spec
    from qtk.device import cpu_has_int8_dot
    from qtk.runtime.packed_linear import QuantBF16Matmul, W8A8Linear, bf16_checkpoint, steps_in_bf16

    model = bf16_numbers(hf_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                  num_key_value_heads=2))
    flags = dict(scheme="w4a16", group_size=32) if scheme == "w4a16" else dict(scheme="w8a8")
    quantize_model(model, from_flags("rtn", **flags), torch.randint(3, 256, (4, 16)), progress=False)
    assert bf16_checkpoint(model)
    runtime = build(copy.deepcopy(model))
    ops = runtime.cpu_ops
    runs = units == "1" and ops.bf16_linear_runs()
    assert steps_in_bf16(runtime) == runs
    kv_dtype = kv_cache_spec(runtime, "auto", torch.float32, "cpu", None)[0]
    assert kv_dtype == (torch.bfloat16 if runs else torch.float32)
    layers = 4 * len(runtime.layers)  # qkv, o, gate_up, down
    if scheme == "w4a16":
        assert len([m for m in runtime.modules() if isinstance(getattr(m, "many", None), QuantBF16Matmul)]) == (layers if runs else 0)
    else:
        w8a8 = [m for m in runtime.modules() if isinstance(m, W8A8Linear)]
        vnni = cpu_has_int8_dot() and ops.compiled_vnni()  # else the float32 kernel on the int8 codes (CpuW8A8Woq)
        assert len(w8a8) == (layers if vnni else 0) and all(m.bf16 == runs for m in w8a8)
    rows, attended = [], []
    for m in runtime.modules():  # the rows each call of the bf16 kernels multiplies
        many = getattr(m, "many", None)
        if isinstance(many, QuantBF16Matmul):
            m.many = dataclasses.replace(many, op=lambda x, *a, op=many.op: rows.append(x.shape[0]) or op(x, *a))
    prompts = [list(range(30, 54)), list(range(70, 94))]
    _, want, _ = greedy_through_runtime(model, prompts, new_tokens=3, budget=64)
    kernel = ops.prefill_attention
    monkeypatch.setattr(ops, "prefill_attention", lambda *a, **k: attended.append((a[0].shape[0], k["bf16"])) or kernel(*a, **k))
    _, got, _ = greedy_through_runtime(None, prompts, new_tokens=3, budget=64, runtime=runtime, kv_dtype=kv_dtype)
    assert (runtime._bf16_rows is not None) == (runs and scheme == "w4a16")
    # two prompts, every layer: in the flash kernel's bf16 math with the units, its float32 math on AVX-512 without
    kernel_runs = runs or ops.prefill_attention_runs(bf16=False)
    assert attended == ([(24, runs)] * 2 * len(runtime.layers) if kernel_runs else [])
    assert rows == ([48] * layers if runs and scheme == "w4a16" else [])  # the prefill step's, not the decodes'
    tol = dict(atol=2e-4, rtol=1e-4) if not runs else dict(atol=0.05, rtol=0.05)
    for a, b in zip(want.values(), got.values()):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), **tol)
    if runs:
        assert any(not torch.allclose(torch.stack(b), torch.stack(a), atol=1e-5) for a, b in zip(want.values(), got.values()))


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi"])
def test_the_generic_path_runs_a_quantized_bf16_checkpoint_within_bf16_rounding(model_type, tmp_path, monkeypatch):
    """A family without a native forward (transformers' modeling code, GenericModel) on a W4A16 checkpoint
    qtk wrote (bf16): with the units, its weight-only layers take qtk's bf16 kernel for many rows and its
    cache is bf16; the same greedy tokens, and prompt logprobs within bf16 rounding of QTK_CPU_BF16=0's."""
    from qtk import LLM, SamplingParams
    from qtk.runtime.models.generic import GenericModel
    from qtk.runtime.packed_linear import QuantBF16Matmul
    from test_any_decoder import prompts, quantize
    from zoo import saved, tiny

    ckpt = quantize(saved(tiny(model_type), tmp_path / "src"), "rtn", tmp_path / "q")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = {}
    for units in ("0", "1"):
        monkeypatch.setenv("QTK_CPU_BF16", units)
        llm = LLM(str(ckpt), dtype="float32", kv_cache_memory=2**22, block_size=4, max_num_batched_tokens=64)
        runs = units == "1" and cpu_kernels.ops().bf16_linear_runs()
        assert isinstance(llm.model, GenericModel)
        assert any(isinstance(getattr(m, "many", None), QuantBF16Matmul) for m in llm.model.modules()) == runs
        assert llm.runner.kv_caches[0].k.dtype == (torch.bfloat16 if runs else torch.float32)
        outs[units] = llm.generate(prompts(), params)
    for a, b in zip(outs["0"], outs["1"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 0.01 for t in x)
