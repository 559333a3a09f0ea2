"""GPTQ and AWQ checkpoints (qtk/hub_formats.py) against the tools that define their layouts.

tests/data/hub_formats holds a tiny Llama packed by AutoGPTQ's and AutoAWQ's own code
(scripts/hub_fixtures.sh), beside each one the weights as that tool's forward dequantizes them.
qtk must read the same weights, run them through the engine as transformers runs the dequantized
model, and refuse what it cannot read with a message naming the problem.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from interop import quant_linears, weight_only
from qtk.checkpoint import load_quantized
from qtk.errors import CheckpointError
from qtk.quant import pack_int32, unpack_int32

DATA = Path(__file__).parent / "data" / "hub_formats"
FIXTURES = ("gptq_sym_actorder", "gptq_asym", "gptq_int8_channel", "awq_gemm")
FP16_ROUNDING = 2.0 ** -11  # the tools dequantize in fp16, qtk in float32


def _copy(name: str, tmp_path: Path) -> Path:
    d = tmp_path / name
    shutil.copytree(DATA / name, d)
    return d


def _edit(d: Path, tensors=None, config=None) -> None:
    if tensors is not None:
        t = load_file(str(d / "model.safetensors"))
        tensors(t)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name", FIXTURES)
def test_weights_are_the_tools_own(name):
    """Every quantized Linear dequantizes to the tool's own weight (within fp16 rounding)."""
    model = load_quantized(DATA / name)
    ref = load_file(str(DATA / f"{name}.reference.safetensors"))
    layers = quant_linears(model)
    assert {f"{n}.weight" for n in layers} == set(ref)
    for n, q in layers.items():
        w, r = q.dequantized_weight(torch.float32), ref[f"{n}.weight"].float()
        assert ((w - r).abs() <= r.abs() * FP16_ROUNDING + 1e-7).all(), n


def test_schemes_follow_each_layers_tensors():
    sym = next(iter(quant_linears(load_quantized(DATA / "gptq_sym_actorder")).values()))
    w = sym.scheme.weights
    assert (w.num_bits, w.strategy, w.group_size, w.symmetric) == (4, "group", 32, True)
    assert hasattr(sym, "weight_g_idx") and not hasattr(sym, "weight_zero_point")  # act-order kept
    asym = next(iter(quant_linears(load_quantized(DATA / "gptq_asym")).values()))
    assert not asym.scheme.weights.symmetric and not hasattr(asym, "weight_g_idx")  # trivial g_idx dropped
    int8 = next(iter(quant_linears(load_quantized(DATA / "gptq_int8_channel")).values()))
    assert (int8.scheme.weights.num_bits, int8.scheme.weights.strategy) == (8, "channel")


@pytest.mark.parametrize("name", FIXTURES)
def test_engine_runs_them_as_transformers_runs_the_weights(name):
    """The runtime's kernels (act-order as a column permutation included) against transformers
    on the dequantized model: greedy tokens equal, prompt logprobs within 1e-4."""
    _engine_matches_transformers(DATA / name)


def _engine_matches_transformers(path: Path) -> None:
    from qtk import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory=2**20)
    prompt = list(range(40, 80))
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1))[0]
    ref = weight_only(load_quantized(path)).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + out.outputs[0].token_ids])
        lp = ref(ids).logits[0].float().log_softmax(-1)
    assert out.outputs[0].token_ids == lp[len(prompt) - 1:-1].argmax(-1).tolist()
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(entry[prompt[i]] - lp[i - 1, prompt[i]].item()) < 1e-4


def test_gptq_v2_zeros_are_stored_without_the_offset(tmp_path):
    """GPTQModel's v2 stores zero, v1 zero - 1: the same weights either way."""
    d = _copy("gptq_asym", tmp_path)

    def plus_one(t):
        for k in [k for k in t if k.endswith(".qzeros")]:
            z = unpack_int32(t[k], 4, t[k].shape[1] * 8)  # signed: stored - 8
            t[k] = pack_int32(z + 1, 4)

    _edit(d, tensors=plus_one, config=lambda qc: qc.update(checkpoint_format="gptq_v2"))
    a, b = quant_linears(load_quantized(DATA / "gptq_asym")), quant_linears(load_quantized(d))
    for n in a:
        assert torch.equal(a[n].dequantized_weight(), b[n].dequantized_weight()), n


def test_a_zero_bias_autogptq_saved_is_dropped(tmp_path):
    d = _copy("gptq_asym", tmp_path)
    _edit(d, tensors=lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64).half()}))
    assert quant_linears(load_quantized(d))["model.layers.0.self_attn.q_proj"].bias is None
    _edit(d, tensors=lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(64).half()}))
    with pytest.raises(CheckpointError, match="q_proj.bias is not zero"):
        load_quantized(d)


@pytest.mark.parametrize("name, edit, match", [
    ("awq_gemm", lambda qc: qc.update(version="gemv"), "AWQ version 'gemv' is not supported"),
    ("gptq_asym", lambda qc: qc.update(bits=3), "3-bit GPTQ is not supported"),
    ("gptq_asym", lambda qc: qc.update(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    ("gptq_asym", lambda qc: qc.update(is_marlin_format=True), "checkpoint_format 'marlin'"),  # AutoGPTQ 0.6
    ("gptq_asym", lambda qc: qc.update(group_size=16), "do not fit group_size 16"),
    ("gptq_asym", lambda qc: qc.update(quant_method="bitsandbytes"), "qtk reads compressed-tensors"),
])
def test_configs_qtk_cannot_read_are_named(tmp_path, name, edit, match):
    d = _copy(name, tmp_path)
    _edit(d, config=edit)
    with pytest.raises(CheckpointError, match=match):
        load_quantized(d)


def test_broken_tensors_are_named(tmp_path):
    d = _copy("gptq_asym", tmp_path)
    _edit(d, tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.qzeros"))
    with pytest.raises(CheckpointError, match="up_proj has a qweight but no qzeros"):
        load_quantized(d)
    d = _copy("gptq_asym", tmp_path / "c")
    _edit(d, tensors=lambda t: t.update({"model.layers.0.mlp.up_proj.qweight":
                                         t["model.layers.0.mlp.up_proj.qweight"].view(torch.int16)}))
    with pytest.raises(CheckpointError, match="up_proj.qweight is int16; qtk reads int32-packed"):
        load_quantized(d)
    d = _copy("awq_gemm", tmp_path / "b")
    _edit(d, tensors=lambda t: t.update({"model.layers.0.mlp.down_proj.qweight":
                                         t["model.layers.0.mlp.down_proj.qweight"][:64]}))
    with pytest.raises(CheckpointError, match=r"down_proj: qweight has shape \[64, 8\], the layer needs \[128, 8\]"):
        load_quantized(d)


def _int32(words: torch.Tensor) -> torch.Tensor:
    w = words & 0xFFFFFFFF
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def test_a_v1_zero_of_0_is_read_as_gptqmodel_writes_it(tmp_path):
    """GPTQModel packs v2 zeros and saves v1 as qzeros - 0x11111111, word arithmetic
    (utils/model.py convert_gptq_v2_to_v1_format_module): a zero of 0 borrows from the next field,
    and GPTQModel reads it back by adding 0x11111111. The same layer saved both ways reads the same."""
    v2, v1 = _copy("gptq_asym", tmp_path / "v2"), _copy("gptq_asym", tmp_path / "v1")
    t = load_file(str(DATA / "gptq_asym" / "model.safetensors"))
    zeros = {}  # v2 zeros, signed (zero - 8): the fixture's v1 has no wrapped field, so + 1 in each
    for k in [k for k in t if k.endswith(".qzeros")]:
        zeros[k] = unpack_int32(t[k], 4, t[k].shape[1] * 8) + 1
    key = "model.layers.0.mlp.up_proj.qzeros"
    z = zeros[key]
    z[0, 0], z[0, 1], z[1, 7] = -8, -7, -8  # zeros 0, 1, 0: borrows into the next field and out of the word
    words = {k: pack_int32(v, 4) for k, v in zeros.items()}
    _edit(v2, tensors=lambda t: t.update(words), config=lambda qc: qc.update(checkpoint_format="gptq_v2"))
    _edit(v1, tensors=lambda t: t.update({k: _int32(w.long() - 0x11111111) for k, w in words.items()}))
    a, b = quant_linears(load_quantized(v2)), quant_linears(load_quantized(v1))
    for layers in (a, b):  # zero points [out, groups], signed: zero - 8
        assert torch.equal(layers["model.layers.0.mlp.up_proj"].zero_point().t(), z)
    for n in a:
        assert torch.equal(a[n].dequantized_weight(), b[n].dequantized_weight()), n


def test_awq_without_zero_point_is_symmetric(tmp_path):
    """GPTQModel's AWQ default (sym=True) writes zero_point false, version gemm and qzeros holding
    2^(b-1) (looper/awq_processor.py pseudo_quantize_tensor): vLLM reads it, so qtk must."""
    sym, asym = _copy("awq_gemm", tmp_path / "sym"), _copy("awq_gemm", tmp_path / "asym")

    def eights(t):
        for k in [k for k in t if k.endswith(".qzeros")]:
            t[k] = torch.full_like(t[k], _int32(torch.tensor(0x88888888)).item())

    _edit(sym, tensors=eights, config=lambda qc: qc.update(zero_point=False))
    _edit(asym, tensors=eights)
    a, b = quant_linears(load_quantized(sym)), quant_linears(load_quantized(asym))
    for n in a:
        assert a[n].scheme.weights.symmetric and not hasattr(a[n], "weight_zero_point"), n
        assert torch.equal(a[n].dequantized_weight(), b[n].dequantized_weight()), n
    from qtk.inspect import inspect_checkpoint

    assert inspect_checkpoint(str(sym))["quantization"][0]["weights"] == "int4 group g32"


def _regroup(t: dict, group_size: int) -> None:
    """The fixture's GPTQ layers with group_size 48: ceil(in / 48) groups, the last one partial."""
    for k in [k for k in t if k.endswith(".qweight")]:
        base, k_in = k.removesuffix(".qweight"), t[k].shape[0] * 8
        groups = -(-k_in // group_size)
        t[f"{base}.scales"] = t[f"{base}.scales"][:groups].contiguous()
        t[f"{base}.qzeros"] = t[f"{base}.qzeros"][:groups].contiguous()
        t[f"{base}.g_idx"] = (torch.arange(k_in) // group_size).to(torch.int32)


def _autogptq_weight(t: dict, base: str) -> torch.Tensor:
    """AutoGPTQ's torch dequantization (qlinear_cuda.py forward): w = s[g_idx] * (q - (stored + 1))."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((t[f"{base}.qweight"].unsqueeze(1) >> shifts[:, None]) & 15).reshape(-1, t[f"{base}.qweight"].shape[1])
    z = ((t[f"{base}.qzeros"].unsqueeze(-1) >> shifts) & 15).reshape(t[f"{base}.qzeros"].shape[0], -1) + 1
    g = t[f"{base}.g_idx"].long()
    return (t[f"{base}.scales"].float()[g] * (q - z[g]).float()).t()


def test_a_partial_last_group_is_read_in_smaller_groups(tmp_path):
    """in_features not a multiple of group_size (SmolLM2-135M's 576 with 128): AutoGPTQ and GPTQModel
    keep ceil(in / group) groups and dequantize through g_idx; qtk reads the same weights in groups
    of gcd(in, group) (here 16), which its CPU kernel runs, and so does its engine."""
    from qtk.kernels import cpu as cpu_kernels
    from qtk.kernels.dispatch import CpuWOQ, build_runtime

    d = _copy("gptq_asym", tmp_path)
    _edit(d, tensors=lambda t: _regroup(t, 48), config=lambda qc: qc.update(group_size=48))
    t = load_file(str(d / "model.safetensors"))
    layers = quant_linears(load_quantized(d))
    x = torch.randn(3, 128)
    for n, q in layers.items():
        ref = _autogptq_weight(t, n)
        assert torch.allclose(q.dequantized_weight(), ref, rtol=0, atol=1e-6), n
        assert q.scheme.weights.group_size == 16 and not hasattr(q, "weight_g_idx")
        if cpu_kernels.ops() is not None:  # built (g++ and ninja present)
            assert isinstance(build_runtime(q, torch.device("cpu"), torch.float32), CpuWOQ)
        with torch.no_grad():
            assert torch.allclose(q(x[:, :q.in_features]), x[:, :q.in_features] @ ref.t(), atol=1e-4), n
    _engine_matches_transformers(d)


def test_inspect_reads_them():
    from qtk.inspect import inspect_checkpoint

    info = inspect_checkpoint(str(DATA / "gptq_sym_actorder"))
    assert info["quantization"][0]["weights"] == "int4 group g32, act-order"
    assert len(info["layers"]) == 14 and info["compression"] > 1
    down = info["layers"]["model.layers.0.mlp.down_proj"]
    # 4-bit codes + fp16 scale and 4-bit zero per 32 inputs + an int32 g_idx per input (64 outputs)
    assert down["bits"] == pytest.approx(4 + 16 / 32 + 4 / 32 + 32 / 64)
    awq = inspect_checkpoint(str(DATA / "awq_gemm"))
    assert awq["quantization"][0]["format"] == "awq gemm"


def test_awq_byte_repack_is_the_plain_one():
    """The fast AWQ repack (bytes, little-endian) against unpack -> reorder -> pack, on random words."""
    from qtk.hub_formats import _awq_codes_along_k, _awq_inverse

    words = torch.randint(-2**31, 2**31 - 1, (40, 6), dtype=torch.int32)  # K 40, N 48
    plain = pack_int32(unpack_int32(words, 4, 48)[:, _awq_inverse(48)].t().contiguous(), 4)
    assert torch.equal(_awq_codes_along_k(words, 40, 48), plain)
