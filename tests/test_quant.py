"""Primitives: quantize/dequantize round trips, fp8 saturation, int32 packing layout."""
from __future__ import annotations

import math

import pytest
import torch

from qtk.quant import (FP8_MAX, dequantize, dequantize_weight, pack_int32, qparams, quantize,
                       quantize_activation, quantize_weight, reduce_dims_minmax, unpack_int32)
from qtk.schemes import QuantArgs

INT_ARGS = [
    QuantArgs(num_bits=4, strategy="group", group_size=16),
    QuantArgs(num_bits=4, strategy="group", group_size=16, symmetric=False),
    QuantArgs(num_bits=8, strategy="channel"),
    QuantArgs(num_bits=8, strategy="channel", symmetric=False),
    QuantArgs(num_bits=3, strategy="tensor"),
    QuantArgs(num_bits=2, strategy="tensor", symmetric=False),
]


def _expand(p, args, shape):
    return p.repeat_interleave(args.group_size, dim=1) if args.strategy == "group" else p.expand(shape)


@pytest.mark.parametrize("args", INT_ARGS, ids=lambda a: f"int{a.num_bits}-{a.strategy}-{'sym' if a.symmetric else 'asym'}")
@pytest.mark.parametrize("shape", [(8, 64), (5, 48)])
def test_int_round_trip_error_within_half_scale(args, shape):
    torch.manual_seed(1)
    w = torch.randn(shape) * 0.1 + 0.02
    q, scale, zp = quantize_weight(w, args)
    assert q.dtype == torch.int8
    assert int(q.min()) >= args.qmin and int(q.max()) <= args.qmax
    expect_scale = {"tensor": (1,), "channel": (shape[0], 1), "group": (shape[0], shape[1] // 16)}[args.strategy]
    assert tuple(scale.shape) == expect_scale
    assert (zp is None) == args.symmetric
    w_hat = dequantize_weight(q, scale, zp, args)
    err = (w - w_hat).abs()
    # rounding to the grid costs at most s/2; the scale is stored in bf16 (rounded to nearest,
    # relative error <= 2^-8), which can leave the range's end up to 2^(b-1) * 2^-8 * s off the grid
    assert (err <= _expand(scale, args, shape) * (0.5 + 2.0 ** (args.num_bits - 9)) + 1e-7).all()
    assert err.max() > 0


@pytest.mark.parametrize("args", INT_ARGS, ids=lambda a: f"int{a.num_bits}-{a.strategy}-{'sym' if a.symmetric else 'asym'}")
def test_zero_is_exactly_representable(args):
    torch.manual_seed(2)
    w = torch.rand(4, 32) + 0.5  # all positive: 0 outside the data range
    w[:, 5] = 0.0
    q, scale, zp = quantize_weight(w, args)
    w_hat = dequantize_weight(q, scale, zp, args)
    assert (w_hat[:, 5] == 0).all()


def test_symmetric_int4_maps_absmax_to_qmax():
    # compressed-tensors' convention: scale = absmax / 7.5, so +absmax clips to 7 and -absmax is -8
    args = QuantArgs(num_bits=4, strategy="channel")
    w = torch.tensor([[7.5, -3.5, 1.0, 0.0], [-15.0, 2.0, 0.0, 0.5]])
    q, scale, _ = quantize_weight(w, args)
    assert torch.equal(scale, torch.tensor([[1.0], [2.0]]))
    assert q.tolist() == [[7, -4, 1, 0], [-8, 1, 0, 0]]  # round half to even: -3.5 -> -4, 0.25 -> 0


def test_asymmetric_int4_grid_covers_min_and_max():
    args = QuantArgs(num_bits=4, strategy="tensor", symmetric=False)
    w = torch.tensor([[-0.5, 1.0, 0.25, 0.0]])
    q, scale, zp = quantize_weight(w, args)
    assert scale.item() == pytest.approx(0.1, rel=2**-8)  # 1.5 / 15, stored as bf16
    assert zp.item() == -3  # round(-8 + 5)
    assert q.tolist() == [[-8, 7, -1, -3]]  # 0.25 / 0.1 = 2.5 rounds to 2
    w_hat = dequantize_weight(q, scale, zp, args)
    assert w_hat[0].tolist() == pytest.approx([-0.5, 1.0, 0.2, 0.0], abs=2e-3)


def test_constant_zero_weight_gets_positive_scale():
    for args in INT_ARGS + [QuantArgs(num_bits=8, type="float", strategy="channel")]:
        w = torch.zeros(4, 32)
        q, scale, zp = quantize_weight(w, args)
        assert (scale > 0).all()
        assert (dequantize_weight(q, scale, zp, args) == 0).all()


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_fp8_round_trip_relative_error(strategy):
    args = QuantArgs(num_bits=8, type="float", strategy=strategy)
    torch.manual_seed(3)
    w = torch.randn(16, 64)
    q, scale, zp = quantize_weight(w, args)
    assert q.dtype == torch.float8_e4m3fn and zp is None
    assert float(q.float().abs().max()) == FP8_MAX  # absmax maps to 448
    w_hat = dequantize_weight(q, scale, zp, args)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal values
    normal = w.abs() > 2 ** -6 * scale.expand_as(w)
    assert ((w - w_hat).abs()[normal] <= w.abs()[normal] * 2 ** -4 + 1e-7).all()


def test_fp8_saturates_instead_of_nan():
    args = QuantArgs(num_bits=8, type="float", strategy="tensor")
    scale = torch.tensor([0.5])
    x = torch.tensor([1000.0, -1000.0, 448 * 0.5, 224.1, 1e30, -1e30])
    q = quantize(x, scale, None, args)
    assert not torch.isnan(q.float()).any()
    assert q.float().tolist() == [448.0, -448.0, 448.0, 448.0, 448.0, -448.0]
    assert dequantize(q, scale, None).tolist() == [224.0, -224.0, 224.0, 224.0, 224.0, -224.0]


def test_int_codes_clamp_outside_range():
    args = QuantArgs(num_bits=4, strategy="tensor")
    q = quantize(torch.tensor([100.0, -100.0, 0.4]), torch.tensor([1.0]), None, args)
    assert q.tolist() == [7, -8, 0]


def test_dynamic_per_token_activation_scales():
    args = QuantArgs(num_bits=8, strategy="token", dynamic=True)
    x = torch.tensor([[[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [254.0, 1.0, -127.0]]])
    q, s = quantize_activation(x, args)
    assert s.shape == (1, 3, 1)
    assert s[0, :, 0].tolist() == pytest.approx([2 / 127, torch.finfo(torch.float32).eps, 2.0])
    assert q[0, 0].tolist() == [64, -127, 32]  # 1 / (2/127) = 63.5 -> 64 (half to even)
    assert q[0, 2].tolist() == [127, 0, -64]  # -63.5 -> -64


def test_reduce_dims_minmax_group_shape():
    w = torch.arange(24, dtype=torch.float32).reshape(2, 12)
    lo, hi = reduce_dims_minmax(w, QuantArgs(num_bits=4, strategy="group", group_size=4))
    assert lo.tolist() == [[0, 4, 8], [12, 16, 20]] and hi.tolist() == [[3, 7, 11], [15, 19, 23]]
    with pytest.raises(ValueError, match="group size 5 does not divide the input size 12"):
        reduce_dims_minmax(w, QuantArgs(num_bits=4, strategy="group", group_size=5))


def test_qparams_asymmetric_matches_formula():
    args = QuantArgs(num_bits=8, strategy="channel", symmetric=False)
    s, zp = qparams(torch.tensor([[-1.0], [0.5]]), torch.tensor([[3.0], [2.0]]), args)
    # s = (max - min) / 255 with min clipped to <= 0; zp = round(qmin - min / s)
    assert s[:, 0].tolist() == pytest.approx([4 / 255, 2 / 255], rel=2**-7)  # bf16 scales
    assert zp[:, 0].tolist() == [round(-128 + 1 / s[0, 0].item()), -128]


# --- packing -------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("cols", [1, 7, 8, 33, 67, 128])
def test_pack_unpack_round_trip(bits, cols):
    g = torch.Generator().manual_seed(bits * 1000 + cols)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, cols), generator=g, dtype=torch.int8)
    packed = pack_int32(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, math.ceil(cols * bits / 32))
    assert torch.equal(unpack_int32(packed, bits, cols), q)
    # packed along dim 0 (zero points): [rows, cols] -> [ceil(rows*b/32), cols]
    qt = q.t().contiguous()
    packed0 = pack_int32(qt, bits, packed_dim=0)
    assert packed0.shape == (math.ceil(cols * bits / 32), 5)
    assert torch.equal(packed0, packed.t())
    assert torch.equal(unpack_int32(packed0, bits, cols, packed_dim=0), qt)


def test_pack_int4_bit_order_by_hand():
    # column 8k+j sits in bits 4j..4j+3 of word k, code stored as q + 8
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7, 5, -1]], dtype=torch.int8)
    nibbles = [0, 1, 8, 9, 10, 11, 14, 15]
    word0 = sum(n << (4 * j) for j, n in enumerate(nibbles))  # 0xFEBA9810
    word1 = 13 | (7 << 4)  # columns 8, 9; the rest of word 1 is zero padding
    assert word0 == 0xFEBA9810
    packed = pack_int32(q, 4)
    assert packed.tolist() == [[word0 - 2**32, word1]]
    assert unpack_int32(packed, 4, 10).tolist() == q.tolist()


def test_pack_int3_is_dense_across_words():
    # 3-bit codes are a continuous bit stream: column 10 starts at bit 30 and spills into word 1
    q = torch.full((1, 11), -4, dtype=torch.int8)  # stored code 0
    q[0, 10] = 3  # stored code 7 = 0b111: bits 30, 31 of word 0 and bit 0 of word 1
    packed = pack_int32(q, 3)
    assert packed.shape == (1, 2)
    assert packed.tolist() == [[(0b11 << 30) - 2**32, 0b1]]


def test_zero_point_packing_along_dim0_by_hand():
    # zero points [out=10, groups=2] pack down the columns: word k of column g holds rows 8k..8k+7
    zp = torch.arange(-5, 5, dtype=torch.int8).reshape(10, 1).repeat(1, 2)
    zp[:, 1] = -zp[:, 1] - 1
    packed = pack_int32(zp, 4, packed_dim=0)
    assert packed.shape == (2, 2)
    col0 = [int(v) + 8 for v in zp[:, 0]]
    w0 = sum(n << (4 * j) for j, n in enumerate(col0[:8]))
    assert packed[0, 0].item() % 2**32 == w0
    assert packed[1, 0].item() == col0[8] | (col0[9] << 4)
    assert torch.equal(unpack_int32(packed, 4, 10, packed_dim=0), zp)


def test_pack_rejects_wrong_dtypes():
    with pytest.raises(ValueError, match="int8 codes"):
        pack_int32(torch.zeros(2, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="int32 words"):
        unpack_int32(torch.zeros(2, 1, dtype=torch.int64), 4, 8)


def test_quant_linear_load_state_dict_drops_the_cached_decode():
    from qtk.quant_linear import QuantLinear
    from qtk.schemes import preset

    scheme = preset("w4a16", 16)
    torch.manual_seed(5)
    q, s, zp = quantize_weight(torch.randn(8, 32), scheme.weights)
    layer = QuantLinear.from_codes(q, s, zp, scheme, dtype=torch.float32)
    x = torch.randn(3, 32)
    y = layer(x)  # caches the dequantized weight
    state = layer.state_dict()
    layer.load_state_dict({**state, "weight_scale": state["weight_scale"] * 2})
    torch.testing.assert_close(layer(x), 2 * y)


def test_quant_linear_from_codes_keeps_leaf_tensors():
    """Built from a Linear whose bias requires grad, the QuantLinear holds no autograd graph."""
    from qtk.quant_linear import QuantLinear
    from qtk.schemes import preset

    lin = torch.nn.Linear(32, 8)
    scheme = preset("w8a8")
    q, s, zp = quantize_weight(lin.weight, scheme.weights)
    layer = QuantLinear.from_codes(q, s * lin.weight.sum() / lin.weight.sum(), zp, scheme, bias=lin.bias,
                                   dtype=torch.float32)
    for t in (layer.bias, layer.weight_scale):
        assert t.is_leaf and not t.requires_grad and t.grad_fn is None
    assert isinstance(layer.bias, torch.nn.Parameter)
    torch.testing.assert_close(layer.bias, lin.bias.detach())
