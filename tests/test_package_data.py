"""The files qtk ships (evals/, calibration/recipes/, the CPU kernels' sources) are read from the package, and a
wheel carries them."""
import fnmatch
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qtk import assets, recipe as rec
from qtk.evals.gates import load_gates
from qtk.evals.json_validity import load_prompts
from qtk.evals.lm_eval_adapter import TASKS_DIR

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {"evals": ROOT / "evals", "recipes": ROOT / "calibration" / "recipes"}  # qtk/assets/NAME -> folder


def _shipped_files() -> list[str]:
    """Every file of evals/ and calibration/recipes/, as qtk/assets/ names it."""
    return sorted(f"{name}/{f.relative_to(folder).as_posix()}" for name, folder in SHIPPED.items()
                  for f in folder.rglob("*") if f.is_file() and "__pycache__" not in f.parts)


def test_assets_are_the_top_level_files():
    assert assets.eval_data("gates", "default.yaml") == ROOT / "evals" / "gates" / "default.yaml"
    assert assets.recipe_file("awq-gptq-w4a16") == ROOT / "calibration" / "recipes" / "awq-gptq-w4a16.yaml"
    assert TASKS_DIR == ROOT / "evals" / "lm_eval"
    assert load_gates("ci").path == str(ROOT / "evals" / "gates" / "ci.yaml")
    assert len(load_prompts()) == 120


def test_default_recipe_is_read_from_the_package():
    assert rec.build() == rec.build(recipe_file=str(assets.recipe_file(rec.DEFAULT_RECIPE)))


def test_every_shipped_file_is_package_data():
    """A file added to evals/ or calibration/recipes/ that pyproject's package-data globs miss would
    be absent from a wheel install."""
    tomllib = pytest.importorskip("tomllib")
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["qtk.assets"]
    missed = [f for f in _shipped_files() if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/")
                                                     for g in globs)]
    assert not missed, f"not in [tool.setuptools.package-data] qtk.assets: {missed}"


@pytest.mark.slow
def test_wheel_carries_the_shipped_files(tmp_path):
    """`pip wheel .` (setuptools follows qtk/assets' links): the evals' data and the recipes as qtk.assets' files.
    Built from a copy of what the wheel reads (the links kept), so no build/ or egg-info lands in the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "qtk", "evals", "calibration"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("qtk-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"qtk/assets/{f}" for f in _shipped_files()} <= names
    assert f"qtk/assets/corpus/{assets.corpus_file().name}" in names  # the built-in corpus
    from qtk.kernels import cpu

    assert {f"qtk/kernels/csrc/{p.name}" for p in cpu.SOURCES} <= names  # the C++ kernels' sources and header
    assert not any(n.startswith(("evals/", "calibration/")) for n in names)
