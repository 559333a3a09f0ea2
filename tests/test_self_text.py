"""Calibration text the model writes itself (--dataset self) and mixes of sources (builtin+self)."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from qtk.cli import main
from qtk.data import calibration_ids, load_texts
from qtk.errors import InputError
from qtk.loading import load_tokenizer
from qtk.pipeline import calibration_samples
from qtk.recipe import CalibrationArgs
from qtk.self_text import self_generated_ids, turn_opening


def test_samples_open_a_user_turn_and_are_what_the_model_samples(tiny_dir):
    """Each sample starts with the template's user-turn opening and continues as the runtime samples
    it with that request's seed: the same seed gives the same sample alone or in a batch."""
    tok = load_tokenizer(str(tiny_dir))
    start = turn_opening(tok)
    assert tok.decode(start).endswith("user\n")
    ids = self_generated_ids(str(tiny_dir), tok, 3, 32, seed=1)
    assert ids.shape == (3, 32) and all(row[:len(start)].tolist() == start for row in ids)
    assert len({tuple(r.tolist()) for r in ids}) == 3  # its own seed each
    again = self_generated_ids(str(tiny_dir), tok, 1, 32, seed=1)
    assert torch.equal(again[0], ids[0])


def test_a_mix_splits_the_samples_evenly(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    c = CalibrationArgs(dataset="builtin+self", num_samples=5, seq_len=32)
    ids = calibration_samples(tiny_dir, tok, c, "cpu")
    assert ids.shape == (5, 32)
    assert torch.equal(ids[:3], calibration_ids(tok, "builtin", 3, 32, 0))  # the first source takes the extra one
    start = turn_opening(tok)
    assert all(row[:len(start)].tolist() == start for row in ids[3:])


def test_quantize_on_its_own_text_and_refusals(tiny_dir, tmp_path):
    r = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--method", "gptq", "--group-size", "32",
                                  "--dataset", "self", "--num-samples", "4", "--seq-len", "48", "-o", str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    assert "recipe.yaml" in {p.name for p in (tmp_path / "q").iterdir()}
    with pytest.raises(InputError, match="for calibration"):
        load_texts("self", "evaluation")
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--task", "ppl", "--dataset", "builtin+self"])
    assert r.exit_code == 2 and "for calibration" in r.output, r.output
