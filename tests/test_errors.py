"""Every command with the wrong kind of input: one clear line on stderr, exit 2, nothing written;
and a bug keeps its traceback."""
from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from qtk.cli import main
from qtk.errors import InputError
from qtk.recipe import CalibrationArgs, build


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
    (d / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    for name, result in each_command(d, tmp_path / "out"):
        if name != "inspect":  # inspect reads any safetensors dir; it needs no architecture
            assert "model_type 'mamba' has layers of type linear_attention" in error_line(result), name
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


def test_an_output_that_would_replace_the_model_is_refused_even_with_force(tiny_dir, tmp_path):
    import shutil

    model = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_dir, model)
    before = sorted(p.name for p in model.iterdir())
    for out in (model, model.parent, tmp_path / "models" / "." / "tiny"):
        result = run("quantize", model, "--method", "rtn", "-o", out, "--force")
        assert error_line(result) == (f"error: --output {out} would replace the model being quantized ({model}); "
                                      "choose another output folder")
    assert sorted(p.name for p in model.iterdir()) == before


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


def test_a_failed_quantize_leaves_no_folders_it_made(tiny_dir, tmp_path, monkeypatch):
    """Missing parents of --output are made only for the write, and removed again when it fails."""
    from qtk import checkpoint, pipeline

    def boom(*a, **k):
        raise RuntimeError("an internal failure")

    monkeypatch.setattr(pipeline, "quantize_model", boom)
    result = run("quantize", tiny_dir, "--method", "rtn", "--group-size", 32, "-o", tmp_path / "a" / "b" / "out")
    assert isinstance(result.exception, RuntimeError)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setattr(checkpoint, "save_file", boom)
    result = run("quantize", tiny_dir, "--method", "rtn", "--group-size", 32, "-o", tmp_path / "a" / "b" / "out")
    assert isinstance(result.exception, RuntimeError)
    assert list(tmp_path.iterdir()) == []


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


@pytest.mark.parametrize("recipe,message", [
    ("method: gptq\ngptq: 5\n", "recipe section 'gptq' must be a mapping"),
    ("method: gptq\ncalibration: {num_samples: many}\n", "calibration.num_samples must be an integer, got 'many'"),
    ("method: awq\nawq: {grid: 2.5}\n", "awq.grid must be an integer, got 2.5"),
    ("method: gptq\ngptq: {dampening: low}\n", "gptq.dampening must be a number, got 'low'"),
    ("method: gptq\ngptq: {act_order: 'yes'}\n", "gptq.act_order must be true or false"),
    ("method: [gptq]\n", "recipe method must be a string"),
    ("method: rtn\nscheme: 4\n", "recipe scheme must be a string, got 4"),
    ("method: rtn\ngroup_size: '64'\n", "recipe group_size must be an integer"),
    ("method: rtn\nignore: 're:.*mlp.*'\n", "recipe ignore must be a list"),
    ("method: rtn\ndevice: tpu\n", "device must be cpu or cuda[:N], got 'tpu'"),
    ("method: gptq\ncalibration: {seed: 18446744073709551616}\n",
     "calibration.seed must fit in 64 bits (-2**63 <= seed < 2**64), got 18446744073709551616"),
    (b"method: rtn\n# caf\xe9\n", "is not UTF-8 text"),
])
def test_recipe_values_of_the_wrong_type(tiny_dir, tmp_path, recipe, message):
    r = tmp_path / "r.yaml"
    r.write_bytes(recipe if isinstance(recipe, bytes) else recipe.encode())
    assert message in error_line(run("quantize", tiny_dir, "--recipe", r, "-o", tmp_path / "out"))
    assert message.startswith("recipe") or "is a folder" in error_line(run("quantize", tiny_dir, "--recipe", tmp_path,
                                                                            "-o", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,message", [
    (("--method", "rtn", "--ignore", "mlp.down_proj"), "ignore pattern 'mlp.down_proj' matches no Linear layer"),
    (("--method", "rtn", "--ignore", "re:.*"), "leave no decoder layer to quantize"),
    (("--method", "rtn", "--group-size", "0"), "group size must be positive, or -1"),
    (("--method", "rtn", "--device", "tpu"), "device must be cpu or cuda[:N]"),
    (("--method", "rtn", "--ignore", "re:[mlp"), "ignore pattern 're:[mlp' is not a valid regular expression"),
    # options the recipe would ignore (and write into recipe.yaml as if used)
    (("--method", "rtn", "--kv-strategy", "head"), "kv_strategy 'head' (--kv-strategy) applies to KV-cache scales; "
                                                   "add --kv-cache fp8|int8"),
    (("--method", "rtn", "--dampening", "0.05"), "--dampening: gptq option(s), but this recipe (method rtn, rtn "
                                                 "weights) does not run gptq"),
    (("--method", "awq", "--no-act-order"), "--act-order: gptq option(s), but this recipe (method awq, rtn weights)"),
    (("--method", "gptq", "--alpha", "0.8"), "--alpha: smoothquant option(s), but this recipe (method gptq"),
    # calibration options where nothing calibrates (RTN weights, dynamic or no activation scales, no KV scales)
    (("--method", "rtn", "--dataset", "nonexistent.txt", "--num-samples", "999"),
     "--dataset, --num-samples: calibration option(s), but this recipe (method rtn, rtn weights) takes no "
     "calibration data"),
    (("--method", "rtn", "--scheme", "w8a16", "--chat-template"), "--chat-template: calibration option(s), but this "
                                                                  "recipe (method rtn, rtn weights) takes no"),
    (("--method", "fp8", "--seq-len", "64", "--batch-size", "2", "--seed", "3"),
     "--batch-size, --seed, --seq-len: calibration option(s), but this recipe (method fp8, rtn weights) takes no "
     "calibration data; only gptq weights, awq, smoothquant, static activation scales, --kv-cache scales, "
     "--max-bits and --distill-samples calibrate"),
])
def test_quantize_options_that_cannot_work(tiny_dir, tmp_path, args, message):
    assert message in error_line(run("quantize", tiny_dir, *args, "-o", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_method_options_are_taken_where_the_recipe_runs_the_method():
    assert build(gptq={"dampening": 0.05}).gptq.dampening == 0.05  # the default recipe: awq + gptq
    assert build(method="awq", weights="gptq", gptq={"act_order": False}).gptq.act_order is False
    assert build(method="smoothquant", smoothquant={"alpha": 0.8}).smoothquant.alpha == 0.8
    assert build(recipe_file="calibration/recipes/fp8-static-fp8kv.yaml", kv_strategy="head").kv_cache.strategy \
        == "attn_head"


@pytest.mark.parametrize("kwargs", [
    dict(method="gptq"), dict(method="awq"), dict(method="smoothquant"), dict(),  # the default recipe: awq + gptq
    dict(method="fp8", scheme="fp8_static"),  # static activation scales
    dict(method="rtn", kv_cache="fp8"), dict(method="fp8", kv_cache="fp8"),  # KV-cache scales
])
def test_calibration_options_are_taken_where_the_recipe_reads_data(kwargs):
    c = {"dataset": "calib.txt", "num_samples": 3, "seq_len": 32, "batch_size": 2, "chat_template": True, "seed": 5}
    r = build(**kwargs, calibration=c)
    assert r.needs_data and r.calibration == CalibrationArgs(**c)


def test_calibration_options_left_unset_or_in_a_recipe_file_are_not_refused(tmp_path):
    from qtk.recipe import to_yaml

    unset = dict.fromkeys(("dataset", "num_samples", "seq_len", "batch_size", "chat_template", "seed"))
    assert not build(method="rtn", calibration=unset).needs_data  # the CLI's flags, none given
    f = tmp_path / "rtn.yaml"  # a recipe.yaml qtk wrote always holds a calibration section
    f.write_text(to_yaml(build(method="rtn")))
    assert build(recipe_file=str(f)).calibration == CalibrationArgs()
    with pytest.raises(InputError, match="--num-samples: calibration option"):
        build(recipe_file=str(f), calibration={"num_samples": 8})


@pytest.mark.parametrize("args,message", [
    (("eval", "{model}", "--limit", "0"), "Invalid value for '--limit': 0 is not in the range x>=1"),
    (("eval", "{model}", "--task", "json", "--limit", "-1"), "Invalid value for '--limit': -1 is not in the range"),
    (("eval", "{model}", "--task", "needle", "--dataset", "{latin1}"),
     "error: needle filler text {latin1} is not UTF-8 text (byte 6)"),
    (("generate", "{model}", "--prompt", "hi", "--block-size", "0"), "Invalid value for '--block-size'"),
    (("generate", "{model}", "--prompt", "hi", "--max-num-seqs", "0"), "Invalid value for '--max-num-seqs'"),
    (("generate", "{model}", "--prompt", "hi", "--max-model-len", "0"), "Invalid value for '--max-model-len'"),
    (("generate", "{model}", "--prompt", "hi", "--kv-cache-memory", "0"), "Invalid value for '--kv-cache-memory'"),
    (("serve", "{model}", "--port", "70000"), "Invalid value for '--port': 70000 is not in the range 0<=x<=65535"),
    (("serve", "{model}", "--chat-template", "{latin1}"), "error: --chat-template file {latin1} is not UTF-8 text"),
    (("bench", "kernels", "--device", "cpu", "--m", "1,x"), "error: --m takes comma-separated integers, got '1,x'"),
    # seeds torch (64 bits) or numpy (lm-eval's, 32 bits unsigned) cannot take
    (("quantize", "{model}", "--method", "gptq", "--seed", 2 ** 64, "-o", "{out}"),
     "Invalid value for '--seed': 18446744073709551616 is not in the range -9223372036854775808<=x<="
     "18446744073709551615"),
    (("eval", "{model}", "--seed", 2 ** 32),
     "Invalid value for '--seed': 4294967296 is not in the range 0<=x<=4294967295"),
    (("eval", "{model}", "--seed", -1), "Invalid value for '--seed': -1 is not in the range 0<=x<=4294967295"),
    (("generate", "{model}", "--prompt", "hi", "--seed", 2 ** 64), "Invalid value for '--seed': 18446744073709551616"),
])
def test_bad_option_values_are_refused_before_a_model_loads(tiny_dir, tmp_path, monkeypatch, args, message):
    """Each of these was a traceback (ZeroDivisionError, OverflowError, UnicodeDecodeError, ...) or a
    silent no-op once the model had loaded."""
    import qtk.runtime.engine as engine_module

    def must_not_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(engine_module, "LLM", must_not_load)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("un caf\xe9 {{ messages }}".encode("latin-1"))
    result = run(*[str(a).format(model=tiny_dir, latin1=latin1, out=tmp_path / "out") for a in args])
    assert result.exit_code == 2, (result.output, result.exception)
    assert message.format(latin1=latin1) in result.stderr


def test_a_dataset_or_model_the_loader_cannot_read(tiny_dir, broken_copy, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("un café crème ".encode("latin-1") * 50)
    result = run("quantize", tiny_dir, "--method", "gptq", "--dataset", latin1, "--seq-len", 64, "-o", tmp_path / "out")
    assert "latin1.txt is not UTF-8 text" in error_line(result)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (broken_copy / f).unlink()
    assert "has no tokenizer transformers can read" in error_line(run("quantize", broken_copy, "--method", "rtn",
                                                                      "-o", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_weights_missing_from_the_files_are_refused_not_made_up(broken_copy, tmp_path):
    """A config with more layers than the weight files hold: transformers would fill the rest with
    random numbers and the quantize would succeed on them."""
    cfg = json.loads((broken_copy / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (broken_copy / "config.json").write_text(json.dumps(cfg))
    for name, result in each_command(broken_copy, tmp_path / "out"):
        if name != "inspect":
            assert f"weights the config needs are not in its files, e.g. ['model.layers.{cfg['num_hidden_layers'] - 1}." \
                in error_line(result), name
    assert not (tmp_path / "out").exists()


def test_calibration_samples_longer_than_the_context_are_cut_to_it(tiny_dir, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="qtk"):
        result = run("quantize", tiny_dir, "--method", "gptq", "--num-samples", 2, "--seq-len", 1024, "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert "seq_len 1024 is longer than the model's context (max_position_embeddings 256)" in caplog.text
    assert json.loads((tmp_path / "o" / "qtk_report.json").read_text())["calibration_tokens"] == 2 * 256


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_whole_block_ignored_is_run_but_not_quantized(tiny_dir, tmp_path, method):
    out = tmp_path / "out"
    result = run("quantize", tiny_dir, "--method", method, "--num-samples", 2, "--seq-len", 32,
                 "--ignore", r"re:model\.layers\.1\.", "-o", out)
    assert result.exit_code == 0, result.output
    ignored = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert sum(n.startswith("model.layers.1.") for n in ignored) == 7
    assert not any(n.startswith("model.layers.0.") for n in ignored)
