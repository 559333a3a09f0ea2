"""Every command with the wrong kind of input: one clear line on stderr, exit 2, nothing written;
and a bug keeps its traceback."""
from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from qtk.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def error_line(result) -> str:
    """The CLI's error line (after any log lines and loading bars)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [ln for ln in result.stderr.replace("\r", "\n").splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


COMMANDS = [
    ("quantize", "{model}", "--method", "rtn", "-o", "{out}"),
    ("eval", "{model}", "--limit", "1"),
    ("inspect", "{model}"),
    ("generate", "{model}", "--prompt", "hi", "--max-tokens", "2"),
]


def each_command(model, out):
    for cmd in COMMANDS:
        yield cmd[0], run(*[a.format(model=model, out=out) for a in cmd])


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    for name, result in each_command(tmp_path / "empty", tmp_path / "out"):
        assert re.fullmatch(r"error: .*empty has no config\.json; MODEL must be an HF model directory, a \.gguf "
                            r"file or 'smollm2-135m'", error_line(result)), name
    assert not (tmp_path / "out").exists()


def test_config_that_is_not_a_model(tmp_path):
    d = tmp_path / "notamodel"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"not": "a model"}))
    for name, result in each_command(d, tmp_path / "out"):
        assert re.fullmatch(r"error: .*notamodel/config\.json does not describe a model \(no 'model_type'\); MODEL "
                            r"must be an HF model directory .*", error_line(result)), name
    (d / "config.json").write_text("{not json")
    for name, result in each_command(d, tmp_path / "out"):
        assert "config.json is not a readable JSON file" in error_line(result), name
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    for name, result in each_command(d, tmp_path / "out"):
        if name != "inspect":  # inspect reads any safetensors dir; it needs no architecture
            assert "unsupported architecture 'gpt2'" in error_line(result), name
    assert not (tmp_path / "out").exists()


@pytest.fixture
def broken_copy(tiny_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d)
    return d


def test_truncated_weights(broken_copy, tmp_path):
    f = broken_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 3])
    for name, result in each_command(broken_copy, tmp_path / "out"):
        assert re.fullmatch(rf"error: .*model\.safetensors is truncated: its header describes {len(data)} bytes, "
                            rf"the file has {len(data) // 3}; re-download or re-save it", error_line(result)), name
    f.write_bytes(b"garbage that is not a safetensors file")
    for name, result in each_command(broken_copy, tmp_path / "out"):
        assert "model.safetensors is not a safetensors file" in error_line(result), name
    f.unlink()
    for name, result in each_command(broken_copy, tmp_path / "out"):
        assert "has no weights" in error_line(result), name
    assert not (tmp_path / "out").exists()


def test_recipe_with_an_unknown_key(tiny_dir, tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("method: gptq\nscheme: w4a16\ngroupsize: 32\n")
    result = run("quantize", tiny_dir, "--recipe", r, "-o", tmp_path / "out")
    assert re.fullmatch(r"error: unknown key\(s\) \['groupsize'\] in recipe .*r\.yaml; known: \[.*'group_size'.*\]",
                        error_line(result))
    r.write_text("method: gptq\ngptq:\n  damp: 0.1\n")
    assert "unknown key(s) ['damp'] in recipe section 'gptq'" in error_line(run("quantize", tiny_dir, "--recipe", r,
                                                                                 "-o", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_unwritable_output_fails_before_loading_anything(tiny_dir, tmp_path, monkeypatch):
    from qtk import pipeline

    def must_not_load(*a, **k):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(pipeline, "load_model", must_not_load)
    monkeypatch.setattr(pipeline, "calibration_ids", must_not_load)
    result = run("quantize", tiny_dir, "--method", "gptq", "-o", "/proc/nope/x")
    assert re.fullmatch(r"error: cannot write --output /proc/nope/x: .*; choose a folder you can write to",
                        error_line(result))
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = run("quantize", tiny_dir, "--method", "gptq", "-o", blocker / "x")
    assert "cannot write --output" in error_line(result)


def test_a_bug_keeps_its_traceback(tiny_dir, tmp_path, monkeypatch):
    """Only user errors become one line: a RuntimeError from inside (a torch bug, an OOM) propagates."""
    from qtk import pipeline

    def boom(*a, **k):
        raise RuntimeError("an internal failure")

    monkeypatch.setattr(pipeline, "quantize_model", boom)
    result = run("quantize", tiny_dir, "--method", "rtn", "--group-size", 32, "-o", tmp_path / "out")
    assert isinstance(result.exception, RuntimeError) and result.exit_code == 1
    assert "error: " not in result.stderr
    assert not (tmp_path / "out").exists()


def test_default_group_size_fits_the_model_explicit_one_is_checked(tiny_dir, tmp_path, caplog):
    """No --group-size: the scheme's 128 becomes the largest power of two that divides every layer
    (the tiny model's hidden size is 64), and the log says so; --group-size 128 is refused."""
    out = tmp_path / "auto"
    with caplog.at_level("INFO", logger="qtk"):
        result = run("quantize", tiny_dir, "--method", "rtn", "-o", out)
    assert result.exit_code == 0, result.output
    assert "group size 64 (the default 128 does not divide every quantized layer" in caplog.text
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 64
    assert "group_size: 64" in (out / "recipe.yaml").read_text()
    result = run("quantize", tiny_dir, "--method", "rtn", "--group-size", 128, "-o", tmp_path / "explicit")
    assert re.fullmatch(r"error: group size 128 does not divide the input size of \d+ layer\(s\): .*; use --group-size 64",
                        error_line(result))
