"""The packages a command needs beyond qtk's core, checked before any model runs.

qtk imports some packages only where an argument asks for them: lm-eval for lm-eval tasks,
jsonschema (and llguidance, constrained) for the json task, gguf to read a GGUF, datasets for an
hf:NAME dataset, fastapi, uvicorn and prometheus-client for serve, httpx for bench serve,
matplotlib for a report's pictures, triton for the CUDA kernels. An environment can lack one (an
install without an extra, `pip install --no-deps`, a package removed since). Each command passes
what its arguments need (an eval task's are in qtk/evals/tasks.py) to `require` first thing: a
missing package is MissingPackage, a QtkError (one line, exit 2), naming the package and the pip
command that installs it, read from qtk's own requirements (pyproject.toml): `pip install
'qtk[EXTRA]'` for an extra's package, the requirement itself for one every install has. Unchecked,
it was a ModuleNotFoundError traceback and exit 1 (what tells CI "quality regressed"), after a
baseline had run for minutes.

A need is {import name: what asks for it}, e.g. {"lm_eval": "gate lm_eval_mc (lm-eval:qtk_mc)"}.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex

from .errors import QtkError
from .paths import BUNDLED

# import name -> pip name, for every package qtk imports only where a command or option asks
PACKAGES = {"lm_eval": "lm-eval", "jsonschema": "jsonschema", "llguidance": "llguidance", "gguf": "gguf",
            "datasets": "datasets", "fastapi": "fastapi", "uvicorn": "uvicorn",
            "prometheus_client": "prometheus-client", "httpx": "httpx", "matplotlib": "matplotlib",
            "triton": "triton"}

SERVE = {"fastapi": "qtk serve", "uvicorn": "qtk serve", "prometheus_client": "qtk serve (/metrics)",
         "llguidance": "qtk serve (structured outputs)"}
BENCH_SERVE = {"httpx": "qtk bench serve"}
REPORT = {"matplotlib": "--report (its pictures)"}


class MissingPackage(QtkError, ModuleNotFoundError):
    """A package that what was asked needs is not installed."""


def require(*needs: dict[str, str]) -> None:
    """Raise MissingPackage for every module of `needs` this Python cannot import, in one line."""
    asked = {module: why for need in needs for module, why in need.items()}
    missing = {module: why for module, why in asked.items() if not _importable(module)}
    if missing:
        raise MissingPackage(_message(missing))


def model_needs(*models: str) -> dict[str, str]:
    """gguf for a MODEL that is a GGUF: a .gguf file, or the bundled model (converted on first use)."""
    return {"gguf": f"MODEL {m} (a GGUF)" for m in models if m == BUNDLED or m.endswith(".gguf")}


def dataset_needs(dataset: str | None, flag: str) -> dict[str, str]:
    """datasets for a Hugging Face dataset, hf:NAME."""
    return {"datasets": f"{flag} {dataset}"} if any(part.startswith("hf:") for part in str(dataset).split("+")) else {}


def explain(error: ModuleNotFoundError) -> MissingPackage | None:
    """A ModuleNotFoundError for one of PACKAGES (one a command's needs did not foresee) as a
    MissingPackage; None for anything else (a bug keeps its traceback)."""
    module = (error.name or "").split(".")[0]
    return MissingPackage(_message({module: "this command"})) if module in PACKAGES else None


def install_hint(package: str, requirements: list[str] | None = None) -> str:
    """What to pip install for `package`: qtk's own requirement of it ('lm-eval>=0.4.13'), else the
    extra that has it ('qtk[dev]'), else the package. `requirements`: qtk's (from its metadata)."""
    if requirements is None:
        try:
            requirements = importlib.metadata.requires("qtk") or []
        except importlib.metadata.PackageNotFoundError:  # a checkout run in place, not installed
            requirements = []
    extras = []
    for req in requirements:
        spec, _, marker = req.partition(";")
        name = re.match(r"\s*([A-Za-z0-9._-]+)", spec)
        if name is None or _normal(name.group(1)) != _normal(package):
            continue
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
        if extra is None:
            return spec.strip()
        extras.append(extra.group(1))
    return f"qtk[{extras[0]}]" if extras else package


def _message(missing: dict[str, str]) -> str:
    by_why: dict[str, list[str]] = {}
    for module, why in missing.items():
        by_why.setdefault(why, []).append(PACKAGES.get(module, module))
    asks = "; ".join(f"{why} needs {', '.join(names)}" for why, names in by_why.items())
    specs = dict.fromkeys(install_hint(PACKAGES.get(m, m)) for m in missing)
    return (f"{asks}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"pip install {' '.join(shlex.quote(s) for s in specs)}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses the name; a module whose __spec__ is None
        return False


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
