"""Quantization schemes: frozen dataclasses that mirror compressed-tensors' QuantizationArgs.

A `Scheme` says how the weights (and optionally the input activations) of the targeted Linear
layers are quantized; a `KVCacheScheme` says how keys and values are. `to_dict` writes exactly
the keys compressed-tensors accepts, `from_dict` reads everything it may write.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from .errors import InputError

TYPES = ("int", "float")
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
# Keys compressed-tensors (and so vLLM) accepts in a QuantizationArgs dict.
ARG_KEYS = (
    "num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
    "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs",
)


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor is quantized (compressed-tensors QuantizationArgs)."""

    num_bits: int = 8
    type: str = "int"
    symmetric: bool = True
    strategy: str = "channel"
    group_size: int | None = None
    dynamic: bool = False
    actorder: str | None = None
    observer: str | None = None

    def __post_init__(self):
        if self.type not in TYPES:
            raise InputError(f"QuantArgs.type must be one of {TYPES}, got {self.type!r}")
        if self.strategy not in STRATEGIES:
            raise InputError(f"QuantArgs.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.type == "int" and not 1 <= self.num_bits <= 8:
            raise InputError(f"QuantArgs.num_bits must be 1..8 for int, got {self.num_bits}")
        if self.type == "float" and self.num_bits != 8:
            raise InputError(f"QuantArgs.num_bits must be 8 for float (fp8 e4m3), got {self.num_bits}")
        if self.type == "float" and not self.symmetric:
            raise InputError("QuantArgs.symmetric must be true for float (fp8) quantization")
        if self.strategy == "group":
            if not self.group_size or self.group_size <= 0:
                raise InputError(f"QuantArgs.group_size must be a positive integer for strategy 'group', got {self.group_size!r}")
        elif self.group_size not in (None, -1):
            raise InputError(f"QuantArgs.group_size is only valid with strategy 'group' (strategy is {self.strategy!r})")
        if self.strategy == "token" and not self.dynamic:
            raise InputError("QuantArgs.strategy 'token' requires dynamic=True")
        if self.actorder not in (None, "static", "group", "weight"):
            raise InputError(f"QuantArgs.actorder must be null, 'static', 'group' or 'weight', got {self.actorder!r}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def to_dict(self) -> dict:
        return {
            "num_bits": self.num_bits, "type": self.type, "symmetric": self.symmetric,
            "group_size": self.group_size, "strategy": self.strategy, "block_structure": None,
            "dynamic": self.dynamic, "actorder": self.actorder, "observer": self.observer,
            "observer_kwargs": {},
        }

    @classmethod
    def from_dict(cls, d: dict | None) -> QuantArgs | None:
        if d is None:
            return None
        unknown = set(d) - set(ARG_KEYS)
        if unknown:
            raise InputError(f"unknown quantization arg key(s) {sorted(unknown)}; known: {list(ARG_KEYS)}")
        # compressed-tensors' inference when no strategy is written: a group size -1 is per
        # channel, a positive one groups, none is per tensor
        group = d.get("group_size")
        strategy = d.get("strategy") or ("channel" if group == -1 else "group" if group else "tensor")
        if strategy not in ("tensor", "channel", "group", "token", "attn_head"):
            raise InputError(f"quantization strategy {strategy!r} is not supported by qtk "
                             "(supported: tensor, channel, group, token, attn_head)")
        actorder = d.get("actorder")
        return cls(
            num_bits=int(d.get("num_bits", 8)), type=d.get("type", "int"),
            symmetric=bool(d.get("symmetric", True)), strategy=strategy,
            group_size=d.get("group_size") if strategy == "group" else None,
            dynamic=d.get("dynamic") in (True, "true", "local"),
            actorder=actorder if actorder is None else str(actorder).lower(),
            observer=d.get("observer"),
        )


@dataclass(frozen=True)
class Scheme:
    """Weights (+ optional input activations) of the targeted Linear layers."""

    weights: QuantArgs
    input_activations: QuantArgs | None = None
    targets: tuple[str, ...] = ("Linear",)
    stored_format: str | None = None  # the group's "format" when read from a checkpoint

    def __post_init__(self):
        if self.stored_format not in (None, "pack-quantized", "int-quantized", "float-quantized",
                                      "naive-quantized", "mixed-precision"):
            raise InputError(f"format {self.stored_format!r} is not supported (pack-quantized, int-quantized, "
                             "float-quantized, naive-quantized)")
        a = self.input_activations
        if a is not None:
            if a.strategy not in ("tensor", "token"):
                raise InputError(f"input_activations.strategy must be 'tensor' or 'token', got {a.strategy!r}")
            if a.num_bits != 8 or self.weights.num_bits != 8:
                raise InputError("activation quantization is supported for 8-bit weights and activations (W8A8) only")
            if a.type != self.weights.type:
                raise InputError(f"weights are {self.weights.type} but activations {a.type}: W8A8 needs both int or both float")

    @property
    def format(self) -> str:
        """The compressed-tensors format this scheme is stored in (as llm-compressor picks it)."""
        if self.stored_format in ("int-quantized", "float-quantized", "naive-quantized"):
            return "float-quantized" if self.weights.type == "float" else "int-quantized"
        if self.weights.type == "float":
            return "float-quantized"
        if self.input_activations is None:
            return "pack-quantized"
        return "int-quantized"

    def with_group_size(self, group_size: int | None) -> Scheme:
        if group_size is None:
            return self
        if group_size == -1:
            w = dataclasses.replace(self.weights, strategy="channel", group_size=None)
        elif group_size <= 0:
            raise InputError(f"group size must be positive, or -1 for one scale per output channel; got {group_size}")
        else:
            if self.input_activations is not None or self.weights.type == "float":
                raise InputError("--group-size applies to weight-only int schemes (w4a16, w4a16_asym, w8a16)")
            w = dataclasses.replace(self.weights, strategy="group", group_size=group_size)
        return dataclasses.replace(self, weights=w)

    def to_dict(self) -> dict:
        return {
            "targets": list(self.targets),
            "weights": self.weights.to_dict(),
            "input_activations": None if self.input_activations is None else self.input_activations.to_dict(),
            "output_activations": None,
            "format": self.format,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Scheme:
        unknown = set(d) - {"targets", "weights", "input_activations", "output_activations", "format"}
        if unknown:
            raise InputError(f"unknown key(s) {sorted(unknown)} in a config group")
        if d.get("weights") is None:
            raise InputError("config group has no 'weights' args; qtk reads weight-quantized checkpoints only")
        if d.get("output_activations") is not None:
            raise InputError("output activation quantization is not supported by qtk")
        return cls(weights=QuantArgs.from_dict(d["weights"]),
                   input_activations=QuantArgs.from_dict(d.get("input_activations")),
                   targets=tuple(d.get("targets") or ("Linear",)), stored_format=d.get("format"))


@dataclass(frozen=True)
class KVCacheScheme:
    """FP8 e4m3 or INT8 keys/values with static scales per tensor or per KV head."""

    type: str = "float"
    strategy: str = "tensor"

    def __post_init__(self):
        if self.type not in TYPES:
            raise InputError(f"kv cache type must be 'float' (fp8) or 'int' (int8), got {self.type!r}")
        if self.strategy not in ("tensor", "attn_head"):
            raise InputError(f"kv cache strategy must be 'tensor' or 'attn_head' (per head), got {self.strategy!r}")

    @property
    def args(self) -> QuantArgs:
        return QuantArgs(num_bits=8, type=self.type, symmetric=True, strategy=self.strategy)

    def to_dict(self) -> dict:
        return self.args.to_dict()

    @classmethod
    def from_dict(cls, d: dict | None) -> KVCacheScheme | None:
        if d is None:
            return None
        a = QuantArgs.from_dict(d)
        if a.num_bits != 8 or not a.symmetric or a.dynamic:
            raise InputError(f"kv_cache_scheme must be static symmetric 8-bit, got {d}")
        return cls(type=a.type, strategy=a.strategy)


def _int(bits, strategy="channel", group_size=None, symmetric=True, dynamic=False):
    return QuantArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                     group_size=group_size, dynamic=dynamic)


def _fp8(strategy, dynamic=False):
    return QuantArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=dynamic)


DEFAULT_GROUP_SIZE = 128

PRESETS: dict[str, Scheme] = {
    "w4a16": Scheme(_int(4, "group", DEFAULT_GROUP_SIZE)),
    "w4a16_asym": Scheme(_int(4, "group", DEFAULT_GROUP_SIZE, symmetric=False)),
    "w8a16": Scheme(_int(8, "channel")),
    "w8a8": Scheme(_int(8, "channel"), _int(8, "token", dynamic=True)),
    "fp8": Scheme(_fp8("channel"), _fp8("token", dynamic=True)),
    "fp8_dynamic": Scheme(_fp8("channel"), _fp8("token", dynamic=True)),
    "fp8_static": Scheme(_fp8("tensor"), _fp8("tensor")),
}

KV_CACHE = {"fp8": "float", "int8": "int"}
KV_STRATEGIES = {"tensor": "tensor", "head": "attn_head"}


def preset(name: str, group_size: int | None = None) -> Scheme:
    """The preset `name` (case-insensitive), with an optional group size override."""
    key = name.lower().replace("-", "_")
    if key not in PRESETS:
        raise InputError(f"unknown scheme {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[key].with_group_size(group_size)


def kv_cache_scheme(kind: str | None, strategy: str = "tensor") -> KVCacheScheme | None:
    if kind is None or kind == "none":
        return None
    if kind not in KV_CACHE:
        raise InputError(f"kv_cache {kind!r} is not supported; choose one of {sorted(KV_CACHE)}")
    if strategy not in KV_STRATEGIES:
        raise InputError(f"kv_strategy {strategy!r} cannot be expressed for a KV cache; choose one of "
                         f"{sorted(KV_STRATEGIES)} (per tensor or per KV head)")
    return KVCacheScheme(type=KV_CACHE[kind], strategy=KV_STRATEGIES[strategy])


GROUP_SIZES = (256, 128, 64, 32, 16, 8)  # power-of-two group sizes qtk proposes, largest first


def dividing_group_size(in_features: dict[str, int], at_most: int | None = None) -> int | None:
    """The largest group size of GROUP_SIZES (at most `at_most`) that divides every input size."""
    sizes = set(in_features.values())
    return next((g for g in GROUP_SIZES if (at_most is None or g <= at_most) and all(k % g == 0 for k in sizes)), None)


def check_group_divides(scheme: Scheme, in_features: dict[str, int]) -> None:
    """Refuse a group size that does not divide every targeted layer's input size.

    A ragged last group would be read differently by different engines (vLLM's kernels need
    in_features % group_size == 0), so qtk never writes one: it names the layers and proposes
    the largest power-of-two group size that divides all of them.
    """
    w = scheme.weights
    if w.strategy != "group":
        return
    bad = {n: k for n, k in in_features.items() if k % w.group_size}
    if not bad:
        return
    fit = dividing_group_size(in_features)
    shown = ", ".join(f"{n} (in_features={k})" for n, k in list(bad.items())[:4])
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    hint = f"use --group-size {fit}" if fit else "use --group-size -1 (per-channel)"
    raise InputError(f"group size {w.group_size} does not divide the input size of {len(bad)} layer(s): "
                     f"{shown}{more}; {hint}")
