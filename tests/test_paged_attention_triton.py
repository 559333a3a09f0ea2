"""The paged-attention Triton kernels (qtk.kernels.attention), no GPU needed.

Interpreter tests: each kernel against a plain torch twin written here (gather the context through
the block table, dequantize, masked softmax in fp32) on small random caches with shuffled block
tables, contexts that are not multiples of the block size, GQA groups of 2 and 3, and fp16/bf16/
fp32 models over float, fp8 and int8 caches (per-tensor and per-head scales). They run in the
exact interpreter of tests/test_kernels_interp.py (bf16/fp8 casts and dots as torch does them).
AOT tests: every kernel compiles for sm_80 and sm_90 with the configs the launchers pick for
Llama-3-8B (32 heads, 8 kv heads, D 128, blocks of 16) on an H100, without register spills, the
prefill kernel on tensor cores. FP8 caches need sm_89+: they compile for sm_90 only.
"""
from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from test_kernels_interp import OUTER_INTERPRET, assert_close, exact_interpretation  # noqa: E402
from qtk.kernels import attention as ta  # noqa: E402

FP8 = torch.float8_e4m3fn
BLOCK_SIZE = 16
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def interpret():
    """Kernels run in the exact interpreter (opt-in here: the AOT tests below compile)."""
    with exact_interpretation():
        yield


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(1234)


interp = pytest.mark.usefixtures("interpret")


# -- the torch twins --------------------------------------------------------------------------

def quantize_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, kv_heads, D] -> codes, scale [1] or [kv_heads] (qtk.quant.quantize's formulas)."""
    y = x.float() / scale.float().reshape(1, -1, 1)
    if dtype == FP8:
        return y.clamp(-448, 448).to(FP8)
    return torch.round(y).clamp(-128, 127).to(torch.int8)


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """[kv_heads, num_slots, D] -> fp32 values."""
    return cache.float() if scale is None else cache.float() * scale.float().reshape(-1, 1, 1)


def context_slots(table: torch.Tensor, length: int) -> torch.Tensor:
    pos = torch.arange(length)
    return table[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE


def attention_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """q [n, H, D]; keys, values [kv_heads, L, D] fp32; query i sees keys 0 .. positions[i] -> [n, H, D] fp32."""
    group = q.shape[1] // keys.shape[0]
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, L, D]
    s = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    s.masked_fill_(torch.arange(k.shape[1])[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hnl,hld->nhd", s.softmax(-1), v)


# -- random inputs ----------------------------------------------------------------------------

def random_cache(kv_heads: int, num_blocks: int, d: int, dtype: torch.dtype, per_head: bool):
    """(k_cache, v_cache, k_scale, v_scale): random values, or codes and positive scales."""
    shape = (kv_heads, num_blocks * BLOCK_SIZE, d)
    if dtype not in (FP8, torch.int8):
        return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), None, None
    scales = [torch.rand(kv_heads if per_head else 1) * 0.02 + 0.005 for _ in range(2)]
    if dtype == FP8:
        codes = [(torch.randn(shape) * 100).clamp(-448, 448).to(FP8) for _ in range(2)]
    else:
        codes = [torch.randint(-128, 128, shape, dtype=torch.int8) for _ in range(2)]
    return codes[0], codes[1], scales[0], scales[1]


def block_tables(lengths: list[int], spare: int = 2) -> tuple[torch.Tensor, int]:
    """Shuffled, non-contiguous tables (int32 [S, max_blocks], unused entries 0) -> (tables, num_blocks)."""
    need = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    start = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[start:start + n]
        start += n
    return tables, num_blocks


def scales_of(k_scale, v_scale) -> dict:
    return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}


# -- store_kv ---------------------------------------------------------------------------------

@interp
@pytest.mark.parametrize("model,cache,per_head", [
    (torch.float16, torch.float16, False),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float32, torch.float32, False),
    (torch.bfloat16, FP8, False),
    (torch.float16, FP8, True),
    (torch.float32, torch.int8, False),
    (torch.bfloat16, torch.int8, True),
])
def test_store_kv(model, cache, per_head):
    """K/V of strided views (a fused qkv buffer) land at their slots as torch writes them; padding
    (slot -1) and every other slot are untouched."""
    t, heads, kv_heads, d = 9, 6, 3, 48
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d) * 3).to(model)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    _, _, k_scale, v_scale = random_cache(kv_heads, 1, d, cache, per_head)
    k_cache = torch.zeros(kv_heads, 4 * BLOCK_SIZE, d).to(cache)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(4 * BLOCK_SIZE)[:t]
    slots[[2, 5]] = -1
    ta.store_kv(k, v, k_cache, v_cache, slots, **scales_of(k_scale, v_scale))
    real = slots >= 0
    for x, c, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        want = x[real].to(cache) if s is None else quantize_ref(x[real], s, cache)
        got = c[:, slots[real]].transpose(0, 1)
        if cache == FP8:  # at most one e4m3 step apart (a division rounded differently)
            assert (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs().max() <= 1
        else:
            assert torch.equal(got, want)
        rest = torch.ones(c.shape[1], dtype=torch.bool)
        rest[slots[real]] = False
        assert not c[:, rest].float().any()


# -- decode -----------------------------------------------------------------------------------

def decode_case(lengths, heads, kv_heads, d, model, cache, per_head):
    tables, num_blocks = block_tables(lengths)
    k_cache, v_cache, k_scale, v_scale = random_cache(kv_heads, num_blocks, d, cache, per_head)
    q = torch.randn(len(lengths), heads, d).to(model)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), scales_of(k_scale, v_scale)


def decode_ref(q, k_cache, v_cache, tables, lens, scale, k_scale=None, v_scale=None):
    keys, values = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    rows = []
    for b, n in enumerate(lens.tolist()):
        slots = context_slots(tables[b], n)
        rows.append(attention_ref(q[b:b + 1], keys[:, slots], values[:, slots], torch.tensor([n - 1]), scale))
    return torch.cat(rows).to(q.dtype)


# (context lengths, heads, kv_heads, D, model dtype, cache dtype, per-head scales)
DECODE_CASES = [
    ([1, 37, 80], 6, 3, 64, torch.float16, torch.float16, False),
    ([16, 50], 4, 2, 32, torch.float32, torch.float32, False),
    ([23, 65, 9], 6, 2, 64, torch.bfloat16, torch.bfloat16, False),
    ([70, 5], 4, 2, 48, torch.float16, FP8, True),
    ([33, 17, 64], 6, 3, 32, torch.float32, torch.int8, False),
    ([40, 1], 6, 2, 64, torch.bfloat16, torch.int8, True),
]


@interp
@pytest.mark.parametrize("lengths,heads,kv_heads,d,model,cache,per_head", DECODE_CASES)
def test_decode_attention(lengths, heads, kv_heads, d, model, cache, per_head):
    q, k_cache, v_cache, tables, lens, scales = decode_case(lengths, heads, kv_heads, d, model, cache, per_head)
    scale = d ** -0.5
    out = ta.decode_attention(q, k_cache, v_cache, tables, lens, scale, BLOCK_SIZE, **scales)
    assert_close(out, decode_ref(q, k_cache, v_cache, tables, lens, scale, **scales), TOL[model])


@interp
@pytest.mark.parametrize("model,cache", [(torch.float32, torch.float32), (torch.float16, torch.int8)])
def test_decode_split_equals_one_pass(model, cache):
    """Flash-decoding: 3 and 4 splits (some of them empty for the short contexts) give one pass's result."""
    q, k_cache, v_cache, tables, lens, scales = decode_case([1, 150, 200], 4, 2, 32, model, cache, False)
    one = ta.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, BLOCK_SIZE, **scales, num_splits=1)
    for splits in (3, 4):
        split = ta.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, BLOCK_SIZE, **scales, num_splits=splits)
        assert_close(split, one, 1e-6 if model == torch.float32 else 1e-3)
    assert_close(one, decode_ref(q, k_cache, v_cache, tables, lens, 0.2, **scales), TOL[model])


@interp
def test_decode_empty_context_gives_zeros():
    """A padding row (context 0) reads no key: zeros, not NaN, with one split or several."""
    q, k_cache, v_cache, tables, lens, _ = decode_case([20, 30], 4, 2, 32, torch.float16, torch.float16, False)
    lens[0] = 0
    ref = decode_ref(q[1:], k_cache, v_cache, tables[1:], lens[1:], 0.2)
    for splits in (1, 2):
        out = ta.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, BLOCK_SIZE, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert_close(out[1:], ref, TOL[torch.float16])


@interp
def test_decode_empty_batch():
    """No sequence at all: an empty output (the split heuristic has no program to count)."""
    q, k_cache, v_cache, tables, lens, _ = decode_case([5], 4, 2, 32, torch.float16, torch.float16, False)
    out = ta.decode_attention(q[:0], k_cache, v_cache, tables[:0], lens[:0], 0.2, BLOCK_SIZE)
    assert out.shape == (0, 4, 32)


@interp
def test_expanded_scales_read_as_their_values():
    """A per-head scale given as an expanded view (stride 0, one value for every head) quantizes
    and dequantizes with that value for every head, not with the memory after it."""
    q, k_cache, v_cache, tables, lens, _ = decode_case([20, 9], 4, 2, 32, torch.float16, torch.int8, False)
    base = torch.tensor([0.01, 50.0, 50.0])
    k_scale, v_scale = base[:1].expand(2), torch.tensor([0.02]).expand(2, 1, 1)
    out = ta.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, BLOCK_SIZE, k_scale=k_scale, v_scale=v_scale)
    ref = decode_ref(q, k_cache, v_cache, tables, lens, 0.2, k_scale=k_scale.contiguous(), v_scale=v_scale.contiguous())
    assert_close(out, ref, TOL[torch.float16])
    k = torch.randn(3, 2, 32)
    slots = torch.tensor([0, 5, 9])
    ta.store_kv(k, k, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(k_cache[:, slots].transpose(0, 1), quantize_ref(k, torch.tensor([0.01]), torch.int8))


def test_fp8_cache_refused_before_sm89(monkeypatch):
    """Triton has no e4m3 type before sm_89: an FP8 cache there is a ValueError naming the way out,
    not a compile error in the first step (fake CUDA tensors stand in for a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with FakeTensorMode():
        k_cache = torch.empty(2, 64, 32, dtype=FP8, device="cuda")
        k = torch.empty(3, 2, 32, dtype=torch.bfloat16, device="cuda")
        scale = torch.ones(1, device="cuda")
        with pytest.raises(ValueError, match="INT8"):
            ta.store_kv(k, k, k_cache, k_cache, torch.zeros(3, dtype=torch.int64, device="cuda"), scale, scale)


def test_decode_config_splits_only_small_batches():
    assert ta.decode_config(1, 8, 4, 4096, 132) == ta.AttnConfig(16, 64, 16)
    assert ta.decode_config(16, 8, 4, 4096, 132).num_splits == 3
    assert ta.decode_config(32, 8, 4, 4096, 132).num_splits == 1
    assert ta.decode_config(1, 8, 4, 128, 132).num_splits == 1  # two key tiles: not worth a split
    assert ta.decode_config(1, 8, 32, 4096, 132).block_m == 32


# -- prefill ----------------------------------------------------------------------------------

def prefill_case(chunks, heads, kv_heads, d, model, cache, per_head):
    """chunks [(cached prefix, chunk length)] -> q [T, H, D], caches, tables, lens, query_start_loc, scales."""
    lengths = [p + n for p, n in chunks]
    tables, num_blocks = block_tables(lengths)
    k_cache, v_cache, k_scale, v_scale = random_cache(kv_heads, num_blocks, d, cache, per_head)
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), heads, d).to(model)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), starts, scales_of(k_scale, v_scale)


def prefill_ref(q, k_cache, v_cache, tables, lens, starts, scale, k_scale=None, v_scale=None):
    keys, values = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    rows = []
    for s, total in enumerate(lens.tolist()):
        a, b = starts[s].item(), starts[s + 1].item()
        slots = context_slots(tables[s], total)
        positions = torch.arange(total - (b - a), total)
        rows.append(attention_ref(q[a:b], keys[:, slots], values[:, slots], positions, scale))
    return torch.cat(rows).to(q.dtype)


# ([(cached prefix, chunk)], heads, kv_heads, D, model dtype, cache dtype, per-head scales)
PREFILL_CASES = [
    ([(0, 5), (20, 70), (33, 1)], 6, 3, 64, torch.float16, torch.float16, False),
    ([(48, 16), (0, 65)], 4, 2, 32, torch.float32, torch.float32, False),
    ([(7, 30), (64, 3)], 4, 2, 64, torch.bfloat16, torch.bfloat16, False),
    ([(19, 40), (0, 1), (80, 9)], 6, 2, 48, torch.float16, FP8, False),
    ([(30, 20), (5, 66)], 6, 3, 32, torch.bfloat16, torch.int8, True),
]


@interp
@pytest.mark.parametrize("chunks,heads,kv_heads,d,model,cache,per_head", PREFILL_CASES)
def test_prefill_attention(chunks, heads, kv_heads, d, model, cache, per_head):
    q, k_cache, v_cache, tables, lens, starts, scales = prefill_case(chunks, heads, kv_heads, d, model, cache, per_head)
    scale = d ** -0.5
    out = ta.prefill_attention(q, k_cache, v_cache, tables, lens, starts, scale, BLOCK_SIZE, **scales)
    assert_close(out, prefill_ref(q, k_cache, v_cache, tables, lens, starts, scale, **scales), TOL[model])


@interp
def test_store_then_attend_equals_causal_attention():
    """A prompt stored by store_kv into an int8 cache with per-head scales ([kv_heads, 1, 1] buffers,
    as attention modules hold them), then prefilled in two chunks and its last token decoded: the same
    numbers as causal attention over the dequantized K/V of the whole prompt."""
    n, heads, kv_heads, d = 40, 4, 2, 32
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    k_scale, v_scale = (x.abs().amax((0, 2)) / 127 for x in (k, v))  # [kv_heads]
    tables, num_blocks = block_tables([n])
    k_cache = torch.zeros(kv_heads, num_blocks * BLOCK_SIZE, d, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    scales = {"k_scale": k_scale.view(kv_heads, 1, 1), "v_scale": v_scale.view(kv_heads, 1, 1)}
    ta.store_kv(k, v, k_cache, v_cache, context_slots(tables[0], n), **scales)
    keys, values = (quantize_ref(x, s, torch.int8).float() * s[None, :, None] for x, s in ((k, k_scale), (v, v_scale)))
    ref = attention_ref(q, keys.transpose(0, 1), values.transpose(0, 1), torch.arange(n), 0.3)
    for a, b in ((0, 25), (25, n - 1)):  # the prompt in two chunks, then its last token as a decode
        lens, starts = torch.tensor([b], dtype=torch.int32), torch.tensor([0, b - a], dtype=torch.int32)
        out = ta.prefill_attention(q[a:b], k_cache, v_cache, tables, lens, starts, 0.3, BLOCK_SIZE, **scales)
        assert_close(out, ref[a:b], 1e-5)
    lens = torch.tensor([n], dtype=torch.int32)
    out = ta.decode_attention(q[n - 1:], k_cache, v_cache, tables, lens, 0.3, BLOCK_SIZE, **scales)
    assert_close(out, ref[n - 1:], 1e-5)


def test_launchers_reject_bad_inputs():
    q, k_cache, v_cache, tables, lens, scales = decode_case([5], 4, 2, 32, torch.float16, torch.int8, True)
    with pytest.raises(ValueError, match="needs k_scale"):
        ta.decode_attention(q, k_cache, v_cache, tables, lens, 0.1, BLOCK_SIZE)
    with pytest.raises(ValueError, match="not a multiple"):
        ta.decode_attention(q[:, :3], k_cache, v_cache, tables, lens, 0.1, BLOCK_SIZE, **scales)
    with pytest.raises(ValueError, match="block_tables"):
        ta.decode_attention(q, k_cache, v_cache, tables.long(), lens, 0.1, BLOCK_SIZE, **scales)
    with pytest.raises(ValueError, match="model dtype"):
        ta.decode_attention(q, k_cache.float(), v_cache.float(), tables, lens, 0.1, BLOCK_SIZE)
    with pytest.raises(ValueError, match="slot_mapping"):
        ta.store_kv(q[:, :2], q[:, :2], k_cache, v_cache, torch.zeros(1, dtype=torch.int32), **scales)
    with pytest.raises(ValueError, match="different devices"):
        ta.decode_attention(q, k_cache, v_cache, tables.to("meta"), lens, 0.1, BLOCK_SIZE, **scales)
    with pytest.raises(ValueError, match="different devices"):
        ta.store_kv(q[:, :2], q[:, :2], k_cache, v_cache, torch.zeros(1, dtype=torch.int64, device="meta"), **scales)


# -- ahead-of-time compiles -------------------------------------------------------------------

aot = pytest.mark.skipif(OUTER_INTERPRET, reason="the session interprets: @triton.jit made no compilable kernels")
H100_SMS = 132
LLAMA3_8B = dict(heads=32, kv_heads=8, d=128)
MMA = r"mma\.sync\.aligned\.[\w.]+"
WGMMA = r"wgmma\.mma_async\.[\w.]+"
CACHE_PTR = {"bf16": "*bf16", "fp8": "*fp8e4nv", "int8": "*i8"}


# what the JIT specializes on a GPU for Llama shapes: 16-byte aligned tensors, these sizes multiples of 16
DIVISIBLE_BY_16 = {"num_slots", "num_heads", "stride_qb", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                   "stride_vt", "stride_vh"}
CACHE_TILE_COPY = r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10"  # 16-byte async copies


def compile_ptx(kernel, cc: int, ptr_types: dict, constexprs: dict, num_warps: int, num_stages: int) -> str:
    """PTX for sm_<cc>, which must not spill (tests/test_kernels_aot.py's, with sm_scale an fp32
    parameter and the alignment the JIT would see)."""
    signature, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            continue
        signature[p.name] = ptr_types[p.name] if p.name.endswith("_ptr") else "fp32" if p.name == "sm_scale" else "i32"
        if p.name.endswith("_ptr") or p.name in DIVISIBLE_BY_16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", cc, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm["cubin"], "ptxas produced no cubin"
    ptx = compiled.asm["ptx"]
    assert "ld.local" not in ptx, f"{kernel.fn.__name__} spills registers to local memory on sm_{cc}"
    return ptx


def attention_ptrs(q: str, cache: str, out: str) -> dict:
    return {"q_ptr": q, "k_cache_ptr": CACHE_PTR[cache], "v_cache_ptr": CACHE_PTR[cache], "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32", "table_ptr": "*i32", "lens_ptr": "*i32", "query_start_ptr": "*i32",
            "out_ptr": out, "m_ptr": "*fp32", "l_ptr": "*fp32"}


def attention_constexprs(cache: str, cfg: ta.AttnConfig) -> dict:
    return dict(GROUP=LLAMA3_8B["heads"] // LLAMA3_8B["kv_heads"], HEAD_DIM=LLAMA3_8B["d"], BLOCK_SIZE=BLOCK_SIZE,
                CACHE="float" if cache == "bf16" else cache, PER_HEAD_SCALE=cache == "int8",
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=LLAMA3_8B["d"])


@aot
@pytest.mark.parametrize("cc,cache", [(80, "bf16"), (80, "int8"), (90, "fp8")])
def test_store_kv_compiles(cc, cache):
    ptrs = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": CACHE_PTR[cache], "v_cache_ptr": CACHE_PTR[cache],
            "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "slot_ptr": "*i64"}
    constexprs = dict(HEAD_DIM=128, CACHE="float" if cache == "bf16" else cache, PER_HEAD_SCALE=cache == "int8",
                      BLOCK_H=8, BLOCK_D=128)
    compile_ptx(ta._store_kv_kernel, cc, ptrs, constexprs, 4, 1)


@aot
@pytest.mark.parametrize("cc,q,cache,batch", [(80, "*bf16", "bf16", 1), (90, "*bf16", "bf16", 64),
                                              (80, "*fp16", "int8", 1), (90, "*bf16", "fp8", 1)])
def test_decode_compiles(cc, q, cache, batch):
    """Batch 1 splits the context (fp32 partials), batch 64 writes the output in one pass."""
    cfg = ta.decode_config(batch, LLAMA3_8B["kv_heads"], 4, 4096, H100_SMS)
    assert (cfg.num_splits > 1) == (batch == 1)
    out = "*fp32" if cfg.num_splits > 1 else q
    constexprs = attention_constexprs(cache, cfg) | {"NUM_SPLITS": cfg.num_splits}
    ptx = compile_ptx(ta._decode_kernel, cc, attention_ptrs(q, cache, out), constexprs, cfg.num_warps, cfg.num_stages)
    assert re.search(MMA, ptx), f"no mma.sync in the sm_{cc} decode PTX"
    assert re.search(CACHE_TILE_COPY, ptx), "cache tiles are not copied 16 bytes at a time"


@aot
@pytest.mark.parametrize("cc", [80, 90])
def test_decode_reduce_compiles(cc):
    ptrs = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16"}
    compile_ptx(ta._decode_reduce_kernel, cc, ptrs, dict(NUM_SPLITS=16, HEAD_DIM=128, BLOCK_S=16, BLOCK_D=128), 4, 1)


@aot
@pytest.mark.parametrize("cc,q,cache", [(80, "*bf16", "bf16"), (80, "*fp16", "int8"), (90, "*bf16", "bf16"),
                                        (90, "*bf16", "fp8")])
def test_prefill_compiles_to_tensor_cores(cc, q, cache):
    cfg = ta.prefill_config(LLAMA3_8B["d"])
    ptx = compile_ptx(ta._prefill_kernel, cc, attention_ptrs(q, cache, q), attention_constexprs(cache, cfg),
                      cfg.num_warps, cfg.num_stages)
    ops = set(re.findall(MMA, ptx)) | (set(re.findall(WGMMA, ptx)) if cc >= 90 else set())
    assert ops, f"no tensor-core instruction in the sm_{cc} prefill PTX"
    assert re.search(CACHE_TILE_COPY, ptx), "cache tiles are not copied 16 bytes at a time"


def kv_scales(model, kv_dtype) -> list | None:
    """Per layer (k_scale, v_scale) of 0.05 per KV head for an INT8 / FP8 cache; None for a float one."""
    if kv_dtype is None:
        return None
    s = torch.full((model.num_kv_heads, 1, 1), 0.05)
    return [(s, s) for _ in model.layers]


@interp
@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_runtime_steps_through_the_triton_kernels(kv_dtype):
    """The model runner with attention_backend="triton" (the CUDA default), in the interpreter:
    prefill chunks beside decodes, over a float or INT8 cache, give the torch path's logits."""
    from test_runtime import hf_model

    from qtk.runtime.block_manager import BlockManager
    from qtk.runtime.model_runner import ModelRunner
    from qtk.runtime.models.native import NativeModel
    from qtk.runtime.scheduler import Scheduler, SchedulerConfig
    from qtk.runtime.sequence import Sequence

    model = NativeModel(hf_model("llama"))
    num_blocks, bs = 32, 4
    scales = kv_scales(model, kv_dtype)
    runners = {b: ModelRunner(model, num_blocks, bs, kv_dtype, scales, attention_backend=b) for b in ("torch", "triton")}
    prompts = [list(range(10, 21)), list(range(50, 53)), list(range(90, 97))]
    logits = {}
    for backend, runner in runners.items():
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), BlockManager(num_blocks, bs))
        seqs = [Sequence(p, block_size=bs) for p in prompts]
        for seq in seqs:
            sched.add(seq)
        rows = []
        for _ in range(6):
            batch = sched.schedule()
            out, _ = runner.run(batch)
            rows.append(out)
            sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
            sched.finish_step(batch, {s.seq_id: 7 + seqs.index(s) for s in sampling})
        logits[backend] = rows
    for a, b in zip(logits["torch"], logits["triton"]):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
