"""The `qtk` command through click's CliRunner, on the tiny HF dir."""
from __future__ import annotations

import json
import re

import click
import pytest
import torch
from click.testing import CliRunner

from qtk.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def quantized(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny-w4"
    result = run("quantize", tiny_dir, "--method", "rtn", "--scheme", "w4a16", "--group-size", 32, "--output", out)
    return out, result


def test_quantize(quantized):
    out, result = quantized
    assert result.exit_code == 0, result.output
    assert re.fullmatch(rf"wrote {re.escape(str(out))} \(rtn, 14 layers, 0 calibration tokens, [0-9.]+ s quantize, "
                        r"[0-9.]+ s total\)\n", result.stdout)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32


def test_quantize_with_calibration_flags(tiny_dir, tmp_path):
    f = tmp_path / "calib.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "kv"
    result = run("quantize", tiny_dir, "--method", "fp8", "--scheme", "fp8_static", "--kv-cache", "fp8",
                 "--kv-strategy", "head", "--dataset", f, "--num-samples", 3, "--seq-len", 32, "--batch-size", 2,
                 "--seed", 5, "-o", out)
    assert result.exit_code == 0, result.output
    assert "(fp8, 14 layers, 96 calibration tokens," in result.stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "attn_head" and qc["format"] == "float-quantized"
    recipe = (out / "recipe.yaml").read_text()
    assert "num_samples: 3" in recipe and "seq_len: 32" in recipe and "seed: 5" in recipe
    lines = run("inspect", out).stdout.splitlines()
    assert lines[1] == ("  group_0: float-quantized, weights float8 tensor, activations float8 tensor static, "
                        "targets ['Linear']")
    assert lines[2] == "  kv cache: {'type': 'float', 'strategy': 'attn_head'}"
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines if ln.strip().startswith("model.layers.")}
    # fp8 [64, 64] + one bf16 scale: (4096 + 2) bytes * 8 / 4096 weights
    assert rows["model.layers.0.self_attn.q_proj"][:3] == ["float-quantized", "[1]", "8.004"]
    assert rows["model.layers.0.mlp.down_proj"][:3] == ["float-quantized", "[1]", "8.002"]
    _one_line_error(run("quantize", out, "--method", "rtn", "-o", tmp_path / "again"),
                    rf"{re.escape(str(out))} is already quantized; quantize the original model")


def test_inspect(quantized):
    out, _ = quantized
    result = run("inspect", out)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1] == ("  group_0: pack-quantized, weights int4 group g32, activations float, "
                        "targets ['Linear']")
    assert lines[2] == "  kv cache: float"
    rows = [ln.split() for ln in lines if ln.strip().startswith("model.layers.")]
    assert len(rows) == 14
    q = next(r for r in rows if r[0] == "model.layers.0.self_attn.q_proj")
    # [64, 64] at 4 bits + one bf16 scale per 32 weights = 4.5 bits per weight
    assert q[1:] == ["pack-quantized", "[64,", "2]", "4.500", "0.00"]
    down = next(r for r in rows if r[0] == "model.layers.1.mlp.down_proj")
    assert down[2:5] == ["[64,", "4]", "4.500"]
    size = re.fullmatch(r"  size on disk ([0-9.]+) MiB vs ([0-9.]+) MiB in bf16 \(([0-9.]+)x smaller\)", lines[-1])
    assert size is not None
    info = json.loads(run("inspect", out, "--json").stdout)
    assert len(info["layers"]) == 14 and info["size_bytes"] == (out / "model.safetensors").stat().st_size
    # the tied 49152 x 64 embedding (bf16) dominates both sizes
    assert info["bf16_size_bytes"] > 49152 * 64 * 2 and 1.0 < info["compression"] < 1.2


def test_eval_json(quantized, tmp_path, monkeypatch):
    from qtk.evals.perplexity import eval_windows, perplexity
    from qtk.loading import load_model

    monkeypatch.setenv("QTK_CPU_BF16", "0")  # the float32 products throughout (the checkpoint is bf16)

    out, _ = quantized
    f = tmp_path / "ppl.json"
    result = run("eval", out, "--task", "ppl", "--seq-len", 64, "--limit", 2, "--json", f, "--dtype", "float32")
    assert result.exit_code == 0, result.output
    res = json.loads(f.read_text())
    assert (res["task"], res["scored_tokens"], res["windows"], res["seq_len"]) == ("ppl", 126, 2, 64)
    model, tok = load_model(str(out))
    expect = perplexity(model, eval_windows(tok, "builtin", 64, 2), progress=False)
    assert res["ppl"] == pytest.approx(expect.ppl, rel=1e-6)
    assert 40_000 < res["ppl"] < 60_000  # a random model over a 49152-token vocab
    assert f"ppl {res['ppl']:.4f} on builtin (2 windows x 64 tokens, 126 scored)" in result.stdout


def test_generate(quantized):
    from qtk.loading import load_model

    out, _ = quantized
    result = run("generate", out, "--prompt", "hi", "--max-tokens", 4, "--dtype", "float32")
    assert result.exit_code == 0, result.output
    model, tok = load_model(str(out))
    ids = tok("hi", return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    assert len(new) == 4
    assert result.stdout == tok.decode(new, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("command", ["quantize", "inspect", "eval", "generate"])
def test_help_mentions_every_option(command):
    result = run(command, "--help")
    assert result.exit_code == 0
    cmd = main.commands[command]
    for param in cmd.params:
        if isinstance(param, click.Option):
            for opt in param.opts:
                assert opt in result.stdout, f"{command} --help does not mention {opt}"
            assert param.help, f"{command} {param.opts[0]} has no help text"


def _one_line_error(result, pattern, after_load=False):
    """Exit 2, nothing on stdout, one line on stderr (after transformers' loading bar if the
    error comes once the model is loaded)."""
    assert result.exit_code == 2
    assert result.stdout == ""
    err = result.stderr.rpartition("\r")[2] if after_load else result.stderr
    assert re.fullmatch(rf"(Loading weights.*\n)?error: {pattern}\n" if after_load else rf"error: {pattern}\n", err), \
        result.stderr


def test_missing_model_path(tmp_path):
    result = run("quantize", tmp_path / "nope", "--method", "rtn", "-o", tmp_path / "out")
    _one_line_error(result, rf"model '{re.escape(str(tmp_path / 'nope'))}' not found: give an HF model directory, "
                            r"a \.gguf file or 'smollm2-135m'")
    assert not (tmp_path / "out").exists()
    _one_line_error(run("inspect", tmp_path / "nope"), r"model .* not found: .*")
    _one_line_error(run("eval", tmp_path / "nope"), r"model .* not found: .*")


def test_existing_output_without_force(quantized, tiny_dir):
    out, _ = quantized
    before = (out / "model.safetensors").stat().st_mtime_ns
    result = run("quantize", tiny_dir, "--method", "rtn", "--group-size", 32, "-o", out)
    _one_line_error(result, rf"output {re.escape(str(out))} exists; pass --force to replace it")
    assert (out / "model.safetensors").stat().st_mtime_ns == before


def test_unknown_scheme_and_bad_values(tiny_dir, tmp_path):
    out = tmp_path / "out"
    _one_line_error(run("quantize", tiny_dir, "--method", "rtn", "--scheme", "w5a16", "-o", out),
                    r"unknown scheme 'w5a16'; choose one of \[.*\]")
    _one_line_error(run("quantize", tiny_dir, "--method", "rtn", "--group-size", 48, "-o", out),
                    r"group size 48 does not divide .*; use --group-size 64", after_load=True)
    _one_line_error(run("quantize", tiny_dir, "--method", "awq", "--scheme", "w8a8", "-o", out),
                    r"awq protects salient weights .*")
    _one_line_error(run("quantize", tiny_dir, "--method", "rtn", "--num-samples", 0, "-o", out),
                    r"calibration.num_samples must be positive, got 0")
    assert not out.exists()
    # click's own usage errors also exit 2, with click's usage text
    result = run("quantize", tiny_dir, "--method", "bogus", "-o", out)
    assert result.exit_code == 2 and "Invalid value for '--method'" in result.stderr
    result = run("quantize", tiny_dir, "--method", "rtn")
    assert result.exit_code == 2 and "Missing option '--output'" in result.stderr


def test_inspect_unquantized_source(tiny_dir):
    result = run("inspect", tiny_dir)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1:3] == ["  not quantized", "  kv cache: float"]
    assert re.fullmatch(r"  size on disk [0-9.]+ MiB vs [0-9.]+ MiB in bf16 \(0\.50x smaller\)", lines[-1])  # fp32 on disk


def test_inspect_a_gguf_says_it_shows_the_conversion(bundled_dir):
    """A Q4_1 GGUF is inspected as qtk runs it (its bf16 conversion), and says so with the file's size."""
    from qtk.loading import bundled_gguf

    result = run("inspect", "smollm2-135m")
    assert result.exit_code == 0, result.output
    gguf = bundled_gguf()
    assert result.stdout.splitlines()[1] == (f"  bf16 conversion of {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB in "
                                             "GGUF's own quantization); what follows describes the conversion")
    info = json.loads(run("inspect", "smollm2-135m", "--json").stdout)
    assert info["gguf"] == {"path": str(gguf), "size_bytes": gguf.stat().st_size} and info["path"] == str(bundled_dir)


def test_generate_chat(quantized):
    out, _ = quantized
    result = run("generate", out, "--prompt", "hi", "--max-tokens", 3, "--chat")
    assert result.exit_code == 0, result.output
    from qtk.generate import generate

    assert result.stdout == generate(str(out), "hi", max_tokens=3, chat=True) + "\n"
    # the transformers referee, in float32 through the chat template
    from qtk.loading import load_model

    model, tok = load_model(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    assert generate(str(out), "hi", max_tokens=3, chat=True, dtype="float32") == tok.decode(new, skip_special_tokens=True)
    _one_line_error(run("generate", out, "--prompt", "hi", "--max-tokens", 0), r"--max-tokens must be positive, got 0")


def test_generate_chat_without_a_template_says_drop_chat(tiny_dir, tmp_path):
    """The CLI's wording (--chat), not the runtime API's (LLM.generate)."""
    import shutil

    plain = tmp_path / "no-template"
    shutil.copytree(tiny_dir, plain, ignore=shutil.ignore_patterns("chat_template.jinja"))
    small = ["--max-tokens", 2, "--max-model-len", 64, "--kv-cache-memory", 2**21]
    _one_line_error(run("generate", plain, "--prompt", "hi", "--chat", *small),
                    rf"{re.escape(str(plain))} has no chat template: drop --chat to generate from the prompt as "
                    r"written", after_load=True)
    assert run("generate", plain, "--prompt", "hi", *small).exit_code == 0


def test_serve_tool_flags_go_together(tiny_dir):
    for flags in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        result = run("serve", tiny_dir, *flags)
        assert result.exit_code == 2 and "go together" in result.stderr, result.stderr
    result = run("serve", tiny_dir, "--tool-call-parser", "nope")
    assert result.exit_code == 2 and "hermes" in result.stderr


def test_serve_chat_template_must_be_a_file_or_a_template(tiny_dir, tmp_path, monkeypatch):
    result = run("serve", tiny_dir, "--chat-template", tmp_path / "missing.jinja")
    assert result.exit_code == 2 and "neither a file nor a Jinja template" in result.stderr, result.stderr
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    result = run("serve", tiny_dir, "--chat-template", bad)
    assert result.exit_code == 2 and "line 1" in result.stderr, result.stderr

    import qtk.runtime.engine as engine_module

    reached = []

    def engine_stub(*args, **kwargs):  # the template passed its check: stop before loading a model
        reached.append(True)
        raise SystemExit(0)

    monkeypatch.setattr(engine_module, "LLM", engine_stub)
    long_inline = ("{% for m in messages %}{% if loop.index > 9 %}{% break %}{% endif %}" + "x" * 300 +
                   "{{ m.content }}{% endfor %}")  # no file name (too long), and transformers' loop controls
    result = CliRunner().invoke(main, ["serve", str(tiny_dir), "--chat-template", long_inline])
    assert reached == [True], result.output


def test_engine_flags_are_engine_config_fields_with_its_defaults():
    """`qtk generate` and `qtk serve` build an EngineConfig from their engine flags: each flag is a
    field of it, defaulting to the field's default."""
    from dataclasses import fields

    from qtk.cli import engine_options
    from qtk.errors import InputError
    from qtk.runtime.config import EngineConfig

    defaults = {f.name: f.default for f in fields(EngineConfig)}
    params = engine_options(lambda **kw: None).__click_params__
    assert {p.name for p in params} == set(defaults) - {"model", "max_logprobs"}
    assert all(p.default == defaults[p.name] for p in params)
    with pytest.raises(InputError, match="gpu_memory_utilization must be in"):
        EngineConfig("m", gpu_memory_utilization=1.5)
