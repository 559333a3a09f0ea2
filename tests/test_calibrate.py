"""The sequential driver with RTN on a tiny random Llama: every preset, KV scales, device moves."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch
from torch import nn

import qtk.calibrate as calibrate
from qtk.calibrate import checkpoint_groups, quantize_model
from qtk.methods import METHODS
from qtk.recipe import from_flags
from qtk.quant_linear import QuantLinear

# preset -> (method, group size, band of the mean per-layer relative weight error, bound on the
# relative logit error vs the float model). Measured on this seed: w4 g32 0.097 / 0.108,
# w4 asym 0.081 / 0.087, w8 0.0060 / 0.0067, w8a8 0.0060 / 0.0085, fp8 0.025 / 0.037,
# fp8_static 0.027 / 0.039. Gaussian weights give rms(e)/rms(w) ~ (absmax / qmax) / sqrt(12).
PRESETS = {
    "w4a16": ("rtn", 32, (0.08, 0.12), 0.15),
    "w4a16_asym": ("rtn", 32, (0.065, 0.095), 0.12),
    "w8a16": ("rtn", None, (0.004, 0.008), 0.01),
    "w8a8": ("rtn", None, (0.004, 0.008), 0.013),
    "fp8": ("fp8", None, (0.02, 0.03), 0.05),
    "fp8_static": ("fp8", None, (0.02, 0.033), 0.055),
}


def _ids(n=4, seq=32, vocab=256, seed=0):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("scheme", sorted(PRESETS))
def test_rtn_every_preset(tiny_llama, scheme):
    method, group_size, (lo, hi), logit_bound = PRESETS[scheme]
    ids = _ids()
    model = tiny_llama()
    with torch.no_grad():
        ref = model(ids).logits
    recipe = from_flags(method, scheme=scheme, group_size=group_size)
    report = quantize_model(model, recipe, calib_ids=ids, progress=False)

    quant = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert quant == set(report["layers"]) and len(quant) == 14  # 7 Linears x 2 blocks
    assert type(model.lm_head) is nn.Linear
    assert checkpoint_groups(model, recipe) == ([(recipe.scheme, ["Linear"])], ["lm_head"])
    errs = list(report["layers"].values())
    assert lo < sum(errs) / len(errs) < hi
    with torch.no_grad():
        out = model(ids).logits
    assert torch.isfinite(out).all()
    assert 0 < _rel(out, ref) < logit_bound
    assert model.config.use_cache is True  # the driver turns the cache off while it runs, not for good


def test_rtn_layer_matches_primitive(tiny_llama):
    """The QuantLinear RTN writes decodes to exactly quantize_weight's grid (|W - W_hat| <= s/2)."""
    from qtk.quant import dequantize_weight, quantize_weight

    model = tiny_llama()
    w = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    recipe = from_flags("rtn", scheme="w4a16_asym", group_size=16)
    quantize_model(model, recipe, progress=False)
    layer = model.model.layers[1].mlp.down_proj
    q, s, zp = quantize_weight(w, recipe.scheme.weights)
    assert torch.equal(layer.codes(), q)
    assert torch.equal(layer.zero_point(), zp.to(torch.int8))
    w_hat = layer.dequantized_weight()
    assert torch.equal(w_hat, dequantize_weight(q, s, zp, recipe.scheme.weights))
    assert ((w - w_hat).abs() <= s.repeat_interleave(16, dim=1) * (0.5 + 2**-5) + 1e-7).all()  # bf16 scales: 8 * 2^-8 * s


def test_ignore_pattern_keeps_layers_float(tiny_llama):
    model = tiny_llama()
    recipe = from_flags("rtn", scheme="w8a16", ignore=("re:.*down_proj", "model.layers.0.self_attn.q_proj"))
    report = quantize_model(model, recipe, progress=False)
    assert len(report["layers"]) == 11
    _, ignore = checkpoint_groups(model, recipe)
    assert ignore == ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
                      "model.layers.1.mlp.down_proj", "lm_head"]


def test_group_size_checked_before_any_work(tiny_llama, monkeypatch):
    calls = []
    monkeypatch.setitem(METHODS, "rtn", dataclasses.replace(METHODS["rtn"], run=lambda block, recipe: calls.append(block.index)))
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"group size 48 does not divide .*\(in_features=64\).*use --group-size 64"):
        quantize_model(model, from_flags("rtn", group_size=48), progress=False)
    assert calls == []
    with pytest.raises(ValueError, match="needs calibration data"):
        quantize_model(model, from_flags("rtn", group_size=32, kv_cache="fp8"), progress=False)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


# int8 follows compressed-tensors' symmetric convention (absmax / 127.5); scales are stored in bf16
@pytest.mark.parametrize("kv, strategy, qmax", [("int8", "head", 127.5), ("fp8", "tensor", 448)])
def test_kv_scales_are_absmax_of_rotated_keys(tiny_llama, kv, strategy, qmax):
    """k_scale/v_scale of block 0 = absmax over the calibration batches of K (after RoPE) and V
    computed here by hand from the embeddings, divided by the format's max."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = _ids(n=4, seq=16)
    model = tiny_llama()
    recipe = from_flags("rtn", scheme="w8a16", kv_cache=kv, kv_strategy=strategy)
    recipe = replace(recipe, calibration=replace(recipe.calibration, batch_size=3))  # 2 batches: 3 + 1
    with torch.no_grad():
        ref = model(ids).logits
    quantize_model(model, recipe, calib_ids=ids, progress=False)
    attn = model.model.layers[0].self_attn
    shape = (2, 1, 1) if strategy == "head" else (1,)
    assert attn.k_scale.shape == shape and attn.v_scale.shape == shape
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        hd = 64 // 4
        k = attn.k_proj(x).view(4, 16, 2, hd).transpose(1, 2)  # [b, kv_heads, s, hd]
        v = attn.v_proj(x).view(4, 16, 2, hd).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, torch.arange(16).unsqueeze(0))
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
    dims = (0, 2, 3) if strategy == "head" else (0, 1, 2, 3)
    for scale, t in ((attn.k_scale, k), (attn.v_scale, v)):
        expect = t.abs().amax(dim=dims).reshape(shape) / qmax
        torch.testing.assert_close(scale, expect, rtol=2**-8, atol=0)  # bf16, rounded to nearest
    # the KV fake quantization is live in the forward: logits move, a little
    with torch.no_grad():
        out = model(ids).logits
    assert 0 < _rel(out, ref) < 0.02


class _Tracker:
    """Records which modules onload() put on the calibration device and offload() took back."""

    def __init__(self, monkeypatch):
        self.on: set[int] = set()
        onload, offload = calibrate.onload, calibrate.offload

        def rec_onload(module, device):
            self.on.add(id(module))
            return onload(module, device)

        def rec_offload(module):
            self.on.discard(id(module))
            return offload(module)

        monkeypatch.setattr(calibrate, "onload", rec_onload)
        monkeypatch.setattr(calibrate, "offload", rec_offload)


@pytest.mark.parametrize("scheme, kv", [("w4a16", None), ("fp8_static", "fp8")])
def test_one_block_on_the_calibration_device_at_a_time(tiny_llama, monkeypatch, scheme, kv):
    """Without a GPU the calibration device is the CPU, so where tensors live proves nothing.

    calibrate.py routes every device move through onload()/offload(); this test wraps those two to
    keep the set of modules on the calibration device and wraps the weight method to look at the
    set each time it runs: exactly the block being quantized is there (not the embeddings, not
    another block), and nothing is left there at the end. test_gpu_peak_memory_is_one_block
    checks the same with torch.cuda.memory_allocated where CUDA exists."""
    model = tiny_llama(num_hidden_layers=4)
    layers = model.model.layers
    tracker = _Tracker(monkeypatch)
    seen = []
    rtn = METHODS["rtn"].run

    def method(block, recipe):
        seen.append((block.index, {i for i, layer in enumerate(layers) if id(layer) in tracker.on},
                     len(tracker.on)))
        rtn(block, recipe)

    monkeypatch.setitem(METHODS, "rtn", dataclasses.replace(METHODS["rtn"], run=method))
    recipe = from_flags("fp8" if scheme.startswith("fp8") else "rtn", scheme=scheme,
                        group_size=32 if scheme == "w4a16" else None, kv_cache=kv)
    quantize_model(model, recipe, calib_ids=_ids(n=2, seq=8), progress=False)
    assert seen == [(i, {i}, 1) for i in range(4)]
    assert tracker.on == set()


@pytest.mark.gpu
def test_gpu_peak_memory_is_one_block(tiny_llama, monkeypatch):
    """On CUDA: while a block is quantized, the GPU holds about one block (weights + the batch)."""
    model = tiny_llama(num_hidden_layers=6, hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                       num_key_value_heads=8)
    layers = model.model.layers
    block_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    base = torch.cuda.memory_allocated()
    during = []
    rtn = METHODS["rtn"].run

    def method(block, recipe):
        torch.cuda.synchronize()
        during.append(torch.cuda.memory_allocated() - base)
        assert all(p.device.type == "cpu" for i, layer in enumerate(layers) if i != block.index
                   for p in layer.parameters())
        rtn(block, recipe)

    monkeypatch.setitem(METHODS, "rtn", dataclasses.replace(METHODS["rtn"], run=method))
    recipe = replace(from_flags("rtn", scheme="w8a16", kv_cache="fp8"), device="cuda")
    quantize_model(model, recipe, calib_ids=_ids(n=2, seq=64), progress=False)
    assert len(during) == 6
    assert all(block_bytes <= d < 1.5 * block_bytes for d in during), (during, block_bytes)
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


def test_crash_mid_quantize_writes_no_checkpoint(tiny_dir, tmp_path, monkeypatch):
    """No output; only the staging folder a --resume continues from (test_streaming.py)."""
    from qtk import pipeline

    rtn = METHODS["rtn"].run

    def method(block, recipe):
        if block.index == 1:
            raise RuntimeError("boom at block 1")
        rtn(block, recipe)

    monkeypatch.setitem(METHODS, "rtn", dataclasses.replace(METHODS["rtn"], run=method))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom at block 1"):
        pipeline.quantize(str(tiny_dir), from_flags("rtn", group_size=32), out, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [".out.qtk-staging"]


@pytest.mark.parametrize("seq", [24, 160])  # 160: over chunked attention's CHUNK, in query chunks on CPU
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_each_block_gets_the_mask_of_its_attention_kind(monkeypatch, family, seq):
    """Qwen2/Qwen3 with use_sliding_window and max_window_layers mix full-attention layers (the first)
    with sliding-window ones; Mistral slides on every layer. With samples longer than the window,
    every block's calibration inputs and outputs are the ones transformers' own forward gives it."""
    import transformers
    from interop import TINY

    from test_model_families import CLASSES

    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[family])
    window = dict(sliding_window=8) if family == "mistral" else dict(use_sliding_window=True, sliding_window=8,
                                                                      max_window_layers=1)
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, "num_hidden_layers": 3, **window})).eval()
    ids = _ids(n=3, seq=seq)
    ref = {}

    def keep(i):
        def hook(m, args, kw, out):
            ref[i] = (args[0] if args else kw["hidden_states"], out)
        return hook

    handles = [layer.register_forward_hook(keep(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in handles:
        h.remove()
    seen = {}

    def method(block, recipe):  # the weights stay float: outputs are comparable with the forward's
        seen[block.index] = (torch.cat(block.inputs.hidden), torch.cat(block.run()))

    monkeypatch.setitem(METHODS, "gptq", dataclasses.replace(METHODS["gptq"], run=method))
    quantize_model(model, from_flags("gptq", scheme="w8a16"), calib_ids=ids, progress=False)
    kinds = getattr(model.config, "layer_types", None)
    assert kinds is None or kinds == ["full_attention", "sliding_attention", "sliding_attention"]
    for i in range(3):
        torch.testing.assert_close(seen[i][0], ref[i][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(seen[i][1], ref[i][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("L,heads,kv_heads,masked", [(300, 6, 2, False), (300, 4, 4, True), (128, 2, 1, False)])
def test_chunked_attention_matches_sdpa(L, heads, kv_heads, masked):
    """Causal attention in query chunks (qtk/chunked_sdpa.py) gives sdpa's output, with or without a
    mask, and sdpa's gradients (float32 under autograd runs the chunks)."""
    from types import SimpleNamespace

    from qtk.chunked_sdpa import chunked_causal_attention, sdpa

    torch.manual_seed(0)
    q = torch.randn(2, heads, L, 32, requires_grad=True)
    k, v = torch.randn(2, kv_heads, L, 32), torch.randn(2, kv_heads, L, 32)
    mask = torch.ones(L, L, dtype=torch.bool).tril()[None, None].expand(2, 1, L, L).clone() if masked else None
    if masked:
        mask[0, :, :, :5] = False  # left padding in the first sample
        mask[0, :, :5, 0] = True  # (keep every row attending somewhere)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=heads // kv_heads)
    got, _ = chunked_causal_attention(module, q, k, v, mask, scaling=0.2)
    ref, _ = sdpa(module, q, k, v, mask, scaling=0.2)
    assert got.shape == (2, L, heads, 32)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(got)
    (want,) = torch.autograd.grad(ref, q, g)
    (grad,) = torch.autograd.grad(got, q, g)
    torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_asym", "w8a8"])
def test_dense_weights_context_matches_runtime(scheme):
    """Calibration's output pass decodes weight-only layers once and runs a dense matmul: same output
    as the layer's own runtime up to bf16 rounding; activation-quantized layers keep their kernel."""
    from qtk import quant
    from qtk.kernels.dispatch import dense_weights
    from qtk.schemes import preset

    torch.manual_seed(0)
    sch = preset(scheme, None if scheme == "w8a8" else 64)
    w, b, x = torch.randn(96, 128), torch.randn(96), torch.randn(3, 50, 128).bfloat16()
    layer = QuantLinear.from_codes(*quant.quantize_weight(w, sch.weights), sch, bias=b)
    ref = layer(x)
    with dense_weights():
        got, again = layer(x), layer(x)
        inside = layer._qtk_runtime  # the one runtime cache, built once for both calls
    assert inside.dense == (scheme != "w8a8")
    after = getattr(layer, "_qtk_runtime", None)
    assert after is None if scheme != "w8a8" else after is inside  # decoded weights dropped on exit
    assert got.dtype == torch.bfloat16 and torch.equal(got, again)
    torch.testing.assert_close(got.float(), ref.float(), atol=0.1, rtol=2e-2)
