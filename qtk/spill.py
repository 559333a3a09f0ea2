"""Calibration activations that do not fit in memory wait on disk between blocks.

The block-by-block driver keeps the hidden state of every calibration sample entering the next
block: samples x seq_len x hidden_size in the calibration dtype, twice while a block runs (its
inputs and its outputs), and twice more for a method that also follows the float model's own
activations (AutoRound). For a 70B model (hidden 8192) on 512 samples of 2048 tokens in bf16 that
is 17 GB at a time, more than the one block (1.7 GB) the streaming driver holds.

Where they do not fit (more than half the memory available when the run starts, or
`calibration.activations: disk`), each batch's tensor is written to a file in a folder beside the
output and read back memory-mapped, the file unlinked at once: the kernel pages a batch in while
a block reads it and can drop it again, resident memory holds about the batch being computed, and
the disk space is returned when the tensor is freed (at the latest when the process ends, however
it ends). The folder itself is removed when the run ends.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PLACES = ("auto", "memory", "disk")
SHARE_OF_AVAILABLE = 0.5  # auto: to disk above this share of the memory available


def activation_bytes(samples: int, seq_len: int, hidden_size: int, dtype: torch.dtype, float_chain: bool) -> int:
    """The most calibration activations held at once: inputs and outputs of a block (and the float
    model's two, for a method that follows them)."""
    return samples * seq_len * hidden_size * dtype.itemsize * 2 * (2 if float_chain else 1)


class Activations:
    """Where the calibration activations wait between blocks: kept as they are, or (`folder` given)
    each one written there and memory-mapped back."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder
        self.written = 0  # bytes
        self._names = itertools.count()
        self._made: list[Path] = []

    @classmethod
    def choose(cls, place: str, need: int, folder: Path, available: int | None) -> Activations:
        """`place` (PLACES) for activations of `need` bytes: disk at `folder` when asked, or when auto
        finds them over SHARE_OF_AVAILABLE of the `available` bytes of memory (None: unknown, kept in
        memory); the log says which and why."""
        spill = place == "disk" or (place == "auto" and available is not None and need > SHARE_OF_AVAILABLE * available)
        if not spill:
            return cls()
        why = "calibration.activations: disk" if place == "disk" else \
            f"more than {SHARE_OF_AVAILABLE:.0%} of the {available / 2**30:.1f} GiB of memory available"
        log.info("calibration activations: up to %.2f GiB at a time, kept on disk in %s (%s)", need / 2**30, folder, why)
        return cls(folder)

    @property
    def on_disk(self) -> bool:
        return self.folder is not None

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """t (on the CPU), or on disk: the same values memory-mapped from a file nothing else names."""
        if self.folder is None:
            return t
        if not self.folder.exists():
            self._made = [d for d in (self.folder, *self.folder.parents) if not d.exists()]  # removed by close
            self.folder.mkdir(parents=True)
        path = self.folder / f"{next(self._names):08d}.pt"
        torch.save(t.contiguous(), path)
        self.written += t.numel() * t.element_size()
        kept = torch.load(path, mmap=True, weights_only=True)
        path.unlink()  # the mapping keeps the data; the space is returned when the tensor is freed
        return kept

    def close(self) -> None:
        """Remove the folder, and the empty folders made for it (what a file still maps stays
        readable until freed)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        for d in self._made[1:]:  # deepest first
            with contextlib.suppress(OSError):
                d.rmdir()
        self._made = []
