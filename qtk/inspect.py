"""`qtk inspect`: what a checkpoint holds, layer by layer, and its size against the bf16 original."""
from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open

from . import hub_formats
from .checkpoint import check_weight_files, parse_quantization_config, read_tensor_meta, weight_files
from .loading import BUNDLED, bundled_gguf, config_dict, resolve

HUB_KEYS = ("qweight", "qzeros", "scales", "g_idx")
LAYER_KEYS = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
              "input_scale", "bias")


def inspect_checkpoint(model: str) -> dict:
    path = resolve(model)
    gguf = bundled_gguf() if model == BUNDLED else Path(model) if Path(model).is_file() else None  # a .gguf
    cfg = config_dict(path)
    check_weight_files(path)
    meta = read_tensor_meta(path)  # name -> (dtype, shape, nbytes)
    qc = cfg.get("quantization_config")
    kv = None
    hub = qc is not None and hub_formats.is_hub_format(qc)
    if hub:
        hub_formats.check_config(qc, path)
    elif qc is not None:
        _, _, kvs = parse_quantization_config(qc)
        kv = None if kvs is None else {"type": kvs.type, "strategy": kvs.strategy}
    shapes = _weight_shapes(path, meta)
    layers = {}
    for base in sorted({n.rpartition(".")[0] for n in meta if n.endswith(".qweight")}):  # GPTQ / AWQ
        shapes[base] = _hub_shape(meta, base, qc)
        layers[base] = {"format": qc["quant_method"], "scale_shape": meta[f"{base}.scales"][1],
                        "bits": _bits(meta, base, shapes, HUB_KEYS),
                        "bytes": sum(meta[f"{base}.{k}"][2] for k in HUB_KEYS + ("bias",) if f"{base}.{k}" in meta)}
    for base in sorted({n.rpartition(".")[0] for n in meta if n.endswith(".weight_scale")}):
        w = meta.get(f"{base}.weight")
        fmt = "pack-quantized" if f"{base}.weight_packed" in meta else (
            "float-quantized" if w and w[0].startswith("F8") else "int-quantized")
        layers[base] = {"format": fmt, "scale_shape": meta[f"{base}.weight_scale"][1],
                        "bits": _bits(meta, base, shapes),
                        "bytes": sum(meta[f"{base}.{k}"][2] for k in LAYER_KEYS if f"{base}.{k}" in meta)}
    original = 0
    for name, (_, shape, _) in meta.items():
        base, _, leaf = name.rpartition(".")
        if base in layers:
            if leaf in ("weight_packed", "weight", "qweight"):
                original += math.prod(shapes.get(base, shape)) * 2
            elif leaf == "bias":
                original += math.prod(shape) * 2
        elif leaf not in ("k_scale", "v_scale"):
            original += math.prod(shape) * 2
    rotations = [{"group": name, "type": g.get("type"), "block": g.get("head_dim"),
                  "targets": next((a.get("targets") for a in g.get("apply") or [] if a.get("location") == "input"), None)}
                 for name, g in ((qc or {}).get("transform_config") or {}).get("config_groups", {}).items()]
    for r in rotations:  # the stored matrix is the transform's, not the model's
        original -= sum(math.prod(shape) * 2 for n, (_, shape, _) in meta.items() if n.endswith(f".{r['group']}_input.weight"))
    on_disk = sum(f.stat().st_size for f in weight_files(path))
    described = (hub_formats.describe(qc) if hub else _describe(qc)) if qc else None
    source = None if gguf is None else {"path": str(gguf), "size_bytes": gguf.stat().st_size}
    return {"path": str(path), "gguf": source, "model_type": cfg.get("model_type"), "quantization": described,
            "kv_cache": kv, "rotations": rotations, "layers": layers, "size_bytes": on_disk, "bf16_size_bytes": original,
            "compression": original / on_disk if on_disk else None}


def _weight_shapes(path, meta) -> dict[str, list[int]]:
    """Original [out, in] of each packed layer, read from its weight_shape tensor."""
    shapes = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.endswith(".weight_shape"):
                    shapes[k.rpartition(".")[0]] = sf.get_tensor(k).tolist()
    return shapes


def _hub_shape(meta, base, qc) -> list[int]:
    """[out, in] of a GPTQ / AWQ layer from its tensors' shapes (AWQ: qweight [in, .], scales [., out];
    GPTQ: qweight rows x 32 / the layer's bits, which its qzeros [groups, out * bits / 32] give)."""
    out = meta[f"{base}.scales"][1][1]
    if qc["quant_method"] == "awq":
        return [out, meta[f"{base}.qweight"][1][0]]
    bits = meta[f"{base}.qzeros"][1][1] * 32 // out
    return [out, meta[f"{base}.qweight"][1][0] * 32 // bits]


def _bits(meta, base, shapes, keys=("weight_packed", "weight", "weight_scale", "weight_zero_point")) -> float:
    """Bits per weight including scales and zero points."""
    numel = math.prod(shapes.get(base) or meta[f"{base}.weight"][1])
    payload = sum(meta[f"{base}.{k}"][2] for k in keys if f"{base}.{k}" in meta)
    return round(payload * 8 / numel, 3)


def _describe(qc: dict) -> list[dict]:
    out = []
    for name, g in qc["config_groups"].items():
        w, a = g["weights"], g.get("input_activations")
        wdesc = f"{w['type']}{w['num_bits']} {w['strategy']}" + (f" g{w['group_size']}" if w.get("group_size") else "")
        wdesc += "" if w.get("symmetric", True) else " asym"
        adesc = None if a is None else f"{a['type']}{a['num_bits']} {a['strategy']} " + ("dynamic" if a.get("dynamic") else "static")
        out.append({"group": name, "targets": g["targets"], "format": g.get("format") or qc.get("format"),
                    "weights": wdesc, "activations": adesc})
    return out


def render(info: dict) -> str:
    mib = 1 / 2**20
    lines = [f"{info['path']} ({info['model_type']})"]
    if info.get("gguf"):  # what follows is the conversion, not the GGUF's own quantization
        g = info["gguf"]
        lines.append(f"  bf16 conversion of {g['path']} ({g['size_bytes'] * mib:.1f} MiB in GGUF's own "
                     "quantization); what follows describes the conversion")
    if info["quantization"] is None:
        lines.append("  not quantized")
    for g in info["quantization"] or []:
        lines.append(f"  {g['group']}: {g['format']}, weights {g['weights']}, activations {g['activations'] or 'float'}, "
                     f"targets {g['targets']}")
    lines.append(f"  kv cache: {info['kv_cache'] or 'float'}")
    for r in info.get("rotations") or []:
        lines.append(f"  online rotation {r['group']}: {r['type']}, blocks of {r['block'] or 'the whole input'}, "
                     f"on the input of {r['targets']}")
    if info["layers"]:
        lines.append(f"  {'layer':<40} {'format':<16} {'scale shape':<12} {'bits/w':>7} {'MiB':>7}")
        for name, l in info["layers"].items():
            lines.append(f"  {name:<40} {l['format']:<16} {str(l['scale_shape']):<12} {l['bits']:>7.3f} {l['bytes'] * mib:>7.2f}")
    if info["compression"] is None:
        lines.append("  size on disk: no safetensors files (torch pickles are not measured)")
    else:
        lines.append(f"  size on disk {info['size_bytes'] * mib:.1f} MiB vs {info['bf16_size_bytes'] * mib:.1f} MiB "
                     f"in bf16 ({info['compression']:.2f}x smaller)")
    return "\n".join(lines)
