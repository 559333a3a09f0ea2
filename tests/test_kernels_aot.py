"""Every Triton kernel compiles ahead of time for sm_80 (Ampere) and sm_90 (Hopper), no GPU needed.

The interpreter accepts kernels a GPU compiler rejects (tl.dot below 16 rows, unsupported casts),
so each kernel is compiled here with the configs the launchers pick for Llama-3-8B shapes on
an H100 (132 SMs), and the tensor-core paths must show mma.sync (sm_80) / wgmma (sm_90) in PTX.
FP8 needs sm_89+: its kernels compile for sm_90 only.
"""
from __future__ import annotations

import os
import re

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qtk.kernels import act_quant, common, fused, w4a16, w8a8

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="the session interprets: @triton.jit made no compilable kernels")

H100_SMS = 132
MMA = r"mma\.sync\.aligned\.[\w.]+"
WGMMA = r"wgmma\.mma_async\.[\w.]+"


def compile_ptx(kernel, cc: int, ptr_types: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> str:
    """PTX of `kernel` for sm_<cc> (pointer params typed by ptr_types, other runtime params i32 unless
    ptr_types names them),
    which must not spill registers."""
    signature = {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            signature[p.name] = ptr_types[p.name]
        else:
            signature[p.name] = ptr_types.get(p.name, "i32")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm["cubin"], "ptxas produced no cubin"
    ptx = compiled.asm["ptx"]
    assert "ld.local" not in ptx, f"{kernel.fn.__name__} spills registers to local memory on sm_{cc}"
    return ptx


def tensor_core_ops(ptx: str, cc: int) -> set[str]:
    """mma.sync on sm_80; wgmma on sm_90 (or mma.sync where a tile is too small for a warpgroup)."""
    found = set(re.findall(MMA, ptx))
    return found | set(re.findall(WGMMA, ptx)) if cc >= 90 else found


def large_m_ops(ptx: str, cc: int) -> set[str]:
    """A prefill tile runs on mma.sync on sm_80 and on a warpgroup's wgmma on sm_90."""
    ops = set(re.findall(WGMMA if cc >= 90 else MMA, ptx))
    assert ops, f"no {'wgmma' if cc >= 90 else 'mma.sync'} instruction in the sm_{cc} PTX"
    return ops


def woq_constexprs(cfg, group, bits, asym, split):
    return dict(BITS=bits, GROUP_SIZE=group or 1, PER_CHANNEL=group is None, HAS_ZP=asym, HAS_BIAS=True,
                WRITE_PARTIAL=split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)


def woq_ptrs(dtype):
    return {"a_ptr": dtype, "w_ptr": "*i32", "s_ptr": dtype, "z_ptr": "*u8", "bias_ptr": dtype, "c_ptr": dtype}


@pytest.mark.parametrize("cc", [80, 90])
def test_woq_gemv_compiles(cc):
    cfg = w4a16.woq_config(1, 4096, 4096, 128, H100_SMS)
    assert cfg.gemv and cfg.split_k > 1
    ptrs = woq_ptrs("*bf16") | {"c_ptr": "*fp32"}  # split-K writes fp32 partials
    compile_ptx(w4a16._woq_gemv_kernel, cc, ptrs, woq_constexprs(cfg, 128, 4, True, True),
                cfg.num_warps, cfg.num_stages)


@pytest.mark.parametrize("cc,dtype,group,bits,asym", [
    (80, "*bf16", 128, 4, True),
    (90, "*bf16", 128, 4, True),
    (90, "*fp16", None, 8, False),
])
def test_woq_mm_compiles_to_tensor_cores(cc, dtype, group, bits, asym):
    cfg = w4a16.woq_config(4096, 4096, 4096, group, H100_SMS)
    assert not cfg.gemv and cfg.split_k == 1
    ptx = compile_ptx(w4a16._woq_mm_kernel, cc, woq_ptrs(dtype),
                      woq_constexprs(cfg, group, bits, asym, False) | {"GROUP_M": cfg.group_m},
                      cfg.num_warps, cfg.num_stages)
    ops = large_m_ops(ptx, cc)
    print(f"woq_mm sm_{cc} {dtype}: {sorted(ops)}")


@pytest.mark.parametrize("cc,codes,acc", [(80, "*i8", "s32.s8.s8"), (90, "*i8", "s32.s8.s8"),
                                          (90, "*fp8e4nv", "e4m3.e4m3")])
def test_scaled_mm_compiles_to_tensor_cores(cc, codes, acc):
    cfg = w8a8.mm_config(4096, 4096, 4096, H100_SMS)
    ptrs = {"a_ptr": codes, "w_ptr": codes, "as_ptr": "*fp32", "ws_ptr": "*bf16", "bias_ptr": "*bf16", "c_ptr": "*bf16"}
    constexprs = dict(IS_FP8=codes == "*fp8e4nv", A_PER_TOKEN=True, W_PER_CHANNEL=True, HAS_BIAS=True,
                      WRITE_PARTIAL=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m)
    ptx = compile_ptx(w8a8._scaled_mm_kernel, cc, ptrs, constexprs, cfg.num_warps, cfg.num_stages)
    ops = large_m_ops(ptx, cc)
    assert any(acc in op for op in ops), f"no {acc} tensor-core instruction in the sm_{cc} PTX: {ops}"
    print(f"scaled_mm sm_{cc} {codes}: {sorted(ops)}")


@pytest.mark.parametrize("cc,codes", [(80, "*i8"), (90, "*i8"), (90, "*fp8e4nv")])
def test_scaled_mm_small_m_compiles(cc, codes):
    """The decode config: BLOCK_M 16 (the least tl.dot takes on a GPU) with split-K partials."""
    cfg = w8a8.mm_config(1, 4096, 4096, H100_SMS)
    assert cfg.block_m == 16 and cfg.split_k > 1
    ptrs = {"a_ptr": codes, "w_ptr": codes, "as_ptr": "*fp32", "ws_ptr": "*fp16", "bias_ptr": "*fp16", "c_ptr": "*fp32"}
    constexprs = dict(IS_FP8=codes == "*fp8e4nv", A_PER_TOKEN=True, W_PER_CHANNEL=True, HAS_BIAS=True,
                      WRITE_PARTIAL=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m)
    assert tensor_core_ops(compile_ptx(w8a8._scaled_mm_kernel, cc, ptrs, constexprs, cfg.num_warps,
                                       cfg.num_stages), cc)


@pytest.mark.parametrize("cc", [80, 90])
def test_woq_mm_small_m_compiles(cc):
    """The split-K tensor-core config for M in 5..64."""
    cfg = w4a16.woq_config(16, 4096, 4096, 32, H100_SMS)
    assert not cfg.gemv and cfg.block_m == 16 and cfg.split_k > 1
    ptrs = woq_ptrs("*fp16") | {"c_ptr": "*fp32"}
    ptx = compile_ptx(w4a16._woq_mm_kernel, cc, ptrs,
                      woq_constexprs(cfg, 32, 4, True, True) | {"GROUP_M": cfg.group_m}, cfg.num_warps, cfg.num_stages)
    assert tensor_core_ops(ptx, cc)


@pytest.mark.parametrize("cc,group,bits,asym", [(80, 128, 4, True), (90, 128, 4, False), (90, None, 8, True)])
def test_woq_dequant_compiles(cc, group, bits, asym):
    """W^T decoded for cuBLAS, the path from DEQUANT_MM_MIN_M rows on."""
    cfg = w4a16.woq_config(w4a16.DEQUANT_MM_MIN_M, 4096, 4096, group, H100_SMS)
    assert cfg.dequant_mm
    compile_ptx(w4a16._woq_dequant_kernel, cc, {"w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*bf16"},
                dict(BITS=bits, GROUP_SIZE=group or 1, PER_CHANNEL=group is None, HAS_ZP=asym,
                     BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n))


@pytest.mark.parametrize("cc,out,static,k", [(80, "int8", False, 14336), (90, "int8", True, 4096),
                                             (90, "fp8", False, 14336), (90, "int8", False, 65536)])
def test_act_quant_compiles(cc, out, static, k):
    _, block_k, warps = act_quant.act_quant_config(1, k)
    ptrs = {"x_ptr": "*bf16", "q_ptr": "*i8" if out == "int8" else "*fp8e4nv", "s_ptr": "*fp32"}
    ptx = compile_ptx(act_quant._act_quant_kernel, cc, ptrs,
                      dict(OUT=out, STATIC=static, ONE_SWEEP=block_k >= k, BLOCK_M=1, BLOCK_K=block_k), warps)
    if out == "int8":
        # round-half-even by adding and subtracting 1.5 * 2^23: both must survive optimisation
        assert "0f4B400000" in ptx and "0fCB400000" in ptx or ptx.count("0f4B400000") >= 2


@pytest.mark.parametrize("cc", [80, 90])
def test_splitk_reduce_compiles(cc):
    compile_ptx(common._splitk_reduce_kernel, cc, {"p_ptr": "*fp32", "bias_ptr": "*bf16", "c_ptr": "*bf16"},
                dict(SPLIT_K=8, HAS_BIAS=True, BLOCK=common.REDUCE_BLOCK))


@pytest.mark.parametrize("cc", [80, 90])
def test_fused_layer_ops_compile(cc):
    """kernels/fused.py at Llama-3-8B's sizes: the add + RMSNorm over 4096, RoPE over 32 + 8 heads
    of 128, SiLU * up over 14336 columns."""
    for add in (False, True):
        compile_ptx(fused._rms_norm_kernel, cc, {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16",
                                                 "out_ptr": "*bf16", "eps": "fp32"}, dict(ADD=add, BLOCK=4096))
    compile_ptx(fused._rope_kernel, cc, {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16"},
                dict(HEADS=40, HALF=64, BLOCK_H=64, BLOCK_D=64))
    compile_ptx(fused._silu_mul_kernel, cc, {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16"},
                dict(BLOCK=1024))
