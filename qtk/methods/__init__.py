"""The methods by name: what `--method NAME` and a recipe's method, weights and smoothing choose.

Per decoder block a smoothing transform runs first (if any), then one weight quantizer. The
recipe (qtk/recipe.py) and the CLI read this table; nothing else lists the methods."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import InputError
from ..schemes import Scheme
from . import autoround, awq, gptq, rtn, smoothquant
from .args import AutoRoundArgs, AWQArgs, GPTQArgs, SmoothQuantArgs

# roles
WEIGHTS = "weights"  # replaces each targeted Linear by a QuantLinear, records block.errors
SMOOTHING = "smoothing"  # rescales float weights in place, folds the inverse into the previous op
FP8 = "fp8"  # round-to-nearest onto an fp8 scheme's grid


@dataclass(frozen=True)
class Method:
    role: str  # WEIGHTS | SMOOTHING | FP8
    run: Callable[..., None]  # fn(block, recipe), once per decoder block
    scheme: str  # --method NAME's default scheme
    weights: str  # the weight quantizer --method NAME runs (after smoothing, --weights may choose another)
    args: type | None = None  # its options: the recipe section named after it
    calibrates: bool = False  # reads calibration data, whatever the scheme
    check: Callable[[Scheme], None] | None = None  # refuses a scheme it cannot quantize (InputError)
    # the block's float outputs on the float model's activations (Block.reference) are computed for it
    float_chain: bool = False


def _weight_only_int(scheme: Scheme) -> None:
    w, act = scheme.weights, scheme.input_activations
    if act is not None or w.type != "int":
        raise InputError("awq protects salient weights of weight-only int schemes (w4a16, w4a16_asym, w8a16); "
                         f"scheme has weights {w.type}{w.num_bits} and activations {act and act.type}")


def _weight_only_int_rounding(scheme: Scheme) -> None:
    w, act = scheme.weights, scheme.input_activations
    if act is not None or w.type != "int" or w.strategy not in ("group", "channel"):
        raise InputError("autoround learns the rounding of weight-only int schemes with group or channel scales "
                         f"(w4a16, w4a16_asym, w8a16); scheme has weights {w.type}{w.num_bits} ({w.strategy}) and "
                         f"activations {act and act.type}")


def _quantized_activations(scheme: Scheme) -> None:
    if scheme.input_activations is None:
        raise InputError("smoothquant migrates activation outliers into weights; it needs an activation-quantized "
                         "scheme (w8a8, fp8, fp8_static)")


def _integer_weights(scheme: Scheme) -> None:
    if scheme.weights.type == "float":
        raise InputError("gptq solves for integer weights; use --method fp8 for fp8 schemes")


METHODS = {
    "rtn": Method(WEIGHTS, rtn.quantize_block, "w4a16", "rtn"),
    "gptq": Method(WEIGHTS, gptq.quantize_block, "w4a16", "gptq", GPTQArgs, calibrates=True, check=_integer_weights),
    "autoround": Method(WEIGHTS, autoround.quantize_block, "w4a16", "autoround", AutoRoundArgs, calibrates=True,
                        check=_weight_only_int_rounding, float_chain=True),
    "awq": Method(SMOOTHING, awq.smooth_block, "w4a16_asym", "rtn", AWQArgs, calibrates=True, check=_weight_only_int),
    "smoothquant": Method(SMOOTHING, smoothquant.smooth_block, "w8a8", "rtn", SmoothQuantArgs, calibrates=True,
                          check=_quantized_activations),
    "fp8": Method(FP8, rtn.quantize_block, "fp8", "rtn"),
}


def named(role: str) -> tuple[str, ...]:
    """The methods of one role, in the table's order."""
    return tuple(name for name, m in METHODS.items() if m.role == role)
