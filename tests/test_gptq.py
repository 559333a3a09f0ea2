"""GPTQ: the solve on a random Linear with correlated inputs, its failure paths, and end to end."""
import logging
from dataclasses import replace

import pytest
import torch

from qtk import quant
from qtk.calibrate import quantize_model
from qtk.methods import gptq
from qtk.methods.args import GPTQArgs
from qtk.recipe import from_flags
from qtk.schemes import QuantArgs

LAYER = "model.layers.7.mlp.down_proj"


def correlated(n=2048, d=128, rank=12, seed=0):
    """Inputs X [n, d]: low rank + correlated noise, uneven column scales (as real activations)."""
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(d, d, generator=g) / d ** 0.5
    X = torch.randn(n, rank, generator=g) @ torch.randn(rank, d, generator=g) + 0.3 * torch.randn(n, d, generator=g) @ L
    return X * torch.linspace(0.2, 3.0, d)


def hessian(X):
    return 2 / X.shape[0] * X.T @ X


def out_err(X, W, q, scale, zp, args):
    W_hat = quant.dequantize_weight(q, scale, zp, args)
    return ((X @ (W - W_hat).T).norm() / (X @ W.T).norm()).item()


def rtn_err(X, W, args):
    return out_err(X, W, *quant.quantize_weight(W, args), args)


ARGS = {
    "group_sym": QuantArgs(4, strategy="group", group_size=32),
    "group_asym": QuantArgs(4, strategy="group", group_size=32, symmetric=False),
    "channel_sym": QuantArgs(4, strategy="channel"),
    "channel_asym": QuantArgs(4, strategy="channel", symmetric=False),
    "tensor_sym": QuantArgs(4, strategy="tensor"),
}


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("kind", list(ARGS))
def test_output_error_below_rtn(kind, act_order):
    args = ARGS[kind]
    X, W = correlated(), torch.randn(96, 128, generator=torch.Generator().manual_seed(1))
    q, scale, zp = gptq.quantize_weight(W, hessian(X), args, GPTQArgs(act_order=act_order))
    assert q.dtype == torch.int8 and q.shape == W.shape
    assert int(q.min()) >= args.qmin and int(q.max()) <= args.qmax
    expected = {"group": (96, 4), "channel": (96, 1), "tensor": (1,)}[args.strategy]
    assert tuple(scale.shape) == expected and (zp is None) == args.symmetric
    # measured: about 0.4x RTN's error in order, 0.1x with act-order
    assert out_err(X, W, q, scale, zp, args) < 0.6 * rtn_err(X, W, args)


@pytest.mark.parametrize("act_order", [False, True])
def test_lazy_blocks_match_column_by_column(act_order):
    """Lazy batch updates are exact: block sizes 1, 24 (groups straddle blocks) and 128 agree, up
    to float32 rounding: a few codes at rounding ties, and a scale (rounded to bf16) one bf16 step
    apart where its float32 value sat at a tie (1 of 256 on an Intel Xeon with AMX, 0 on AMD's)."""
    args, X = ARGS["group_asym"], correlated()
    W, H = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)), hessian(X)
    runs = [gptq.quantize_weight(W, H, args, GPTQArgs(block_size=b, act_order=act_order)) for b in (1, 24, 128)]
    for q, scale, zp in runs[1:]:
        assert (q != runs[0][0]).float().mean() < 0.002
        assert (scale != runs[0][1]).float().mean() < 0.01
        torch.testing.assert_close(scale, runs[0][1], rtol=2 ** -7, atol=0)  # one bf16 step at most


def test_dead_columns_are_zero_and_rest_still_solved():
    args, X = ARGS["group_asym"], correlated()
    X[:, [3, 40, 41, 100]] = 0  # inputs that never fire
    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    q, scale, zp = gptq.quantize_weight(W, hessian(X), args, GPTQArgs(act_order=True))
    W_hat = quant.dequantize_weight(q, scale, zp, args)
    assert torch.isfinite(W_hat).all()
    assert (W_hat[:, [3, 40, 41, 100]] == 0).all()
    assert out_err(X, W, q, scale, zp, args) < 0.6 * rtn_err(X, W, args)


def test_non_positive_definite_hessian_retries_then_falls_back_to_rtn(caplog, monkeypatch):
    args, W = ARGS["group_sym"], torch.randn(32, 64)
    calls = []
    cholesky_ex = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda *a, **k: calls.append(1) or cholesky_ex(*a, **k))
    with caplog.at_level(logging.WARNING, logger="qtk.methods.gptq"):
        q, scale, zp = gptq.quantize_weight(W, -torch.eye(64), args, GPTQArgs(), name=LAYER)
    assert len(calls) == gptq.DAMPING_RETRIES + 1
    assert any(LAYER in r.getMessage() and "RTN" in r.getMessage() for r in caplog.records)
    q_rtn, scale_rtn, _ = quant.quantize_weight(W, args)
    assert torch.equal(q, q_rtn) and torch.equal(scale, scale_rtn)


def test_more_damping_rescues_an_indefinite_hessian(caplog):
    """H with a negative eigenvalue of 5% of mean(diag): 0.01 damping fails, 0.1 succeeds."""
    args, X = ARGS["group_sym"], correlated()
    H = hessian(X)
    H = H - 0.05 * torch.diag(H).mean() * torch.eye(128)
    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    with caplog.at_level(logging.DEBUG, logger="qtk.methods.gptq"):
        q, scale, zp = gptq.quantize_weight(W, H, args, GPTQArgs(), name=LAYER)
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]  # one retry, no fallback
    assert out_err(X, W, q, scale, zp, args) < 0.8 * rtn_err(X, W, args)


@pytest.mark.parametrize("kind", ["group_sym", "group_asym", "channel_sym", "tensor_sym"])
def test_mse_clip_never_worse_than_min_max(kind):
    args = ARGS[kind]
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 32, generator=g) * torch.rand(48, 1, generator=g)
    w[0, 0] = 8.0  # an outlier worth clipping
    errs = []
    for mse_clip in (False, True):
        scale, zero = gptq.group_qparams(w, args, mse_clip)
        rows = w.reshape(1, -1) if args.strategy == "tensor" else w
        errs.append((quant.fake_quantize(rows, scale[:, None], zero[:, None], args) - rows).pow(2).sum(dim=1))
    assert (errs[1] <= errs[0] + 1e-7).all() and errs[1].sum() < errs[0].sum()


# --- end to end on a tiny random Llama ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 256, (16, 64), generator=g)
    held_out = torch.randint(0, 256, (4, 64), generator=g)
    with torch.no_grad():
        ref = model(held_out).logits
    return model.state_dict(), cfg, calib, held_out, ref


def quantized_logits(tiny, recipe):
    from transformers import LlamaForCausalLM

    state, cfg, calib, held_out, _ = tiny
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(state)
    report = quantize_model(model, recipe, calib, progress=False)
    with torch.no_grad():
        return model(held_out).logits, report


def test_collect_hessians_shares_inputs_and_matches_direct(tiny):
    from transformers import LlamaForCausalLM

    from qtk.calibrate import Block, capture_inputs
    from qtk.arch import discover

    state, cfg, calib, _, _ = tiny
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(state)
    arch = discover(model)
    linears = arch.linears[0]
    inputs = capture_inputs(model, arch, calib, torch.device("cpu"), 8)
    block = Block(0, "model.layers.0", model.model.layers[0], arch, inputs, torch.device("cpu"), linears)
    seen = {}
    with block.hooks(linears, lambda n, x: seen.setdefault(n, []).append(x.reshape(-1, x.shape[-1]))):
        block.run()
    groups = dict(gptq.collect_hessians(block, linears))
    assert list(groups) == [linears[:3], linears[3:4], linears[4:6], linears[6:]]
    for names, H in groups.items():
        torch.testing.assert_close(H, hessian(torch.cat(seen[names[0]])), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_asym"])
def test_end_to_end_logits_closer_than_rtn(tiny, scheme):
    ref = tiny[-1]
    recipe = from_flags("gptq", scheme=scheme, group_size=32)
    got = {}
    for name, r in (("rtn", replace(recipe, weights="rtn")), ("gptq", replace(recipe, gptq=GPTQArgs(act_order=False))),
                    ("gptq_act_order", recipe)):
        logits, report = quantized_logits(tiny, r)
        assert torch.isfinite(logits).all() and len(report["layers"]) == 14
        got[name] = ((logits - ref).norm() / ref.norm()).item()
    assert got["gptq"] < got["rtn"] and got["gptq_act_order"] < got["rtn"]


def test_static_activation_scheme_gets_input_scales(tiny):
    """W8A8 with a static per-tensor activation scale: GPTQ weights and an input_scale on every Linear."""
    from transformers import LlamaForCausalLM

    from qtk.recipe import Recipe
    from qtk.quant_linear import QuantLinear
    from qtk.schemes import Scheme

    state, cfg, calib, held_out, ref = tiny
    scheme = Scheme(QuantArgs(8, strategy="channel"), QuantArgs(8, strategy="tensor"))
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(state)
    quantize_model(model, Recipe(method="gptq", scheme=scheme, weights="gptq"), calib, progress=False)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14 and all(float(m.input_scale) > 0 for m in layers)
    with torch.no_grad():
        logits = model(held_out).logits
    assert ((logits - ref).norm() / ref.norm()).item() < 0.1


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # only `dequantize` is ours
@pytest.mark.parametrize("scheme,group_size,act_order,actorder", [
    ("w4a16", 32, True, "static"), ("w4a16_asym", 32, True, "static"), ("w4a16", 32, False, None),
    ("w8a16", -1, True, None),  # per channel: nothing stored changes; compressed-tensors < 0.16 refuses any actorder
])
def test_checkpoint_states_the_act_order_it_used(tiny, tmp_path, scheme, group_size, act_order, actorder):
    """qtk's act-order is compressed-tensors' "static" (llm-compressor's default, alias "weight"):
    columns solved by descending diag(H), groups in column order, no weight_g_idx. config.json says
    so (it said null), and compressed-tensors, transformers and qtk read the checkpoint as written."""
    import json

    from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaForCausalLM

    from qtk.calibrate import checkpoint_groups
    from qtk.checkpoint import load_quantized, read_tensors, save_quantized
    from qtk.quant_linear import QuantLinear

    state, cfg, calib, _, _ = tiny
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(state)
    recipe = from_flags("gptq", scheme=scheme, group_size=group_size, gptq=GPTQArgs(act_order=act_order))
    quantize_model(model, recipe, calib, progress=False)
    d = tmp_path / "ckpt"
    save_quantized(model, None, d, *checkpoint_groups(model, recipe), None, dtype=torch.float32)

    weights = json.loads((d / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights["actorder"] == actorder
    parsed = QuantizationArgs.model_validate(weights).actorder  # what vLLM and transformers validate with
    assert parsed == (ActivationOrdering.WEIGHT if actorder else None) and parsed != ActivationOrdering.GROUP
    assert not [k for k in read_tensors(d) if k.endswith("g_idx")]
    ours = {n: m.dequantized_weight() for n, m in load_quantized(d).named_modules() if isinstance(m, QuantLinear)}
    made = {n: m.dequantized_weight() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    hf, info = AutoModelForCausalLM.from_pretrained(d, quantization_config=CompressedTensorsConfig(dequantize=True),
                                                    dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert len(ours) == len(made) == 14
    for name, w in made.items():
        torch.testing.assert_close(ours[name], w, rtol=0, atol=0)
        torch.testing.assert_close(hf.get_submodule(name).weight, w, rtol=2 ** -20, atol=0)


def test_only_gptq_weights_with_act_order_are_stored_as_static():
    from qtk.recipe import build

    assert build().stored_scheme.weights.actorder == "static"  # the default recipe: awq, then gptq with act-order
    assert build(method="awq", weights="gptq", gptq={"act_order": False}).stored_scheme.weights.actorder is None
    assert build(method="awq").stored_scheme.weights.actorder is None  # rtn weights
    assert build(method="smoothquant", weights="gptq").stored_scheme.weights.actorder is None  # per channel
    recipe = build(method="gptq")
    assert recipe.stored_scheme.weights == replace(recipe.scheme.weights, actorder="static")
    assert recipe.scheme.weights.actorder is None  # the recipe (recipe.yaml) keeps naming its preset


def test_hessian_of_bf16_activations_is_float32_exact():
    """Banded upper-triangle accumulation on oneDNN's bf16 path: for bf16 activations every product
    is exact in float32, so H matches a float64 reference to float32 rounding (not bf16's 4e-3)."""
    torch.manual_seed(0)
    n = 2 * gptq.HESSIAN_BAND + 100  # three bands, the last one partial
    H = torch.zeros(n, n)
    xs = [(torch.randn(300, n) * torch.linspace(0.1, 10, n)).bfloat16() for _ in range(3)]
    for x in xs:
        with gptq.bf16_products(True):
            gptq.accumulate_upper(H, x.float())
    H = gptq.symmetric(H)
    ref = sum(x.double().t() @ x.double() for x in xs)
    assert torch.equal(H, H.t())
    assert ((H.double() - ref).norm() / ref.norm()).item() < 1e-6
