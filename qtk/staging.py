"""A streamed quantize's progress on disk, so that an interrupted run (killed, out of memory, Ctrl-C,
a preempted machine) continues at the block after the last one it finished (`--resume`).

    <the output's folder>/.<output name>.qtk-staging/
        run.json                 what the run is: the model (its folder, its files' sizes and times), the
                                 recipe, the checkpoint's dtype, qtk's version; a resume must match it
        ids.pt                   the calibration token ids (a resume reads them: self-written text is
                                 not written again)
        block-00003.safetensors  each finished block's tensors, as the checkpoint stores them
        state.pt                 after the last finished block: the next block's index and inputs (and
                                 the float model's, for AutoRound), the report so far, the finished
                                 blocks' quantized layers
        progress.json            how many blocks are finished (what the messages say)

The finished checkpoint is still written whole into the output at the end (atomic.write_dir), and
the staging folder removed. A run that fails before finishing a block leaves nothing.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
from pathlib import Path

import torch

from .errors import InputError


class Staging:
    def __init__(self, output: Path):
        self.output = Path(output)
        self.folder = self.output.parent / f".{self.output.name}.qtk-staging"

    def exists(self) -> bool:
        return (self.folder / "run.json").is_file()

    def finished(self) -> int:
        """How many blocks the interrupted run finished."""
        progress = self.folder / "progress.json"
        return json.loads(progress.read_text())["finished"] if progress.is_file() else 0

    def check_start(self, resume: bool, force: bool) -> None:
        """Before any work: a run left here is continued only with --resume, replaced only with --force;
        --resume with nothing to continue is refused."""
        if self.exists() and not resume:
            if force:
                self.remove()
                return
            raise InputError(f"an interrupted qtk quantize into {self.output} left {self.finished()} finished "
                             f"blocks in {self.folder}: pass --resume to continue it, or --force to start over")
        if resume and not self.exists():
            raise InputError(f"--resume: no interrupted run into {self.output} to continue ({self.folder} does not "
                             "exist); run without --resume")

    def begin(self, run: dict, ids: torch.Tensor | None) -> None:
        """A fresh staging folder for the run described by `run` (JSON-able) on `ids`."""
        self.remove()
        self.made = list(itertools.takewhile(lambda d: not d.exists(), self.folder.parents))  # removed with it
        self.folder.mkdir(parents=True)
        torch.save(ids, self.folder / "ids.pt")
        _write_json(self.folder / "run.json", run)

    def reopen(self, run: dict) -> torch.Tensor | None:
        """The interrupted run's calibration ids, once its run.json matches `run` (else refused)."""
        saved = json.loads((self.folder / "run.json").read_text())
        differ = sorted(k for k in run.keys() | saved.keys() if run.get(k) != saved.get(k))
        if differ:
            raise InputError(f"--resume: the run in {self.folder} was of another {' and '.join(differ)}; give the "
                             "same model and recipe, or pass --force without --resume to start over")
        return torch.load(self.folder / "ids.pt", weights_only=False)

    def block_file(self, i: int) -> Path:
        return self.folder / f"block-{i:05d}.safetensors"

    def save(self, carry: dict, blocks: dict[int, dict]) -> None:
        """The state after a finished block (replacing the last one whole): what the next block needs
        (`carry`), and the finished blocks' quantized layers."""
        tmp = self.folder / "state.pt.tmp"
        torch.save({"carry": carry, "blocks": blocks}, tmp)
        os.replace(tmp, self.folder / "state.pt")
        _write_json(self.folder / "progress.json", {"finished": len(blocks)})

    def load(self) -> dict | None:
        state = self.folder / "state.pt"
        # memory-mapped: activations larger than memory (spill.py) are paged in as the blocks read them
        return torch.load(state, weights_only=False, mmap=True) if state.is_file() else None

    def remove(self) -> None:
        """The staging folder and the empty folders begin() made for it."""
        shutil.rmtree(self.folder, ignore_errors=True)
        for d in getattr(self, "made", ()):  # deepest first
            with contextlib.suppress(OSError):
                d.rmdir()
        self.made = []


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
