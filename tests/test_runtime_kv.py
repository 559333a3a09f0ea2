"""FP8 / INT8 KV cache in the runtime: the CPU attention over a quantized cache is attention over
its dequantized values; the engine takes a checkpoint's calibrated scales (or measures them, with a
warning), holds more tokens in the same bytes, and stays close to the float cache."""
from __future__ import annotations

import logging

import pytest
import torch

from qtk.errors import InputError
from qtk.runtime.attention import AttentionMetadata, KVCache, PrefillChunk, paged_attention, quantize_kv

KV_HEADS, HEADS, D, BS = 2, 6, 16, 4


def metadata(contexts: list[int], new: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """A step over sequences whose context (cached + new tokens) is contexts[i], new[i] of them
    computed this step (1: a decode), in blocks tables[i]."""
    slot = lambda table, p: table[p // BS] * BS + p % BS  # noqa: E731
    slots, decode_index, decode_tables, lens, prefills, t = [], [], [], [], [], 0
    for L, n, table in zip(contexts, new, tables):
        slots += [slot(table, p) for p in range(L - n, L)]
        if n == 1:
            decode_index.append(t)
            decode_tables.append(table)
            lens.append(L)
        else:
            prefills.append(PrefillChunk(t, n, torch.tensor([slot(table, p) for p in range(L)])))
        t += n
    width = max(map(len, decode_tables))
    block_tables = torch.tensor([tb + [0] * (width - len(tb)) for tb in decode_tables])
    mask = torch.arange(width * BS)[None] < torch.tensor(lens)[:, None]
    return AttentionMetadata(torch.tensor(slots), torch.tensor(decode_index), block_tables, mask, prefills, BS)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("per_head", [False, True])
def test_quantized_cache_is_attention_over_its_dequantized_values(dtype, per_head):
    """Two decodes and a prefill chunk over a cached prefix: the output over an FP8/INT8 cache
    equals the output over a float cache holding exactly the dequantized values."""
    g = torch.Generator().manual_seed(0)
    num_slots = 16 * BS
    shape = (KV_HEADS, 1, 1) if per_head else (1, 1, 1)
    k_scale = torch.rand(shape, generator=g) * 0.02 + 0.01
    v_scale = torch.rand(shape, generator=g) * 0.02 + 0.01
    history_k = torch.randn(KV_HEADS, num_slots, D, generator=g)
    history_v = torch.randn(KV_HEADS, num_slots, D, generator=g)
    quant = KVCache(quantize_kv(history_k, k_scale, dtype), quantize_kv(history_v, v_scale, dtype), k_scale, v_scale)
    dense = KVCache(quant.k.float() * k_scale, quant.v.float() * v_scale)
    # the new tokens land on the grid exactly (so both caches store the same values)
    contexts, new, tables = [7, 13, 11], [1, 1, 5], [[3, 9], [0, 5, 2, 14], [8, 1, 6]]
    T = sum(new)
    k = quantize_kv(torch.randn(KV_HEADS, T, D, generator=g), k_scale, dtype).float() * k_scale
    v = quantize_kv(torch.randn(KV_HEADS, T, D, generator=g), v_scale, dtype).float() * v_scale
    q = torch.randn(T, HEADS, D, generator=g)
    meta = metadata(contexts, new, tables)
    got = paged_attention(q, k.transpose(0, 1), v.transpose(0, 1), quant, meta, D ** -0.5)
    want = paged_attention(q, k.transpose(0, 1), v.transpose(0, 1), dense, metadata(contexts, new, tables), D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(quant.k.float()[:, meta.slot_mapping] * k_scale, k, atol=0, rtol=0)


def test_int8_kv_rounds_to_nearest_and_saturates():
    s = torch.tensor([[[0.5]]])
    x = torch.tensor([[[0.74, 0.76, -0.26, 1000.0, -1000.0]]])
    assert quantize_kv(x, s, torch.int8).tolist() == [[[1, 2, -1, 127, -128]]]
    assert quantize_kv(x, s, torch.float8_e4m3fn).float()[0, 0, 3:].tolist() == [448.0, -448.0]


@pytest.fixture(scope="module")
def kv_checkpoint(tiny_dir, tmp_path_factory):
    """The tiny model as RTN w8a16 with INT8 KV scales per head, written by `qtk quantize`."""
    from click.testing import CliRunner

    from qtk.cli import main

    out = tmp_path_factory.mktemp("kv") / "w8a16-kv-int8"
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--method", "rtn", "--scheme", "w8a16", "--kv-cache",
                                  "int8", "--kv-strategy", "head", "--num-samples", "4", "--seq-len", "64",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_engine_takes_the_checkpoints_kv_scales(kv_checkpoint, caplog):
    """kv_cache_dtype=int8 uses the calibrated per-head scales as they are; fp8 rescales them to
    its grid (absmax = scale * 127.5 = fp8 scale * 448); auto keeps the model dtype (vLLM's meaning of auto)."""
    from qtk import LLM
    from qtk.loading import load_model
    from qtk.runtime.packed_linear import steps_in_bf16

    hf, _ = load_model(str(kv_checkpoint))
    want = [layer.self_attn.k_scale.float() for layer in hf.model.layers]
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(kv_checkpoint), dtype="float32", kv_cache_dtype="int8", kv_cache_memory=2**20, max_model_len=128)
    assert "no KV-cache scales" not in caplog.text
    for cache, scale in zip(llm.runner.kv_caches, want):
        assert cache.k.dtype == torch.int8 and cache.k_scale.shape == (2, 1, 1)
        torch.testing.assert_close(cache.k_scale, scale, atol=0, rtol=0)
    fp8 = LLM(str(kv_checkpoint), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory=2**20, max_model_len=128)
    torch.testing.assert_close(fp8.runner.kv_caches[0].k_scale, want[0] * 127.5 / 448, atol=0, rtol=1e-6)
    auto = LLM(str(kv_checkpoint), dtype="float32", kv_cache_memory=2**20, max_model_len=128)
    # a bf16 checkpoint (qtk quantize writes one) whose prefill runs in bf16 (a CPU with bf16 units) keeps bf16
    bf16 = steps_in_bf16(auto.model)
    assert auto.runner.kv_caches[0].k.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert auto.runner.kv_caches[0].k_scale is None


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_measured_kv_scales_are_the_calibrated_formula(tiny_dir, dtype):
    """Scales measured at load are kv_scale of the float cache's absmax per head, as calibration
    writes them (int8: absmax / 127.5, not / 127; rounded to bf16 as a checkpoint stores them)."""
    from qtk import LLM
    from qtk.kv_scales import cache_scheme, grid_absmax, kv_scale
    from qtk.runtime.model_runner import ModelRunner, measure_kv_scales
    from qtk.runtime.scheduler import Batch
    from qtk.runtime.sequence import Sequence

    model = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=2**20, max_model_len=128).model
    ids = list(range(300, 340))
    runner = ModelRunner(model, 3, 16)
    seq = Sequence(ids, block_size=16)
    seq.block_table = [0, 1, 2]
    runner.run(Batch([seq], [len(ids)]))
    measured = measure_kv_scales(model, ids, dtype, "cpu")
    kv = cache_scheme(dtype)
    for cache, scales in zip(runner.kv_caches, measured):
        for t, scale in zip((cache.k, cache.v), scales):
            absmax = t.abs().amax(dim=(1, 2)).view(-1, 1, 1)
            torch.testing.assert_close(scale, kv_scale(absmax, kv), atol=0, rtol=0)
            torch.testing.assert_close(scale * grid_absmax(kv), absmax, atol=0, rtol=2**-8)  # bf16-rounded scale


def test_kv_grid_is_the_one_kv_scale_rounds_onto():
    """grid_absmax (the engine's rescale between grids) and kv_scale (calibration) agree: absmax =
    scale * grid_absmax, 448 for fp8 and 127.5 for int8, up to the scale's bf16 rounding. On the
    int8 grid -absmax is code -128 and +absmax (127.5, rounded to 128) saturates at 127."""
    from qtk.kv_scales import cache_scheme, grid_absmax, kv_scale

    absmax = torch.rand(4, 1, 1, generator=torch.Generator().manual_seed(0)) * 10 + 0.1
    for dtype, span in ((torch.float8_e4m3fn, 448.0), (torch.int8, 127.5)):
        kv = cache_scheme(dtype)
        assert grid_absmax(kv) == span
        torch.testing.assert_close(kv_scale(absmax, kv) * span, absmax, atol=0, rtol=2**-8)
    edges = torch.cat([absmax, -absmax], dim=1)  # [4, 2, 1]
    codes = quantize_kv(edges, absmax / grid_absmax(cache_scheme(torch.int8)), torch.int8)
    assert codes.flatten().tolist() == [127, -128] * 4


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_engine_stays_close_to_the_float_cache(tiny_dir, kv, caplog):
    """A model with no KV scales: they are measured at load (with a warning); the same memory
    holds 4x the tokens of a float32 cache; prompt logprobs stay close to the float cache's and
    greedy decoding runs."""
    from qtk import LLM, SamplingParams

    common = dict(dtype="float32", kv_cache_memory=2**20, max_model_len=128, block_size=8)
    ref = LLM(str(tiny_dir), **common)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(tiny_dir), kv_cache_dtype=kv, **common)
    assert "no KV-cache scales" in caplog.text
    assert llm.block_manager.num_blocks == 4 * ref.block_manager.num_blocks
    prompt = list(range(300, 360))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    a, b = ref.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    diffs = [abs(x[t] - y[t]) for t, x, y in zip(prompt[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02, (max(diffs), sum(diffs) / len(diffs))
    assert len(b.outputs[0].token_ids) == 8


def test_a_bf16_cache_holds_twice_the_tokens_and_decodes_alike(tiny_dir, caplog):
    """kv_cache_dtype bfloat16 on a float32 model: no scales (nothing measured, no warning), twice the
    tokens of a float32 cache in the same memory, the C++ decode reading bf16 rows; prompt logprobs
    within bf16 rounding of the float cache's and the same greedy tokens."""
    from qtk import LLM, SamplingParams

    common = dict(dtype="float32", kv_cache_memory=2**20, max_model_len=128, block_size=8)
    ref = LLM(str(tiny_dir), **common)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(tiny_dir), kv_cache_dtype="bfloat16", **common)
    assert "no KV-cache scales" not in caplog.text
    assert llm.runner.kv_dtype == torch.bfloat16 and llm.runner.kv_caches[0].k_scale is None
    assert llm.block_manager.num_blocks == 2 * ref.block_manager.num_blocks
    prompt = list(range(300, 360))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    a, b = ref.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    diffs = [abs(x[t] - y[t]) for t, x, y in zip(prompt[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
    assert max(diffs) < 0.02, max(diffs)
    assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_bad_kv_cache_dtype_says_what_is_allowed(tiny_dir):
    from qtk import LLM

    with pytest.raises(InputError, match="auto, bfloat16, fp8 or int8"):
        LLM(str(tiny_dir), dtype="float32", kv_cache_dtype="fp4", kv_cache_memory=2**20, max_model_len=128)


def test_fp8_cache_on_a_gpu_without_fp8_is_refused_at_start_up(monkeypatch):
    """Triton has no e4m3 before sm_89: the engine says so when it starts, not at its first step."""
    from types import SimpleNamespace

    import qtk.runtime.model_runner as model_runner
    from qtk.errors import InputError

    monkeypatch.setattr(model_runner, "fp8_supported", lambda device: False)
    with pytest.raises(InputError, match="fp8 on CUDA needs a GPU with FP8 support.*use kv_cache_dtype int8"):
        model_runner.kv_cache_spec(SimpleNamespace(), "fp8", torch.bfloat16, "cuda", None)
