"""The files qtk ships beside its code, read from the installed package.

    evals/                 the evals' data: gates/{default,ci}.yaml (`qtk eval --gates NAME`),
                           json_prompts.jsonl (the json task's prompt set), lm_eval/ (qtk's local
                           lm-eval tasks)
    calibration/recipes/   the recipes; awq-gptq-w4a16.yaml is `qtk quantize`'s default
    corpus/                the built-in calibration and evaluation text (qtk.data.builtin_texts):
                           CPython 3.11.7's pydoc_data.topics, its documentation of the language's
                           statements and types (PSF License), as JSON compressed with xz; and
                           instructions.json, the templates `--dataset instruct` asks the model

The first two live at the top of the repository, where users read and copy them. qtk/assets/evals and
qtk/assets/recipes are links to them, so a wheel installs them as package data (pyproject.toml,
[tool.setuptools.package-data]) and an editable install or a checkout reads them in place; code
finds them here, through importlib.resources, never by a path into the source tree. qtk is
installed as plain files (never zipped): lm-eval and datasets take these as paths.

The corpus is a copy, not the interpreter's own pydoc_data: that text differs between Python
versions (the bundled model scored perplexity 11.05 on 3.11's evaluation split, 10.95 on 3.12's), so
calibrations and perplexities are comparable across machines only when every one reads the same
text.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

def _shipped(*parts: str) -> Path:
    # resolved through the links: messages name evals/gates/ci.yaml, the file a user can copy
    return Path(str(files(__name__))).joinpath(*parts).resolve()


def eval_data(*parts: str) -> Path:
    """A file or folder of evals/: eval_data("gates", "ci.yaml"), eval_data("lm_eval")."""
    return _shipped("evals", *parts)


def recipe_file(name: str) -> Path:
    """calibration/recipes/NAME.yaml."""
    return _shipped("recipes", f"{name}.yaml")


def corpus_file() -> Path:
    """corpus/: the built-in corpus, {topic name: text}."""
    return _shipped("corpus", "cpython-3.11.7-pydoc-topics.json.xz")


def instructions_file() -> Path:
    """corpus/instructions.json: the instruction templates and their slots (qtk.self_text)."""
    return _shipped("corpus", "instructions.json")
