"""Writing outputs whole or not at all: each is written under a temporary name beside where it
goes, then renamed into place (a rename within one file system is atomic), so a reader, a second
process or a run cut short (a full disk, Ctrl-C, a crash) never sees half of one.

    write_file(path, data)             one file
    with write_dir(target) as tmp:     a folder, filled in tmp, then renamed to target
    with write_files(folder) as tmp:   several files, renamed into an existing folder once all are written
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path


def write_file(path: Path, data: str | bytes) -> None:
    """The file whole or not at all: written beside it, then renamed over it (its folder is made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    finally:  # a write cut short leaves no temporary file behind
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def write_dir(target: Path, replace: bool = True) -> Iterator[Path]:
    """A fresh folder beside `target` for the block to fill; when the block ends, it becomes
    `target`, whole. With `replace`, an existing target (a folder, a file or a link) is moved
    aside first and removed after; without, the rename fails with an OSError where a non-empty
    target appeared meanwhile. On any error the new folder is removed, a moved-aside target is put
    back, and the parent folders this call made are removed again: a failure loses nothing."""
    made = list(itertools.takewhile(lambda d: not d.exists(), (target.parent, *target.parent.parents)))
    tmp = aside = None  # the new folder while written; a fresh folder the replaced target is moved into
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make the output private
        yield tmp
        if replace and target.exists():  # a unique name: one left behind by a killed run cannot be in the way
            aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            os.replace(target, aside / target.name)
        os.replace(tmp, target)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not target.exists():
            os.replace(aside / target.name, target)
        _remove_empty([aside, *made])  # deepest first
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def write_files(folder: Path, names: Sequence[str]) -> Iterator[Path]:
    """A temporary folder inside `folder` for the block to write files named `names` into; when
    the block ends, each is renamed into `folder` in the order of `names`, and those of `names`
    the block did not write are removed from `folder`. On an error nothing in `folder` changes.
    Other files in `folder` are left alone."""
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder))
    try:
        yield staging
        for name in names:
            if (staging / name).exists():
                os.replace(staging / name, folder / name)
            else:
                (folder / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_empty(folders: list[Path | None]) -> None:
    """Remove the folders a failed write made, deepest first; one something else wrote into stays."""
    for d in folders:
        if d is not None and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
