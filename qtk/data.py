"""Calibration and evaluation text: the built-in corpus, local .txt/.jsonl files, HF datasets.

The built-in corpus is CPython's own documentation (pydoc_data.topics: 79 topics of English
prose), the copy qtk ships (qtk/assets/corpus: Python 3.11.7's), so every machine calibrates and
evaluates on the same text whatever its Python. Topics are split by name into disjoint
calibration and evaluation sets (every 4th topic in sorted order is evaluation), so the two never
overlap.
"""
from __future__ import annotations

import functools
import json
import logging
import types
from pathlib import Path

import torch

from .assets import corpus_file
from .chat_template import has_template, render
from .errors import DataSourceError, InputError, NotFoundError

log = logging.getLogger(__name__)

SPLITS = ("calibration", "evaluation")


@functools.cache
def builtin_topics() -> types.MappingProxyType:
    """The built-in corpus: {topic name: text}, read-only (one copy, shared by every caller)."""
    import lzma  # (here: a Python built without liblzma still imports qtk.data)

    path = corpus_file()
    try:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            return types.MappingProxyType(json.load(f))
    except (OSError, lzma.LZMAError, ValueError) as e:
        raise DataSourceError(f"the built-in corpus {path} could not be read ({e}); reinstall qtk, or give "
                              "--dataset FILE") from e


def builtin_texts(split: str) -> list[str]:
    if split not in SPLITS:
        raise InputError(f"split must be one of {SPLITS}, got {split!r}")
    topics = builtin_topics()
    names = sorted(topics)
    keep = [n for i, n in enumerate(names) if (i % 4 == 0) == (split == "evaluation")]
    return [topics[n] for n in keep]


def read_text(path: Path, what: str = "file") -> str:
    """A text file's contents; InputError when it is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path} is not UTF-8 text (byte {e.start}); convert it, e.g. with iconv") from e


def jsonl_rows(path: Path, what: str = "file") -> list[tuple[int, object]]:
    """(line number, parsed value) for each non-blank line of a JSONL file; NotFoundError naming
    `what` when it is missing, InputError naming the line when one is not JSON."""
    path = Path(path)
    if not path.is_file():
        raise NotFoundError(f"{what} {path} not found")
    rows = []
    for i, line in enumerate(read_text(path, what).splitlines(), 1):
        if line.strip():
            try:
                rows.append((i, json.loads(line)))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{i}: not valid JSON ({e.msg})") from e
    return rows


def file_texts(path: Path, text_key: str = "text") -> list[str]:
    if not path.is_file():
        raise NotFoundError(f"dataset file {path} not found")
    if path.suffix == ".txt":
        return [read_text(path, "dataset file")]
    if path.suffix == ".jsonl":
        texts = []
        for i, row in jsonl_rows(path, "dataset file"):
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                raise InputError(f"{path}:{i}: each line must be a JSON object with a string {text_key!r} field")
            texts.append(row[text_key])
        return texts
    raise InputError(f"dataset file {path} must be .txt or .jsonl")


# the split a hub dataset gives each use: the first one it has (evaluation as lm-eval picks it)
HF_SPLITS = {"calibration": ("train",), "evaluation": ("test", "validation")}


def hf_texts(name: str, split: str, text_key: str = "text") -> list[str]:
    """`hf:NAME[:CONFIG]` via datasets (online users); offline, a clear error."""
    import datasets

    repo, _, config = name.partition(":")
    ds = None
    try:
        have = datasets.get_dataset_split_names(repo, config or None)
        hf_split = next((s for s in HF_SPLITS[split] if s in have), None)
        if hf_split is not None:
            ds = datasets.load_dataset(repo, config or None, split=hf_split)
    except Exception as e:
        raise DataSourceError(f"could not load the Hugging Face dataset {repo!r}: {e}. "
                              "Offline? Use --dataset builtin or a local .txt/.jsonl file") from e
    if ds is None:
        raise InputError(f"dataset {repo!r} has no {' or '.join(HF_SPLITS[split])} split for {split} "
                         f"(its splits: {have}); choose another dataset or a local .txt/.jsonl file")
    log.info("%s text: hf:%s, split %s", split, name, hf_split)
    if text_key not in ds.column_names:
        raise InputError(f"dataset {repo!r} has no {text_key!r} column (columns: {ds.column_names})")
    return [t for t in ds[text_key] if t]


def load_texts(dataset: str, split: str) -> list[str]:
    """Texts of `dataset` (builtin | FILE.txt | FILE.jsonl | hf:NAME) for a split."""
    if dataset == "builtin":
        return builtin_texts(split)
    if dataset in ("self", "instruct") or "+" in dataset and not Path(dataset).is_file():
        raise InputError(f"dataset {dataset!r}: text the model writes itself (self, instruct) and mixes of sources (A+B) "
                         "are for calibration (qtk quantize --dataset); give one dataset here")
    if dataset.startswith("hf:"):
        return hf_texts(dataset[3:], split)
    return file_texts(Path(dataset))


def token_stream(tokenizer, texts: list[str], chat_template: bool = False) -> torch.Tensor:
    """All texts tokenized once and concatenated, separated by EOS ([n] int64)."""
    if chat_template:
        if not has_template(tokenizer):
            raise InputError("--chat-template was given but the tokenizer has no chat template")
        texts = [render(tokenizer, [{"role": "user", "content": t}], add_generation_prompt=False) for t in texts]
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def calibration_ids(tokenizer, dataset: str = "builtin", num_samples: int = 64, seq_len: int = 512,
                    seed: int = 0, chat_template: bool = False) -> torch.Tensor:
    """N samples of L tokens [N, L]: N distinct non-overlapping windows picked with `seed`."""
    stream = token_stream(tokenizer, load_texts(dataset, "calibration"), chat_template)
    windows = len(stream) // seq_len
    if windows < num_samples:
        raise InputError(f"dataset {dataset!r} has {len(stream)} calibration tokens, enough for {windows} "
                         f"samples of {seq_len}; asked for {num_samples} (lower --num-samples or --seq-len)")
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(windows, generator=g)[:num_samples].sort().values
    ids = stream[: windows * seq_len].view(windows, seq_len)[pick]
    log.info("calibration: %d samples x %d tokens = %d tokens from %s (seed %d)",
             num_samples, seq_len, ids.numel(), dataset, seed)
    return ids
