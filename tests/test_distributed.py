"""Data-parallel calibration (qtk/distributed.py): `qtk quantize --nproc 2` runs each process on its
share of the calibration batches and writes the checkpoint one process writes, up to the order of
float sums; what the processes cannot share is refused before any weights are read."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from qtk import distributed, pipeline
from qtk.errors import InputError
from qtk.recipe import from_flags

from zoo import files_state, saved, tiny


def _qtk(*args, nproc: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "qtk", "quantize", *map(str, args), *(["--nproc", str(nproc)] if nproc > 1 else [])]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _codes(t: torch.Tensor, name: str) -> torch.Tensor:
    """Integer codes one by one (int4 packed eight to an int32 word, unpacked)."""
    return torch.stack([(t >> (4 * i)) & 15 for i in range(8)], -1) if name.endswith("weight_packed") else t


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    src = saved(tiny("llama", num_hidden_layers=3), d / "src")
    text = d / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and 12 cats sat on 3 mats. " * 80)
    return src, text


def test_batches_are_dealt_in_turn(monkeypatch):
    """Rank r of N takes batches r, r + N, ...; where each starts among all samples and how many
    there are come with them; fewer batches than processes is refused."""
    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    monkeypatch.setattr(distributed, "size", lambda: 2)
    ids = torch.arange(10)[:, None].repeat(1, 3)
    mine, starts, batches = distributed.shard(ids, 2)
    assert mine[:, 0].tolist() == [2, 3, 6, 7] and starts == [2, 6] and batches == 5
    monkeypatch.setattr(distributed, "size", lambda: 6)
    with pytest.raises(InputError, match="5 calibration batches of 2 cannot be shared by 6 processes"):
        distributed.shard(ids, 2)


def test_solves_are_dealt_costliest_first_to_the_least_loaded(monkeypatch):
    """GPTQ's solves among the processes: the costliest first, each to the least loaded; one process
    does all of them."""
    monkeypatch.setattr(distributed, "size", lambda: 2)
    assert distributed.deal([1.0, 8.0, 3.0, 4.0]) == [1, 0, 1, 1]  # 8 -> 0; 4 -> 1; 3 -> 1 (4 < 8); 1 -> 1 (7 < 8)
    monkeypatch.setattr(distributed, "size", lambda: 1)
    assert distributed.deal([1.0, 8.0]) == [0, 0]


CASES = {  # every statistic the processes share: Hessians, AWQ's means, Grams and losses, ranges
    "gptq + int8 KV": ["--method", "gptq", "--group-size", "32", "--kv-cache", "int8"],
    "awq + gptq": ["--method", "awq", "--weights", "gptq", "--scheme", "w4a16_asym", "--group-size", "32"],
    "smoothquant w8a8": ["--method", "smoothquant", "--scheme", "w8a8"],
    "fp8 static + fp8 KV": ["--method", "fp8", "--scheme", "fp8_static", "--kv-cache", "fp8"],
}


@pytest.mark.parametrize("case", CASES)
def test_two_processes_write_one_process_checkpoint(case, model_and_text, tmp_path):
    """Two processes (gloo), each on 2 of the 4 batches: the same tensors as one process on all 4, up
    to float rounding: the sums run in another order, and GPTQ's solution follows their last bits
    from block to block (float32 calibration: up to 7.3% of a layer's int4 codes and 1.8% of a weight
    scale moved; without the Hessians' sum 33-37% of codes do). Observed ranges within 1e-3, weight
    scales within 5%, at most 15% of each layer's codes different; the same config."""
    src, text = model_and_text
    args = [src, *CASES[case], "--dataset", text, "--num-samples", 8, "--seq-len", 32, "--batch-size", 2]
    one = _qtk(*args, "-o", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    two = _qtk(*args, "-o", tmp_path / "two", nproc=2)
    assert two.returncode == 0, two.stderr
    assert "2 processes" in two.stdout and two.stdout.count("wrote") == 1
    a, b = files_state(tmp_path / "one"), files_state(tmp_path / "two")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if a[k].dtype.is_floating_point:  # GPTQ's scales follow its codes; the observed ranges are maxima
            rel = (a[k].float() - b[k].float()).abs() / a[k].float().abs().clamp_min(1e-6)
            assert rel.max() <= (0.05 if k.endswith("weight_scale") else 1e-3), k
        else:
            assert (_codes(a[k], k) != _codes(b[k], k)).float().mean() <= 0.15, k
    assert (tmp_path / "one" / "config.json").read_text() == (tmp_path / "two" / "config.json").read_text()
    assert not list(tmp_path.glob(".*qtk-staging"))


def test_what_processes_cannot_share_is_refused(model_and_text, tmp_path, monkeypatch):
    """Whole-model passes, AutoRound and --resume are refused with one line before any weights are read
    (the check itself, then through the command: exit 2, one error line, nothing written)."""
    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed, "size", lambda: 2)
    job = SimpleNamespace(whole_model_passes=["max_bits (...)"], recipe=from_flags("gptq"))
    with pytest.raises(InputError, match="calibrate block by block.*whole model at once for: max_bits"):
        pipeline.check_processes(job, resume=False)
    job.whole_model_passes = []
    with pytest.raises(InputError, match="--resume continues a run of one process"):
        pipeline.check_processes(job, resume=True)
    job.recipe = from_flags("autoround")
    with pytest.raises(InputError, match="autoround .* runs in one process"):
        pipeline.check_processes(job, resume=False)

    src, text = model_and_text
    ran = _qtk(src, "--method", "autoround", "--group-size", "32", "--dataset", text, "--num-samples", 8,
               "--seq-len", 32, "-o", tmp_path / "q", nproc=2)
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.count("error:") == 1 and "runs in one process" in ran.stderr
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".*qtk-staging"))
