"""Calibration activations kept on disk (qtk/spill.py): a kept tensor holds the same values from a
file nothing names, auto chooses disk only above half the memory available, and a quantize with
its activations on disk writes the files of one that kept them in memory, leaving no folder behind."""
import json
from dataclasses import replace

import pytest
import torch

from qtk import pipeline
from qtk.errors import InputError
from qtk.methods.args import AutoRoundArgs
from qtk.recipe import CalibrationArgs, build, from_flags
from qtk.spill import Activations, activation_bytes

from test_streaming import assert_same_checkpoint, calibration, deep, failing_at
from zoo import saved


def mapped_from(t: torch.Tensor) -> str:
    """The file (Linux's /proc/self/maps) that t's memory is mapped from, '' for anonymous memory."""
    address = t.data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5].strip() if len(fields) > 5 else ""
    return ""


def test_a_kept_tensor_is_the_same_values_mapped_from_a_file_nothing_names(tmp_path):
    store = Activations(tmp_path / "a" / "b")
    t = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    kept = store.keep(t[:, ::2])  # not contiguous: stored as its values
    assert torch.equal(kept, t[:, ::2]) and kept.dtype == torch.bfloat16
    assert str(tmp_path / "a" / "b") in mapped_from(kept)  # memory-mapped, not a copy in memory
    assert list((tmp_path / "a" / "b").iterdir()) == []  # unlinked: the space returns when freed
    assert store.written == t[:, ::2].numel() * 2
    assert torch.equal(kept + 1, t[:, ::2] + 1)  # still readable after the unlink
    store.close()
    assert not (tmp_path / "a").exists()  # the folders it made, and only those
    assert tmp_path.exists()


def test_in_memory_a_kept_tensor_is_the_tensor():
    t = torch.randn(3)
    assert Activations().keep(t) is t and not Activations().on_disk and "qtk" not in mapped_from(t)


@pytest.mark.parametrize("place, need, available, on_disk", [
    ("auto", 100, 1000, False), ("auto", 501, 1000, True), ("auto", 10**12, None, False),
    ("disk", 1, 10**12, True), ("memory", 10**12, 1000, False)])
def test_where_they_wait(place, need, available, on_disk, tmp_path):
    assert Activations.choose(place, need, tmp_path / "x", available).on_disk == on_disk


def test_the_bytes_counted_are_a_blocks_inputs_and_outputs():
    assert activation_bytes(512, 2048, 8192, torch.bfloat16, False) == 512 * 2048 * 8192 * 2 * 2
    assert activation_bytes(4, 8, 16, torch.float32, True) == 4 * 8 * 16 * 4 * 4


def test_a_place_that_is_not_one_is_refused():
    with pytest.raises(InputError, match="calibration.activations must be one of auto, memory, disk"):
        CalibrationArgs(activations="ssd")


RECIPES = {
    "gptq_kv_int8": dict(method="gptq", group_size=32, kv_cache="int8"),
    "awq_gptq": dict(method="awq", scheme="w4a16_asym", group_size=32, weights="gptq"),
    "smoothquant_w8a8": dict(method="smoothquant", scheme="w8a8", weights="gptq"),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_on_disk_a_streamed_quantize_writes_what_memory_writes(name, tmp_path):
    src = saved(deep("llama", 3), tmp_path / "src")
    recipe = replace(from_flags(**RECIPES[name]), calibration=calibration(tmp_path), dtype="float32")
    pipeline.quantize(src, recipe, tmp_path / "memory", dtype=torch.float32, progress=False)
    disk = replace(recipe, calibration=replace(recipe.calibration, activations="disk"))
    report = pipeline.quantize(src, disk, tmp_path / "out" / "disk", dtype=torch.float32, progress=False)
    hidden = json.loads((tmp_path / "src" / "config.json").read_text())["hidden_size"]
    kept = 3 + (disk.kv_cache is not None)  # block 0's inputs, each block's outputs but the last's (unless KV is observed on them)
    assert report["streamed"] and report["activations_on_disk"]["bytes_written"] == kept * 4 * 32 * hidden * 4
    assert_same_checkpoint(tmp_path / "memory", tmp_path / "out" / "disk")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["disk"]  # no activations folder left


def test_on_disk_autoround_and_a_whole_model_recipe_write_what_memory_writes(tmp_path):
    """AutoRound follows the float model's activations too; --rotate down runs the whole model."""
    src = saved(deep("llama", 3), tmp_path / "src")
    for name, recipe in {"autoround": replace(from_flags("autoround", scheme="w4a16", group_size=32),
                                              autoround=AutoRoundArgs(iters=3)),
                         "rotated": build(method="gptq", group_size=32, rotate=("down",))}.items():
        recipe = replace(recipe, calibration=calibration(tmp_path))
        pipeline.quantize(src, recipe, tmp_path / f"{name}-memory", dtype=torch.float32, progress=False)
        disk = replace(recipe, calibration=replace(recipe.calibration, activations="disk"))
        report = pipeline.quantize(src, disk, tmp_path / f"{name}-disk", dtype=torch.float32, progress=False)
        assert report["activations_on_disk"]["bytes_written"] > 0
        assert_same_checkpoint(tmp_path / f"{name}-memory", tmp_path / f"{name}-disk")
    assert not list(tmp_path.glob(".*qtk-activations*"))


def test_the_cli_keeps_them_on_disk_and_says_where(tmp_path, caplog):
    from click.testing import CliRunner

    from qtk.cli import main

    src = saved(deep("llama", 2), tmp_path / "src")
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and 12 cats sat on 3 mats. " * 60)
    with caplog.at_level("INFO", logger="qtk.spill"):
        r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "q"), "--method", "gptq",
                                      "--group-size", "32", "--dataset", str(text), "--num-samples", "4",
                                      "--seq-len", "32", "--activations", "disk"])
    assert r.exit_code == 0, r.output
    assert f"kept on disk in {tmp_path / '.q.qtk-activations'} (calibration.activations: disk)" in caplog.text
    assert build(recipe_file=str(tmp_path / "q" / "recipe.yaml")).calibration.activations == "disk"
    assert not (tmp_path / ".q.qtk-activations").exists()
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "r"), "--activations", "ssd"])
    assert r.exit_code == 2 and "'ssd' is not one of 'auto', 'memory', 'disk'" in r.output


def test_on_disk_a_failed_run_leaves_no_activations_and_resumes_to_the_same_files(tmp_path, monkeypatch):
    """A failure at block 2 of 4 with the activations on disk: their folder is gone, the staging kept;
    the resume reads the staged inputs memory-mapped and writes what a run in memory writes."""
    src = saved(deep("llama", 4), tmp_path / "src")
    recipe = replace(from_flags("gptq", group_size=32, kv_cache="int8"), calibration=calibration(tmp_path))
    pipeline.quantize(src, recipe, tmp_path / "ref", dtype=torch.float32, progress=False)
    disk = replace(recipe, calibration=replace(recipe.calibration, activations="disk"))
    out = tmp_path / "out" / "q"
    with monkeypatch.context() as m:
        failing_at(m, 2)
        with pytest.raises(RuntimeError, match="disk full"):
            pipeline.quantize(src, disk, out, dtype=torch.float32, progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".q.qtk-staging"]
    report = pipeline.quantize(src, disk, out, dtype=torch.float32, progress=False, resume=True)
    assert report["resumed_at"] == 2 and report["activations_on_disk"]["bytes_written"] > 0
    assert_same_checkpoint(tmp_path / "ref", out)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["q"]
