"""A package a command needs but cannot import: one line naming it and how to install it, exit 2,
before any model runs (qtk/optional.py). Every command runs in a fresh Python with the package
hidden (None in sys.modules: `import X` raises ModuleNotFoundError, find_spec answers None)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from qtk import optional
from qtk.cli import main

ROOT = Path(__file__).resolve().parents[1]
HIDDEN_RUN = """
import sys
for name in sys.argv.pop(1).split(","):
    sys.modules[name] = None
from qtk.cli import main
sys.argv[0] = "qtk"
main()
"""
PIP = r"pip install \S+( \S+)*"  # what the message says to run (qtk's requirement, read from its metadata)


def qtk_without(hidden: str, *args) -> subprocess.CompletedProcess:
    """`qtk ARGS` in a fresh Python (this checkout's qtk) that cannot import the `hidden` modules."""
    return subprocess.run([sys.executable, "-c", HIDDEN_RUN, hidden, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _one_line(proc: subprocess.CompletedProcess, pattern: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    assert re.fullmatch(rf"error: {pattern}, which (is|are) not installed: {PIP}\n", proc.stderr), proc.stderr


MISSING = "/nonexistent/model"  # a model the command never reaches: the check comes first


@pytest.mark.parametrize("hidden, args, pattern", [
    ("gguf", ["quantize", "smollm2-135m", "-o", "{tmp}/q"], r"MODEL smollm2-135m \(a GGUF\) needs gguf"),
    ("datasets", ["quantize", MISSING, "--method", "gptq", "--dataset", "hf:wikitext", "-o", "{tmp}/q"],
     r"--dataset hf:wikitext needs datasets"),
    ("gguf", ["inspect", "{tmp}/model.gguf"], r"MODEL \S+/model.gguf \(a GGUF\) needs gguf"),
    ("lm_eval", ["eval", MISSING, "--task", "lm-eval:qtk_mc"], r"--task lm-eval:qtk_mc needs lm-eval"),
    ("jsonschema,llguidance", ["eval", MISSING, "--task", "json"],
     r"--task json needs jsonschema; --task json, constrained needs llguidance"),
    ("datasets", ["eval", MISSING, "--task", "ppl", "--dataset", "hf:wikitext"],
     r"--task ppl: dataset hf:wikitext needs datasets"),
    ("lm_eval", ["eval", MISSING, "--baseline", MISSING, "--gates", "default"],
     r"gate lm_eval_mc \(lm-eval:qtk_mc,qtk_gen,qtk_paragraphs\) needs lm-eval"),
    ("llguidance", ["eval", MISSING, "--baseline", MISSING, "--gates", "ci"],
     r"gate json_constrained \(json\), constrained needs llguidance"),
    ("matplotlib", ["eval", MISSING, "--baseline", MISSING, "--gates", "ci", "--report", "{tmp}/report"],
     r"--report \(its pictures\) needs matplotlib"),
    ("gguf", ["generate", "smollm2-135m", "--prompt", "Hi"], r"MODEL smollm2-135m \(a GGUF\) needs gguf"),
    ("fastapi,uvicorn", ["serve", MISSING], r"qtk serve needs fastapi, uvicorn"),
    ("llguidance", ["serve", MISSING], r"qtk serve \(structured outputs\) needs llguidance"),
    ("gguf", ["bench", "engine", "smollm2-135m"], r"MODEL smollm2-135m \(a GGUF\) needs gguf"),
    ("httpx", ["bench", "serve"], r"qtk bench serve needs httpx"),
    ("triton", ["bench", "kernels", "--device", "cuda"], r"qtk bench kernels --device cuda needs triton"),
])
def test_every_command_names_the_missing_package(tmp_path, hidden, args, pattern):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    proc = qtk_without(hidden, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    _one_line(proc, pattern)
    assert not (tmp_path / "q").exists() and not (tmp_path / "report").exists()


def test_the_hint_is_qtks_own_requirement():
    reqs = ["torch>=2.4", "lm-eval>=0.4.13", 'pytest>=8; extra == "dev"', 'lm-eval[api]>=0.4.13; extra == "dev"']
    assert optional.install_hint("lm-eval", reqs) == "lm-eval>=0.4.13"  # every install has it
    assert optional.install_hint("lm_eval", reqs) == "lm-eval>=0.4.13"  # names compare normalized
    assert optional.install_hint("pytest", reqs) == "qtk[dev]"  # an extra has it
    assert optional.install_hint("vllm", reqs) == "vllm"


def test_pyproject_requires_what_the_default_gates_run():
    """lm-eval and jsonschema are base requirements: `pip install qtk` then `--gates default` runs."""
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9._-]+", d).group().lower() for d in deps}
    assert {"lm-eval", "jsonschema", "llguidance", "gguf"} <= names


@pytest.mark.parametrize("name, exit_code", [("llguidance", 2), ("llguidance.torch", 2), ("no_such_module", None)])
def test_an_unforeseen_missing_package_is_one_line_too(monkeypatch, name, exit_code):
    """A ModuleNotFoundError that escapes a command: one line and exit 2 for a package of
    optional.PACKAGES; anything else (a bug) keeps its traceback."""
    def inspect_checkpoint(model):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr("qtk.inspect.inspect_checkpoint", inspect_checkpoint)
    if exit_code is None:
        with pytest.raises(ModuleNotFoundError):
            CliRunner().invoke(main, ["inspect", MISSING], catch_exceptions=False)
        return
    result = CliRunner().invoke(main, ["inspect", MISSING], catch_exceptions=False)
    assert result.exit_code == 2 and result.stdout == ""
    assert re.fullmatch(rf"error: this command needs llguidance, which is not installed: {PIP}\n", result.stderr)
