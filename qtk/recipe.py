"""A recipe: what `qtk quantize` does, as frozen dataclasses built from CLI flags or a YAML file."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from . import assets
from .errors import InputError, NotFoundError
from .methods import FP8, METHODS, SMOOTHING, WEIGHTS, named
from .methods.args import AutoRoundArgs, AWQArgs, DistillArgs, GPTQArgs, SmoothQuantArgs, check_types
from .rotation import ROTATIONS
from .schemes import KVCacheScheme, Scheme, kv_cache_scheme, preset
from .spill import PLACES


@dataclass(frozen=True)
class CalibrationArgs:
    dataset: str = "builtin"  # builtin | FILE.txt | FILE.jsonl | hf:NAME | self (the model's own text) | instruct (its answers); A+B mixes
    num_samples: int = 64
    seq_len: int = 512
    seed: int = 0
    chat_template: bool = False
    batch_size: int = 8
    # mixture of experts: every calibration token goes through every expert, for statistics only
    # (the block's output still sums the routed ones), so no expert's Hessian or ranges starve;
    # llm-compressor's moe_calibrate_all_experts (its default too). false: each expert sees the
    # tokens routed to it, and one that saw too few is rounded to nearest (logged)
    calibrate_all_experts: bool = True
    # where the activations wait between blocks: memory, disk (memory-mapped files beside the output,
    # spill.py), or auto: disk when they would take more than half the memory available
    activations: str = "auto"

    def __post_init__(self):
        check_types(self, "calibration")
        if self.activations not in PLACES:
            raise InputError(f"calibration.activations must be one of {', '.join(PLACES)}, got {self.activations!r}")
        for k in ("num_samples", "seq_len", "batch_size"):
            if getattr(self, k) <= 0:
                raise InputError(f"calibration.{k} must be positive, got {getattr(self, k)}")
        if not -2 ** 63 <= self.seed < 2 ** 64:  # what torch.Generator.manual_seed takes
            raise InputError(f"calibration.seed must fit in 64 bits (-2**63 <= seed < 2**64), got {self.seed}")


CALIBRATION_DTYPES = ("auto", "bfloat16", "float32")
MIXED_WIDER = preset("w8a16")  # where max_bits keeps the layers a narrower scheme hurts most


def check_patterns(patterns, what: str) -> None:
    """Every 're:REGEX' among layer names and patterns compiles (what: how an error names one)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise InputError(f"{what} {pattern!r} is not a valid regular expression ({e})") from e


@dataclass(frozen=True)
class Override:
    """Layers quantized with a scheme of their own (mixed precision: the few layers a 4-bit
    scheme hurts most kept at 8 bits): `targets` are layer names or 're:REGEX' patterns, as
    ignore's; `scheme` a weight-only int preset (w8a16, w4a16, w4a16_asym, ...). They are rounded to
    nearest on their scheme's grid after the block's method ran (8 bits per channel moves the
    bundled model's distributions by KL 0.003 for all its layers together), and written as their
    own config group."""
    targets: tuple[str, ...]
    scheme: Scheme

    def __post_init__(self):
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise InputError(f"an override's targets must be layer names or 're:REGEX' patterns, got {self.targets!r}")
        w, act = self.scheme.weights, self.scheme.input_activations
        if act is not None or w.type != "int":
            raise InputError("an override's scheme must be a weight-only int scheme (w8a16, w4a16, w4a16_asym), "
                             f"got weights {w.type}{w.num_bits} with activations {act and act.type}")
        check_patterns(self.targets, "override target")


@dataclass(frozen=True)
class Recipe:
    method: str
    scheme: Scheme
    weights: str = "rtn"  # the weight quantizer: a WEIGHTS method of qtk.methods.METHODS
    smoothing: str | None = None  # an equivalent transform applied first: a SMOOTHING method
    ignore: tuple[str, ...] = ("lm_head",)
    overrides: tuple[Override, ...] = ()  # layers with a scheme of their own (mixed precision)
    # mixed precision chosen by measurement: the layers that cost the most KL alone at the scheme
    # are kept at 8 bits (MIXED_WIDER) while the average bits per quantized weight stay <= max_bits
    # (qtk/sensitivity.py); the recipe.yaml written lists the layers chosen as overrides
    max_bits: float | None = None
    # Hadamard rotations before calibration (qtk/rotation.py): "v_o" (fused into the weights), "down"
    # (the down projections' inputs, online: compressed-tensors' transform config)
    rotate: tuple[str, ...] = ()
    kv_cache: KVCacheScheme | None = None
    gptq: GPTQArgs = field(default_factory=GPTQArgs)  # each method's options (METHODS[name].args)
    awq: AWQArgs = field(default_factory=AWQArgs)
    smoothquant: SmoothQuantArgs = field(default_factory=SmoothQuantArgs)
    autoround: AutoRoundArgs = field(default_factory=AutoRoundArgs)
    calibration: CalibrationArgs = field(default_factory=CalibrationArgs)
    # after the block-wise methods, every scale trained end to end against the float model (qtk/distill.py)
    distill: DistillArgs = field(default_factory=DistillArgs)
    device: str = "cpu"
    # the model's dtype while calibrating (blocks run in it; solves stay float32); auto: bf16 where the
    # device has bf16 units, float32 elsewhere (qtk.device.choose_dtype)
    dtype: str = "auto"
    # the group size is the scheme's default, not the user's: the pipeline lowers it to the largest
    # power of two that divides every quantized layer (an explicit group size that does not is an error)
    auto_group_size: bool = False

    def __post_init__(self):
        from .device import check_device

        check_device(self.device, present=False)  # a recipe may be written for another machine
        if self.dtype not in CALIBRATION_DTYPES:
            raise InputError(f"dtype must be one of {CALIBRATION_DTYPES}, got {self.dtype!r}")
        if self.method not in METHODS:
            raise InputError(f"method must be one of {tuple(METHODS)}, got {self.method!r}")
        if self.weights not in named(WEIGHTS):
            raise InputError(f"weights must be {_either(named(WEIGHTS))}, got {self.weights!r}")
        if self.smoothing is not None and self.smoothing not in named(SMOOTHING):
            raise InputError(f"smoothing must be {_either(named(SMOOTHING))}, got {self.smoothing!r}")
        for name in (self.smoothing, self.weights):  # the scheme each can quantize
            check = name is not None and METHODS[name].check
            if check:
                check(self.scheme)
        if self.max_bits is not None:
            if isinstance(self.max_bits, bool) or not isinstance(self.max_bits, (int, float)) or self.max_bits <= 0:
                raise InputError(f"max_bits must be a positive number of bits per weight, got {self.max_bits!r}")
            w, act = self.scheme.weights, self.scheme.input_activations
            if act is not None or w.type != "int" or w.num_bits >= MIXED_WIDER.weights.num_bits:
                raise InputError(f"max_bits keeps layers at 8 bits beside a narrower weight-only int scheme "
                                 f"(w4a16, w4a16_asym); this recipe's scheme has weights {w.type}{w.num_bits}"
                                 + (" and quantized activations" if act is not None else ""))
        unknown = [r for r in self.rotate if r not in ROTATIONS]
        if unknown or not isinstance(self.rotate, tuple):
            raise InputError(f"rotate must list rotations of {ROTATIONS}, got {self.rotate!r}")
        if self.distill.samples and (self.scheme.input_activations is not None or self.scheme.weights.type != "int"):
            raise InputError("distill trains the scales of weight-only int schemes (w4a16, w4a16_asym, w8a16); this "
                             f"scheme has weights {self.scheme.weights.type}{self.scheme.weights.num_bits}"
                             + (" and quantized activations" if self.scheme.input_activations is not None else ""))
        if "lm_head" not in self.ignore:
            raise InputError("qtk quantizes the decoder blocks only: keep 'lm_head' in ignore")
        check_patterns(self.ignore, "ignore pattern")

    @property
    def stored_scheme(self) -> Scheme:
        """The scheme as the checkpoint states it. GPTQ's act-order on groups is compressed-tensors'
        actorder "static" (alias "weight", llm-compressor's default): columns solved by descending
        diag(H), groups kept in column order, so no weight_g_idx ("group" would make readers expect
        one). Per channel or tensor it changes nothing stored, and compressed-tensors before 0.16
        (vLLM has pinned 0.13) refuses any actorder there, so it stays null."""
        w = self.scheme.weights
        if self.weights != "gptq" or not self.gptq.act_order or w.strategy != "group":
            return self.scheme
        return dataclasses.replace(self.scheme, weights=dataclasses.replace(w, actorder="static"))

    @property
    def needs_data(self) -> bool:
        a = self.scheme.input_activations
        return (any(METHODS[name].calibrates for name in (self.weights, self.smoothing) if name is not None)
                or self.kv_cache is not None or (a is not None and not a.dynamic) or self.max_bits is not None
                or self.distill.samples > 0)


def _either(names: tuple[str, ...]) -> str:
    """'a' or 'b'; 'a', 'b' or 'c'."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def from_flags(method: str, scheme: str | None = None, group_size: int | None = None,
               weights: str | None = None, kv_cache: str | None = None, kv_strategy: str = "tensor",
               ignore: tuple[str, ...] = (), **sections) -> Recipe:
    """Build a Recipe the way the CLI does; `sections` are method args (gptq=..., awq=...)."""
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; choose one of {sorted(METHODS)}")
    m = METHODS[method]
    smoothing = method if m.role == SMOOTHING else None
    if smoothing is None and weights not in (None, m.weights):
        raise InputError(f"--weights {weights} chooses the weight quantizer after smoothing (awq, smoothquant); "
                         f"for {weights} weights alone use --method {weights}")
    sch = preset(scheme or m.scheme, group_size)
    if m.role == FP8 and sch.weights.type != "float":
        raise InputError(f"--method fp8 takes an fp8 scheme (fp8, fp8_static), got {scheme!r}")
    return Recipe(method=method, scheme=sch, weights=weights or m.weights, smoothing=smoothing,
                  ignore=("lm_head", *[i for i in ignore if i != "lm_head"]),
                  kv_cache=kv_cache_scheme(kv_cache, kv_strategy), **sections)


_SECTIONS = {**{name: m.args for name, m in METHODS.items() if m.args}, "calibration": CalibrationArgs,
             "distill": DistillArgs}
_TOP = {"method", "scheme", "group_size", "weights", "kv_cache", "kv_strategy", "ignore", "overrides", "max_bits", "rotate",
        "device", "dtype", *_SECTIONS}


# `qtk quantize MODEL` with neither --method nor --recipe: qtk's best 4-bit recipe, AWQ scales then
# GPTQ on asymmetric int4 groups with an MSE-searched clipping range (measured against
# llm-compressor in benchmarks/results/compare_llmcompressor.md), read from the recipe qtk ships,
# calibration/recipes/awq-gptq-w4a16.yaml (qtk.assets).
DEFAULT_RECIPE = "awq-gptq-w4a16"


def build(method: str | None = None, scheme: str | None = None, group_size: int | None = None,
          weights: str | None = None, kv_cache: str | None = None, kv_strategy: str | None = None,
          ignore: tuple[str, ...] = (), device: str | None = None, dtype: str | None = None,
          recipe_file: str | None = None, max_bits: float | None = None, rotate: tuple[str, ...] = (),
          **section_overrides: dict) -> Recipe:
    """A Recipe from an optional YAML file (qtk's recipe DEFAULT_RECIPE when there is neither a
    file nor a method), overridden by explicit values (the CLI's flags).

    `section_overrides` maps a section (gptq, awq, smoothquant, calibration) to {field: value}."""
    data: dict = {}
    if recipe_file is not None:
        data = load_yaml(recipe_file)
    elif method is None:
        data = load_yaml(str(assets.recipe_file(DEFAULT_RECIPE)))
        if scheme is not None:  # its max_bits budget is for its own 4-bit scheme
            data.pop("max_bits", None)
    top = {"method": method, "scheme": scheme, "group_size": group_size, "weights": weights,
           "kv_cache": kv_cache, "kv_strategy": kv_strategy, "device": device,
           "dtype": dtype, "max_bits": max_bits}
    data.update({k: v for k, v in top.items() if v is not None})
    if data.get("max_bits") == 0:  # --max-bits 0: no layer kept wider
        del data["max_bits"]
    if ignore:
        data["ignore"] = list(ignore)
    if rotate:  # ("none",): none of the recipe's
        data["rotate"] = [] if tuple(rotate) == ("none",) else list(rotate)
    _check_top(data)
    sections = {}
    for name, cls in _SECTIONS.items():
        if not isinstance(data.get(name) or {}, dict):
            raise InputError(f"recipe section {name!r} must be a mapping of its keys to values, got {data[name]!r}")
        fields = dict(data.get(name) or {})
        fields.update({k: v for k, v in (section_overrides.get(name) or {}).items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(fields) - known
        if unknown:
            raise InputError(f"unknown key(s) {sorted(unknown)} in recipe section {name!r}; known: {sorted(known)}")
        sections[name] = cls(**fields)
    if "method" not in data:
        raise InputError("no method: pass --method or give 'method:' in the recipe")
    recipe = from_flags(data["method"], scheme=data.get("scheme"), group_size=data.get("group_size"),
                        weights=data.get("weights"), kv_cache=data.get("kv_cache"),
                        kv_strategy=data.get("kv_strategy") or "tensor", ignore=tuple(data.get("ignore") or ()),
                        **sections)
    rotations = data.get("rotate") or []
    if not isinstance(rotations, list):
        raise InputError(f"rotate must be a list of rotations of {ROTATIONS}, got {rotations!r}")
    recipe = dataclasses.replace(recipe, max_bits=data.get("max_bits"), rotate=tuple(rotations))
    _check_applies(recipe, data.get("kv_strategy"), section_overrides)
    auto_group = data.get("group_size") is None and recipe.scheme.weights.strategy == "group"
    return dataclasses.replace(recipe, device=data.get("device") or "cpu", dtype=data.get("dtype") or "auto",
                               auto_group_size=auto_group, overrides=_overrides(data.get("overrides")))


def _overrides(data) -> tuple[Override, ...]:
    """A recipe's overrides: [{targets: [NAME | 're:REGEX', ...], scheme: PRESET[, group_size: N]}, ...]."""
    if data is None:
        return ()
    if not isinstance(data, list) or not all(isinstance(o, dict) for o in data):
        raise InputError("recipe overrides must be a list of {targets: [layer names or 're:REGEX'], scheme: NAME}, "
                         f"got {data!r}")
    out = []
    for o in data:
        unknown = set(o) - {"targets", "scheme", "group_size"}
        if unknown or "targets" not in o or "scheme" not in o:
            raise InputError(f"a recipe override has targets, scheme and optionally group_size; got {o!r}")
        targets = o["targets"]
        if isinstance(targets, str) or not isinstance(targets, list):
            raise InputError(f"an override's targets must be a list, got {targets!r}")
        if not isinstance(o["scheme"], str):
            raise InputError(f"an override's scheme must be a preset name, got {o['scheme']!r}")
        out.append(Override(tuple(targets), preset(o["scheme"], o.get("group_size"))))
    return tuple(out)


def _check_applies(recipe: Recipe, kv_strategy: str | None, section_overrides: dict) -> None:
    """Refuse a setting the recipe would ignore (a GPTQ option without GPTQ weights, a calibration
    option for a recipe that reads no data, ...): it would be written into recipe.yaml as if it had
    been used."""
    if kv_strategy is not None and recipe.kv_cache is None:
        raise InputError(f"kv_strategy {kv_strategy!r} (--kv-strategy) applies to KV-cache scales; "
                         "add --kv-cache fp8|int8")
    for section, m in METHODS.items():
        flags = _given_flags(section_overrides, section) if m.args else ""
        if flags and section not in (recipe.weights, recipe.smoothing):
            raise InputError(f"{flags}: {section} option(s), but this recipe (method {recipe.method}, "
                             f"{recipe.weights} weights) does not run {section}")
    flags = _given_flags(section_overrides, "calibration")
    if flags and not recipe.needs_data:
        raise InputError(f"{flags}: calibration option(s), but this recipe (method {recipe.method}, "
                         f"{recipe.weights} weights) takes no calibration data; only gptq weights, awq, smoothquant, "
                         "static activation scales, --kv-cache scales, --max-bits and --distill-samples calibrate")


def _given_flags(section_overrides: dict, section: str) -> str:
    """The section's options given explicitly (not None), as the CLI spells them: '--seq-len, --seed'."""
    given = sorted(k for k, v in (section_overrides.get(section) or {}).items() if v is not None)
    return ", ".join("--" + k.replace("_", "-") for k in given)


def _check_top(data: dict) -> None:
    """The recipe's top-level values: strings, an integer group size, a list of ignore patterns."""
    for key in ("method", "scheme", "weights", "kv_cache", "kv_strategy", "device", "dtype"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise InputError(f"recipe {key} must be a string, got {data[key]!r}")
    g = data.get("group_size")
    if g is not None and (isinstance(g, bool) or not isinstance(g, int)):
        raise InputError(f"recipe group_size must be an integer (-1 = per channel), got {g!r}")
    ignore = data.get("ignore")
    if ignore is not None and (not isinstance(ignore, (list, tuple)) or not all(isinstance(i, str) for i in ignore)):
        raise InputError(f"recipe ignore must be a list of layer names or 're:REGEX' patterns, got {ignore!r}")


def load_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError as e:
        raise NotFoundError(f"recipe file {path} not found") from e
    except IsADirectoryError as e:
        raise InputError(f"recipe {path} is a folder; give a recipe YAML file (see calibration/recipes/)") from e
    except UnicodeDecodeError as e:
        raise InputError(f"recipe file {path} is not UTF-8 text (byte {e.start})") from e
    except yaml.YAMLError as e:
        raise InputError(f"recipe file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise InputError(f"recipe file {path} must be a mapping of keys to values")
    unknown = set(data) - _TOP
    if unknown:
        raise InputError(f"unknown key(s) {sorted(unknown)} in recipe {path}; known: {sorted(_TOP)}")
    return data


def to_yaml(recipe: Recipe) -> str:
    """The recipe as YAML that `build(recipe_file=...)` reads back to the same Recipe."""
    import yaml

    from .schemes import KV_CACHE, KV_STRATEGIES, PRESETS

    w = recipe.scheme.weights
    # a group size override is a group size, or -1 for a group preset made per-channel
    group_size = w.group_size if w.strategy == "group" else -1
    name = next((k for k, v in PRESETS.items() if v == recipe.scheme), None)
    if name is None:  # a preset regrouped (weight-only int) or made per-channel (any, e.g. fp8_static)
        name = next((k for k, v in PRESETS.items()
                     if (group_size == -1 or (v.input_activations is None and v.weights.type == "int"))
                     and v.with_group_size(group_size) == recipe.scheme), None)
    d = {"method": recipe.method, "scheme": name, "weights": recipe.weights, "ignore": list(recipe.ignore),
         "device": recipe.device, "dtype": recipe.dtype}
    if (w.strategy == "group" and not recipe.auto_group_size) or (name is not None and PRESETS[name] != recipe.scheme):
        d["group_size"] = group_size
    if recipe.overrides:
        d["overrides"] = [_override_dict(o) for o in recipe.overrides]
    if recipe.max_bits is not None:
        d["max_bits"] = recipe.max_bits
    if recipe.rotate:
        d["rotate"] = list(recipe.rotate)
    if recipe.kv_cache is not None:
        d["kv_cache"] = {v: k for k, v in KV_CACHE.items()}[recipe.kv_cache.type]
        d["kv_strategy"] = {v: k for k, v in KV_STRATEGIES.items()}[recipe.kv_cache.strategy]
    for section in _SECTIONS:
        d[section] = dataclasses.asdict(getattr(recipe, section))
    return yaml.safe_dump(d, sort_keys=False)


def _override_dict(o: Override) -> dict:
    """An override as the recipe YAML writes it (a preset name, and its group size where it differs)."""
    from .schemes import PRESETS

    w = o.scheme.weights
    size = w.group_size if w.strategy == "group" else -1
    name = next((k for k, v in PRESETS.items() if v == o.scheme), None)
    if name is not None:
        return {"targets": list(o.targets), "scheme": name}
    name = next(k for k, v in PRESETS.items() if v.input_activations is None and v.weights.type == "int"
                and v.with_group_size(size) == o.scheme)
    return {"targets": list(o.targets), "scheme": name, "group_size": size}
