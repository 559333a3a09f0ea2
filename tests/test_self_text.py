"""Calibration text the model writes itself (--dataset self, --dataset instruct) and mixes of sources
(builtin+self)."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from click.testing import CliRunner

from qtk.cli import main
from qtk.data import calibration_ids, load_texts
from qtk.errors import InputError
from qtk.loading import load_tokenizer
from qtk.pipeline import calibration_samples
from qtk.recipe import CalibrationArgs
from qtk import assets
from qtk.chat_template import prompt_ids
from qtk.runtime.engine import LLM
from qtk.runtime.sampling_params import SamplingParams
from qtk.self_text import ANSWER_TEMPERATURE, TOP_P, instructed_ids, instruction, self_generated_ids, turn_opening


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


def test_every_instruction_template_fills_from_its_slots():
    spec = json.loads(assets.instructions_file().read_text())
    rng = random.Random(0)
    drawn = {instruction(rng, spec) for _ in range(2000)}
    assert not any("{" in d or "}" in d for d in drawn)
    # every template is drawn, and a record's fields come with that record
    assert len({d.split(" ")[0] for d in drawn}) > 8
    gym = [d for d in drawn if "a gym membership" in d and "JSON" in d]
    assert gym and all("member_id (integer)" in d and "plan (one of basic, plus or premium) and active" in d for d in gym)


def test_instructed_samples_are_chats_of_instructions_and_the_models_answers(tiny_dir):
    """Each sample is a chat: the first user turn the first instruction drawn with the seed, the
    answer what the runtime samples for it with that request's seed; the same seed, the same samples."""
    tok = load_tokenizer(str(tiny_dir))
    ids = instructed_ids(str(tiny_dir), tok, 3, 96, seed=2)
    assert ids.shape == (3, 96) and len({tuple(r.tolist()) for r in ids}) == 3
    spec = json.loads(assets.instructions_file().read_text())
    first = prompt_ids(tok, [{"role": "user", "content": instruction(random.Random(2), spec)}])
    assert ids[0, :len(first)].tolist() == first
    answer = LLM(str(tiny_dir), max_model_len=96).generate(
        [first], SamplingParams(temperature=ANSWER_TEMPERATURE, top_p=TOP_P, seed=(2 * 100003 + 0) * 1009,
                                max_tokens=min(256, 96 - len(first))))[0].outputs[0].text
    text, full = tok.decode(ids[0]), tok.decode(first) + answer
    shared = min(len(text), len(full)) - 20  # the sample is cut at 96 tokens of the chat re-tokenized
    assert answer and shared > len(tok.decode(first)) and text[:shared] == full[:shared]
    assert torch.equal(instructed_ids(str(tiny_dir), tok, 3, 96, seed=2), ids)


def test_instructions_need_a_chat_template(tiny_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare)
    (bare / "chat_template.jinja").unlink()
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="no chat template"):
        instructed_ids(str(bare), load_tokenizer(str(bare)), 2, 64)
