"""qtk reads llm-compressor's checkpoints as llm-compressor does.

The fixtures come from the peer's own venv (llm-compressor 0.14 pins transformers 5.17 and
compressed-tensors 0.19): `bash scripts/peer_env.sh fixtures` builds build/peer_fixtures with
scripts/peer_fixtures.py (oneshot RTN of a tiny random Llama in bf16, save_compressed=True, and
the peer's logits on fixed input ids). Without them these tests skip, unless QTK_REQUIRE_PEER=1
(scripts/test.sh sets it once the fixtures are built): then they fail.

Tolerances: qtk's float32 reference forward and the peer's float32 reload run the same ops, so
logits must agree to float32 summation order (1e-5 of their scale), with qtk on
compressed-tensors' dynamic int8 grid (see tests/interop.py). The oneshot model's own logits come
from bf16 matmuls with bf16 activation quantization (one bf16 rounding can move an fp8 or int8
code), compared with qtk's default forward (whichever kernel it dispatches to): 2^-4 of the scale.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from interop import ct_dequantize, logits, max_diff, quant_linears, reference_forward, weight_only
from qtk.checkpoint import load_quantized

FIXTURES = Path(__file__).resolve().parents[1] / "build" / "peer_fixtures"
SCHEMES = ("w4a16", "w4a16_asym", "w8a8", "fp8_dynamic")  # scripts/peer_fixtures.py SCHEMES
SAME_OPS = 1e-5
PEER_BF16 = 2.0 ** -4


@pytest.fixture(scope="module")
def peer() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = FIXTURES / "peer_logits.safetensors"
    if not path.is_file():
        msg = f"{FIXTURES} is not built: run `bash scripts/peer_env.sh fixtures`"
        if os.environ.get("QTK_REQUIRE_PEER") == "1":
            pytest.fail(f"{msg} (QTK_REQUIRE_PEER=1 says it must be there)")
        pytest.skip(msg)
    return load_file(path)


@pytest.fixture(params=SCHEMES)
def scheme(request, peer) -> str:
    if f"{request.param}.fake_quant" not in peer:
        pytest.fail(f"{FIXTURES} has no {request.param!r}; rebuild with `bash scripts/peer_env.sh fixtures`")
    return request.param


def test_weights_equal_compressed_tensors(scheme):
    d = FIXTURES / scheme
    ours = quant_linears(load_quantized(d))
    assert len(ours) == 14  # 7 Linears in each of 2 blocks; lm_head ignored
    exact = ct_dequantize(d, fp32_scales=True)
    for name, q in ours.items():
        assert torch.equal(q.dequantized_weight(), exact[f"{name}.weight"]), name


def test_fake_quant_logits_match_peer(scheme, peer, monkeypatch):
    reference_forward(monkeypatch, ct_grid=True)
    ours = logits(load_quantized(FIXTURES / scheme), peer["input_ids"])
    ref = peer[f"{scheme}.fake_quant"]
    assert max_diff(ours, ref) <= SAME_OPS * ref.abs().max().item()


def test_weight_only_logits_match_peer(scheme, peer):
    ours = logits(weight_only(load_quantized(FIXTURES / scheme)), peer["input_ids"])
    ref = peer[f"{scheme}.weight_only"]
    assert max_diff(ours, ref) <= SAME_OPS * ref.abs().max().item()


def test_logits_match_peer_oneshot_model(scheme, peer):
    ours = logits(load_quantized(FIXTURES / scheme), peer["input_ids"])  # qtk's (vLLM's) int8 grid
    ref = peer[f"{scheme}.oneshot"]
    assert max_diff(ours, ref) <= PEER_BF16 * ref.abs().max().item()
