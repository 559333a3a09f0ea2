"""qtk.device: the dtype choice, its overrides, and a guard that nothing on a CPU without bf16
units computes in bf16 (the 80x-slower path), whatever CPU the suite runs on."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qtk import device
from qtk.errors import InputError


@pytest.mark.parametrize("forced,expected", [("0", torch.float32), ("1", torch.bfloat16)])
def test_auto_follows_the_cpus_bf16_units(monkeypatch, caplog, forced, expected):
    monkeypatch.setenv("QTK_CPU_BF16", forced)
    with caplog.at_level(logging.INFO, logger="qtk"):
        choice = device.choose_dtype("auto", "cpu")
    assert choice.dtype == expected and choice.reason == f"auto: CPU: QTK_CPU_BF16={forced}"
    assert f"dtype {choice.name} (auto: CPU: QTK_CPU_BF16={forced})" in caplog.text


@pytest.mark.parametrize("built", [True, False])
def test_the_runtimes_auto_is_float32_on_a_cpu_where_its_kernels_run(monkeypatch, built):
    """qtk's runtime kernels take float32 activations: its auto is float32 on a CPU with bf16 units
    too, while they are built; without them it follows the units as calibration does."""
    monkeypatch.setenv("QTK_CPU_BF16", "1")
    choice = device.choose_dtype("auto", "cpu", kernels_built=lambda: built)
    assert choice.dtype == (torch.float32 if built else torch.bfloat16)
    assert device.choose_dtype("auto", "cpu").dtype == torch.bfloat16  # calibration
    assert device.choose_dtype("bfloat16", "cpu", kernels_built=lambda: built).dtype == torch.bfloat16
    assert device.choose_dtype("auto", "cuda", kernels_built=lambda: built).dtype == torch.bfloat16


def test_the_engine_runs_the_runtimes_auto(monkeypatch, tiny_dir):
    from qtk import LLM
    from qtk.kernels import cpu

    monkeypatch.setenv("QTK_CPU_BF16", "1")
    llm = LLM(str(tiny_dir), kv_cache_memory=2**22)
    assert llm.dtype == (torch.float32 if cpu.ops() is not None else torch.bfloat16)


def test_auto_is_bf16_on_cuda_and_detection_matches_the_hardware(monkeypatch):
    monkeypatch.delenv("QTK_CPU_BF16", raising=False)
    assert device.choose_dtype(None, "cuda").dtype == torch.bfloat16  # no GPU needed to decide
    native, why = device.cpu_bf16_reason()
    hw = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert native == hw and device.choose_dtype("auto").dtype == (torch.bfloat16 if hw else torch.float32)
    assert ("AVX512-BF16" in why or "AMX" in why) if hw else "no AVX512-BF16 or AMX" in why


def test_explicit_dtypes_are_kept_bf16_warns_without_units(monkeypatch, caplog):
    monkeypatch.setenv("QTK_CPU_BF16", "0")
    assert device.choose_dtype("float32").dtype == torch.float32
    with caplog.at_level(logging.WARNING, logger="qtk"):
        assert device.choose_dtype("bfloat16").dtype == torch.bfloat16
    assert "bfloat16 was requested, but this CPU has no bf16 matmul units" in caplog.text
    monkeypatch.setenv("QTK_CPU_BF16", "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qtk"):
        device.choose_dtype("bfloat16")
    assert caplog.text == ""


def test_bad_values_are_user_errors(monkeypatch):
    with pytest.raises(InputError, match=r"dtype must be one of \('auto', 'bfloat16', 'float32'\), got 'float16'"):
        device.choose_dtype("float16")
    monkeypatch.setenv("QTK_CPU_BF16", "yes")
    with pytest.raises(InputError, match="QTK_CPU_BF16 must be 0 or 1"):
        device.cpu_has_native_bf16()


class ComputeDtypes(TorchDispatchMode):
    """Records the dtypes of every matmul / attention / integer-GEMM op that runs."""

    OPS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_attention_math", "_int_mm", "_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"}

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.OPS:
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
            self.seen.setdefault(name, set()).update(dtypes)
        return func(*args, **(kwargs or {}))


def test_no_bf16_compute_on_a_cpu_without_bf16_units(tiny_dir, tmp_path, monkeypatch):
    """As an AVX2-only CPU (QTK_CPU_BF16=0): the default recipe's quantize (AWQ + GPTQ), perplexity
    and generation run every matmul and attention in float32, and W4A16 layers on the reference."""
    from qtk import pipeline, recipe
    from qtk.evals.perplexity import perplexity
    from qtk.generate import generate
    from qtk.loading import load_model

    monkeypatch.setenv("QTK_CPU_BF16", "0")
    monkeypatch.setenv("QTK_CPU_VNNI", "0")
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 200)
    r = recipe.build(calibration={"dataset": str(text), "num_samples": 4, "seq_len": 64, "batch_size": 2})
    assert (r.method, r.weights, r.dtype) == ("awq", "gptq", "auto")
    out = tmp_path / "q"
    mode = ComputeDtypes()
    with mode:
        report = pipeline.quantize(str(tiny_dir), r, out, progress=False)
        model, _ = load_model(str(out), dtype=device.choose_dtype("auto").dtype)
        perplexity(model, torch.randint(0, 1000, (1, 32)), progress=False)
        generate(str(out), "hello", max_tokens=3)
    assert report["dtype"] == "float32" and report["dtype_reason"] == "auto: CPU: QTK_CPU_BF16=0"
    assert {"mm", "addmm_", "_scaled_dot_product_flash_attention_for_cpu"} <= set(mode.seen), mode.seen  # linears, H, sdpa
    assert all(dtypes <= {torch.float32, torch.int8, torch.int32, torch.int64} for dtypes in mode.seen.values()), mode.seen
    assert not {"_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm", "_int_mm"} & set(mode.seen)


@pytest.mark.parametrize("bf16,L,chunked", [("0", 512, True), ("0", 600, False), ("1", 600, True), ("1", 100, False)])
def test_chunked_attention_only_where_it_measured_faster(monkeypatch, bf16, L, chunked):
    """Query chunks beat sdpa on CPUs with bf16 units and, without them, up to 512 tokens only."""
    from types import SimpleNamespace

    from qtk import chunked_sdpa

    monkeypatch.setenv("QTK_CPU_BF16", bf16)
    calls = []
    monkeypatch.setattr(chunked_sdpa, "sdpa", lambda *a, **k: calls.append(1) or (None, None))
    q, kv = torch.randn(1, 4, L, 16), torch.randn(1, 2, L, 16)
    chunked_sdpa.chunked_causal_attention(SimpleNamespace(is_causal=True), q, kv, kv, None, scaling=0.25)
    assert (calls == []) == chunked
