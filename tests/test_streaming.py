"""Quantizing a model streamed from its files block by block (qtk/streaming.py): the blocks read as
transformers loads them, every method writing the same checkpoint as with the whole model loaded,
one block in memory at a time, nothing left behind by a failure, and a recipe that needs the whole
model refused before it loads a model bigger than the memory free."""
from dataclasses import replace

import pytest
import torch

from qtk import pipeline
from qtk.errors import InputError
from qtk.methods.args import AutoRoundArgs
from qtk.moe import linearize_experts
from qtk.recipe import CalibrationArgs, DistillArgs, from_flags
from qtk.streaming import StreamedModel

from zoo import ZOO, files_state, saved, tiny

READ_TYPES = ["llama", "qwen2", "gemma3_text", "phi3", "opt", "mixtral", "qwen3_moe", "gpt_oss"]


def deep(model_type: str, layers: int = 3):
    """A tiny zoo model of `layers` blocks (its layer_types pattern repeated)."""
    types = ZOO[model_type].get("layer_types")
    extra = {"layer_types": [types[i % len(types)] for i in range(layers)]} if types else {}
    return tiny(model_type, num_hidden_layers=layers, **extra)


def calibration(tmp_path, n=4, seq_len=32):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and 12 cats sat on 3 mats. " * 60)
    return CalibrationArgs(dataset=str(text), num_samples=n, seq_len=seq_len, batch_size=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", READ_TYPES)
def test_each_block_is_read_as_transformers_loads_it(model_type, dtype, tmp_path):
    """Every tensor a streamed block reads equals transformers' from_pretrained's, dtype included
    (experts as Linears); freed, the block is on meta again and a second read is the same."""
    from transformers import AutoModelForCausalLM

    src = saved(deep(model_type, 3), tmp_path / "src")
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    linearize_experts(reference)
    expected = reference.state_dict()
    stream = StreamedModel.open(src, dtype)
    outside = {k: v for k, v in stream.model.state_dict().items() if not v.is_meta}
    for k, v in outside.items():
        assert v.dtype == expected[k].dtype and torch.equal(v, expected[k]), k
    for i in range(len(stream.layers)):
        for _ in range(2):
            layer = stream.load(i)
            prefix = f"{stream.block_name(i)}."
            got = layer.state_dict()
            assert got.keys() == {k[len(prefix):] for k in expected if k.startswith(prefix)}
            for k, v in got.items():
                assert v.dtype == expected[prefix + k].dtype and torch.equal(v, expected[prefix + k]), prefix + k
            stream.free(i)
            assert not stream.is_loaded(i)


def both_ways(src, recipe, tmp_path, dtype=torch.float32):
    """(the whole model's checkpoint, the streamed one) of `recipe` on `src`, as qtk quantize writes them."""
    job = pipeline.prepare(src, recipe, tmp_path / "whole", False)
    assert job.streams
    pipeline.write(job, job.load(), job.recipe, tmp_path / "whole", False, dtype, False)
    report = pipeline.quantize(src, recipe, tmp_path / "streamed", dtype=dtype, progress=False)
    assert report["streamed"]
    return tmp_path / "whole", tmp_path / "streamed"


def assert_same_checkpoint(a, b):
    import json

    sa, sb = files_state(a), files_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (a, b))
    assert ca == cb


RECIPES = {
    "rtn": dict(method="rtn", group_size=32),
    "gptq": dict(method="gptq", group_size=32),
    "awq": dict(method="awq", scheme="w4a16_asym", group_size=32),
    "smoothquant_w8a8": dict(method="smoothquant", scheme="w8a8", weights="gptq"),
    "fp8_static_kv_fp8": dict(method="fp8", scheme="fp8_static", kv_cache="fp8"),
    "gptq_kv_int8": dict(method="gptq", group_size=32, kv_cache="int8"),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_streamed_quantize_writes_what_the_whole_model_writes(name, tmp_path):
    src = saved(deep("llama", 3), tmp_path / "src")
    recipe = replace(from_flags(**RECIPES[name]), calibration=calibration(tmp_path))
    assert_same_checkpoint(*both_ways(src, recipe, tmp_path))


def test_autoround_streamed_writes_what_the_whole_model_writes(tmp_path):
    src = saved(deep("llama", 3), tmp_path / "src")
    recipe = replace(from_flags("autoround", scheme="w4a16", group_size=32), autoround=AutoRoundArgs(iters=3),
                     calibration=calibration(tmp_path))
    assert_same_checkpoint(*both_ways(src, recipe, tmp_path))


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen2", "mixtral", "qwen3_moe", "gpt_oss"])
def test_other_families_streamed_write_what_the_whole_model_writes(model_type, tmp_path):
    """Sliding windows and (1 + w) norms, experts under the hub's names (3-D in gpt-oss's files)."""
    src = saved(deep(model_type, 3), tmp_path / "src")
    recipe = replace(from_flags("awq", scheme="w4a16_asym", group_size=32, weights="gptq"),
                     calibration=calibration(tmp_path))
    assert_same_checkpoint(*both_ways(src, recipe, tmp_path))


def test_one_block_is_in_memory_at_a_time(tmp_path, monkeypatch):
    """Whenever a block is read (the traced forward, the probes, the calibration), no other is."""
    src = saved(deep("llama", 5), tmp_path / "src")
    reads, load = [], StreamedModel.load

    def checked(self, i):
        others = [j for j in range(len(self.layers)) if j != i and self.is_loaded(j)]
        assert not others, f"block {i} read while {others} are"
        reads.append(i)
        return load(self, i)

    monkeypatch.setattr(StreamedModel, "load", checked)
    recipe = replace(from_flags("gptq", group_size=32), calibration=calibration(tmp_path))
    pipeline.quantize(src, recipe, tmp_path / "q", dtype=torch.float32, progress=False)
    assert sorted(set(reads)) == list(range(5))


def failing_at(monkeypatch, block: int):
    """write_block raises at `block` (a disk that fills up)."""
    import qtk.pipeline as p

    real = p.write_block

    def failing(model, name, path, dtype):
        if name.endswith(f".{block}"):
            raise RuntimeError("disk full")
        real(model, name, path, dtype)

    monkeypatch.setattr(p, "write_block", failing)


def test_a_failure_at_the_first_block_leaves_nothing(tmp_path, monkeypatch):
    src = saved(deep("llama", 3), tmp_path / "src")
    failing_at(monkeypatch, 0)
    recipe = replace(from_flags("rtn", group_size=32), calibration=calibration(tmp_path))
    with pytest.raises(RuntimeError, match="disk full"):
        pipeline.quantize(src, recipe, tmp_path / "out" / "q", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_failure_keeps_the_finished_blocks_and_resume_finishes_the_same_checkpoint(tmp_path, monkeypatch, caplog):
    """A failure at block 2 of 4: no output, the staging folder beside it with 2 finished blocks and a
    hint to resume; --resume then writes what an uninterrupted run writes, and removes the staging."""
    src = saved(deep("llama", 4), tmp_path / "src")
    recipe = replace(from_flags("gptq", group_size=32, kv_cache="int8"), calibration=calibration(tmp_path))
    pipeline.quantize(src, recipe, tmp_path / "ref", dtype=torch.float32, progress=False)
    out = tmp_path / "out" / "q"
    with monkeypatch.context() as m:
        failing_at(m, 2)
        with pytest.raises(RuntimeError, match="disk full"):
            pipeline.quantize(src, recipe, out, dtype=torch.float32, progress=False)
    assert not out.exists()
    staging = tmp_path / "out" / ".q.qtk-staging"
    assert sorted(p.name for p in staging.glob("block-*")) == ["block-00000.safetensors", "block-00001.safetensors"]
    assert "2 of 4 blocks are finished" in caplog.text and "--resume" in caplog.text
    with pytest.raises(InputError, match="left 2 finished blocks .* pass --resume to continue it, or --force"):
        pipeline.quantize(src, recipe, out, dtype=torch.float32, progress=False)
    report = pipeline.quantize(src, recipe, out, dtype=torch.float32, progress=False, resume=True)
    assert report["resumed_at"] == 2 and not staging.exists()
    assert_same_checkpoint(tmp_path / "ref", out)


def test_resume_refuses_another_recipe_and_nothing_to_resume(tmp_path, monkeypatch):
    src = saved(deep("llama", 3), tmp_path / "src")
    recipe = replace(from_flags("rtn", group_size=32), calibration=calibration(tmp_path))
    out = tmp_path / "q"
    with pytest.raises(InputError, match="no interrupted run into .* to continue"):
        pipeline.quantize(src, recipe, out, progress=False, resume=True)
    with monkeypatch.context() as m:
        failing_at(m, 1)
        with pytest.raises(RuntimeError):
            pipeline.quantize(src, recipe, out, progress=False)
    with pytest.raises(InputError, match="was of another recipe"):
        pipeline.quantize(src, replace(recipe, scheme=recipe.scheme.with_group_size(16)), out, progress=False,
                          resume=True)
    pipeline.quantize(src, recipe, out, progress=False, force=True)  # --force starts over
    assert out.is_dir() and not (tmp_path / ".q.qtk-staging").exists()


KILL_POINTS = {  # where the process kills itself: while writing block 3, or half-way through saving the state after it
    "writing a block": """
import qtk.pipeline as p
real = p.write_block
def killed(model, name, path, dtype):
    if name.endswith('.3'):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(model, name, path, dtype)
p.write_block = killed
""",
    "saving the state": """
from qtk.staging import Staging
real = Staging.save
def killed(self, carry, blocks):
    if carry['next'] == 4:
        (self.folder / 'state.pt.tmp').write_bytes(b'half a file')
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, carry, blocks)
Staging.save = killed
""",
}


@pytest.mark.parametrize("method,where", [("gptq", "writing a block"), ("autoround", "saving the state")])
def test_killed_and_resumed_gives_the_files_of_an_uninterrupted_run(where, method, tmp_path):
    """`qtk quantize` killed (SIGKILL) after block 3 of 5 is finished, then run again with --resume:
    the same files as a run never killed."""
    import subprocess
    import sys

    src = saved(deep("llama", 5), tmp_path / "src")
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and 12 cats sat on 3 mats. " * 60)
    args = ["quantize", src, "--method", method, "--group-size", "32", "--dataset", text, "--num-samples", "4",
            "--seq-len", "32", "--batch-size", "2", "--kv-cache", "fp8", *(["--iters", "3"] if method == "autoround" else [])]
    script = "import os, signal, sys\n{}\nfrom qtk.cli import main\nmain(sys.argv[1:])"

    def qtk(*extra, killed=False):
        cmd = [sys.executable, "-c", script.format(KILL_POINTS[where] if killed else "")]
        return subprocess.run(cmd + [str(a) for a in (*args, *extra)], capture_output=True, text=True)

    ran = qtk("-o", tmp_path / "ref")
    assert ran.returncode == 0, ran.stderr
    ran = qtk("-o", tmp_path / "q", killed=True)
    assert ran.returncode == -9, ran.stderr
    assert not (tmp_path / "q").exists() and (tmp_path / ".q.qtk-staging").is_dir()
    ran = qtk("-o", tmp_path / "q", "--resume")
    assert ran.returncode == 0, ran.stderr
    assert "resuming at block 3 of 5" in ran.stderr
    assert_same_checkpoint(tmp_path / "ref", tmp_path / "q")


def test_a_recipe_that_needs_the_whole_model_is_refused_where_it_does_not_fit(tmp_path, monkeypatch):
    """The default recipe's passes run the whole model: with less memory free than the model takes it
    is refused before loading, naming those passes; a block-wise recipe streams instead."""
    src = saved(deep("llama", 2), tmp_path / "src")
    monkeypatch.setattr(pipeline, "available_memory", lambda: 1024)
    cal = calibration(tmp_path)
    recipe = replace(from_flags("gptq", group_size=32), calibration=cal, max_bits=5.0,
                     distill=DistillArgs(samples=2))
    with pytest.raises(InputError, match="whole model at once for: max_bits .*distill.*streamed block by block"):
        pipeline.quantize(src, recipe, tmp_path / "q", progress=False)
    assert not (tmp_path / "q").exists()
    report = pipeline.quantize(src, replace(recipe, max_bits=None, distill=DistillArgs(samples=0)), tmp_path / "q",
                               progress=False)
    assert report["streamed"]


def test_files_of_another_model_are_refused_with_what_does_not_fit(tmp_path):
    """A config with fewer blocks than the files hold, or files missing a block's tensor: one CheckpointError."""
    import json

    from safetensors.torch import save_file

    from qtk.errors import CheckpointError

    src = tmp_path / "src"
    saved(deep("llama", 3), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match="belongs to no block of the 2"):
        StreamedModel.open(src, torch.float32)
    (src / "config.json").write_text(json.dumps(config))
    state = files_state(src)
    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"},
              str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match="1 weights the config needs are not in its files.*layers.1.mlp.up_proj"):
        StreamedModel.open(src, torch.float32)  # before any block is read
