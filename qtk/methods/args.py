"""Each method's options: a recipe's sections (`gptq:`, `awq:`, `smoothquant:` in its YAML), frozen
dataclasses validated at construction. qtk.methods.METHODS names each method's section."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import InputError

_TYPES = {  # annotation -> (check, what it must be)
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def check_types(args, section: str) -> None:
    """Each field of a recipe section holds its annotated type (YAML can put a string, a list or a
    float anywhere): an int field an int (never a bool), a float field a number, a bool a bool."""
    for f in dataclasses.fields(args):
        check, what = _TYPES.get(f.type, (None, None))
        value = getattr(args, f.name)
        if check is not None and not check(value):
            raise InputError(f"{section}.{f.name} must be {what}, got {value!r}")


@dataclass(frozen=True)
class GPTQArgs:
    dampening: float = 0.01  # fraction of mean(diag(H)) added to the diagonal
    block_size: int = 128  # lazy-batch width of the column solve
    act_order: bool = True  # "static": solve columns by descending diag(H), groups stay in order (llm-compressor's default)
    mse_clip: bool = False  # search each group's clipping range by MSE before the solve

    def __post_init__(self):
        check_types(self, "gptq")
        if not 0 < self.dampening < 1:
            raise InputError(f"gptq.dampening must be in (0, 1), got {self.dampening}")
        if self.block_size <= 0:
            raise InputError(f"gptq.block_size must be positive, got {self.block_size}")


@dataclass(frozen=True)
class AWQArgs:
    grid: int = 20  # points of the ratio grid r in [0, 1)
    duo_scaling: bool = True  # s = x_mean^r / w_mean^(1-r) rather than x_mean^r
    clip: bool = True  # weight-clipping search after scaling
    # the attention / mlp losses (a forward per ratio) are tried at every coarse-th ratio first, then
    # at the ratios around the best of those; 1 = every ratio (the gram losses always try every one)
    coarse: int = 4

    def __post_init__(self):
        check_types(self, "awq")
        if self.grid < 1:
            raise InputError(f"awq.grid must be >= 1, got {self.grid}")
        if self.coarse < 1:
            raise InputError(f"awq.coarse must be >= 1 (1 = try every ratio), got {self.coarse}")


@dataclass(frozen=True)
class SmoothQuantArgs:
    alpha: float = 0.5  # migration strength

    def __post_init__(self):
        check_types(self, "smoothquant")
        if not 0 <= self.alpha <= 1:
            raise InputError(f"smoothquant.alpha must be in [0, 1], got {self.alpha}")


@dataclass(frozen=True)
class AutoRoundArgs:
    iters: int = 200  # signed-gradient steps per block, one calibration batch each (auto-round's default)
    lr: float | None = None  # step size of the rounding offsets (None: 1 / iters), decaying linearly to 0
    minmax_lr: float | None = None  # step size of the clipping scales (None: lr)

    def __post_init__(self):
        check_types(self, "autoround")
        if self.iters < 1:
            raise InputError(f"autoround.iters must be >= 1, got {self.iters}")
        for name in ("lr", "minmax_lr"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise InputError(f"autoround.{name} must be a positive number (or left out), got {value!r}")


@dataclass(frozen=True)
class DistillArgs:
    """The recipe's `distill:` section: the scales trained end to end against the float model after
    the block-wise methods (qtk/distill.py). samples 0: not run."""
    samples: int = 0  # calibration samples, one optimizer step each (one pass)
    lr: float = 1e-3  # Adam's step on each scale's log ratio to its block-wise value, cosine-decayed to 0

    def __post_init__(self):
        check_types(self, "distill")
        if self.samples < 0:
            raise InputError(f"distill.samples must be >= 0 (0: no distillation), got {self.samples}")
        if not self.lr > 0:
            raise InputError(f"distill.lr must be positive, got {self.lr}")
