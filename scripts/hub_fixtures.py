"""Build GPTQ and AWQ checkpoints of the tests' tiny Llama with the tools' own packers.

    bash scripts/hub_fixtures.sh          # downloads auto-gptq 0.7.1 and autoawq 0.2.9, runs this

tests/test_hub_formats.py reads what this writes, tests/data/hub_formats/<name>/: a checkpoint as
the tool saves it (config.json with the tool's quantization_config, model.safetensors with its
qweight / qzeros / scales / g_idx, fp16 float parts, the byte tokenizer), and beside it <name>.reference.safetensors:
each quantized Linear's weight [out, in] as the tool's own forward dequantizes it (AutoGPTQ's
QuantLinear torch path fed an identity; AutoAWQ's dequantize_gemm). qtk's loader must reproduce
those weights, so the layout is judged by the tools that define it, not by qtk's reading of them.

Only the tools' packing and dequantizing modules are loaded (by file, without their packages'
__init__, which import GPU kernels and model classes): AutoGPTQ's nn_modules/qlinear/qlinear_cuda.py
(torch path when its CUDA extension is absent) and AutoAWQ's modules/linear/gemm.py +
utils/packing_utils.py.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_fixtures import TINY, byte_tokenizer  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# name -> (tool, bits, group size, symmetric, act-order)
FIXTURES = {
    "gptq_sym_actorder": ("gptq", 4, 32, True, True),
    "gptq_asym": ("gptq", 4, 32, False, False),
    "gptq_int8_channel": ("gptq", 8, -1, True, False),
    "awq_gemm": ("awq", 4, 32, False, False),
}


def load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def awq_modules(root: Path):
    """AutoAWQ's gemm.py and packing_utils.py, with its packages as bare namespaces."""
    for pkg in ("awq", "awq.utils", "awq.modules", "awq.modules.linear", "awq.modules.triton"):
        m = types.ModuleType(pkg)
        m.__path__ = [str(root.joinpath(*pkg.split(".")))]
        sys.modules[pkg] = m
    for sub in ("utils.module", "utils.utils", "utils.packing_utils"):
        load_file(f"awq.{sub}", root / "awq" / f"{sub.replace('.', '/')}.py")
    return load_file("awq.modules.linear.gemm", root / "awq/modules/linear/gemm.py")


def rtn_params(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor):
    """GPTQ's / AWQ's min-max scales and unsigned zeros [out, groups] (AutoGPTQ's Quantizer)."""
    maxq = 2 ** bits - 1
    groups = int(g_idx.max()) + 1
    scales, zeros = [], []
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            s = (2 * hi / maxq).clamp(min=1e-8)
            z = torch.full_like(s, (maxq + 1) // 2)
        else:
            s = ((hi - lo) / maxq).clamp(min=1e-8)
            z = torch.round(-lo / s).clamp(1, maxq)  # not 0: AutoGPTQ's v1 packer wraps a zero of 0
        scales.append(s)
        zeros.append(z)
    # stored scales are fp16: quantize on them so the codes are exactly the packer's round()
    return torch.stack(scales, 1).half().float(), torch.stack(zeros, 1)


def gptq_layer(qlinear_mod, lin: torch.nn.Linear, bits, group, sym, act_order, gen):
    k = lin.in_features
    size = k if group == -1 else group
    if act_order:  # GPTQ's desc_act: columns visited in a permuted order, grouped along it
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // size).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // size).to(torch.int32)
    scales, zeros = rtn_params(lin.weight.data, bits, size, sym, g_idx)
    q = qlinear_mod.QuantLinear(bits, group, k, lin.out_features, lin.bias is not None)
    lin16 = torch.nn.Linear(k, lin.out_features, bias=lin.bias is not None).half()
    lin16.weight.data = lin.weight.data.half()
    q.pack(lin16, scales.half(), zeros.half(), g_idx)
    with torch.no_grad():  # the tool's own dequantization: its forward on an identity
        ref = q(torch.eye(k, dtype=torch.float16)).float().t()
    state = {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales, "g_idx": q.g_idx}
    return state, ref


def awq_layer(gemm_mod, packing, lin: torch.nn.Linear, bits, group):
    k = lin.in_features
    g_idx = (torch.arange(k) // group).to(torch.int32)
    scales, zeros = rtn_params(lin.weight.data, bits, group, False, g_idx)
    lin16 = torch.nn.Linear(k, lin.out_features, bias=lin.bias is not None).half()
    lin16.weight.data = lin.weight.data.half()
    q = gemm_mod.WQLinear_GEMM.from_linear(lin16, bits, group, scales=scales.t().contiguous().half(),
                                           zeros=zeros.t().contiguous())
    ref = packing.dequantize_gemm(q.qweight, q.qzeros, q.scales, bits, group).float().t()
    return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales}, ref


def quantization_config(tool, bits, group, sym, act_order) -> dict:
    if tool == "gptq":  # as optimum / AutoGPTQ write it into config.json
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
                "checkpoint_format": "gptq", "model_name_or_path": None, "model_file_base_name": None}
    return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def build(out: Path, gptq_file: Path, awq_root: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    qlinear_mod = load_file("autogptq_qlinear_cuda", gptq_file)
    gemm_mod = awq_modules(awq_root)
    packing = sys.modules["awq.utils.packing_utils"]
    for name, (tool, bits, group, sym, act_order) in FIXTURES.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
        gen = torch.Generator().manual_seed(1)
        state = {k: v.half().contiguous() for k, v in model.state_dict().items()}
        refs = {}
        for i in range(TINY["num_hidden_layers"]):
            for lname in LINEARS:
                full = f"model.layers.{i}.{lname}"
                lin = model.get_submodule(full)
                if tool == "gptq":
                    parts, ref = gptq_layer(qlinear_mod, lin, bits, group, sym, act_order, gen)
                else:
                    parts, ref = awq_layer(gemm_mod, packing, lin, bits, group)
                del state[f"{full}.weight"]
                state.update({f"{full}.{k}": v.contiguous() for k, v in parts.items()})
                refs[f"{full}.weight"] = ref.half().contiguous()  # the tools dequantize in fp16
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        save_file(refs, str(out / f"{name}.reference.safetensors"))  # beside: not one of its weight files
        cfg = model.config.to_dict()
        cfg["torch_dtype"] = "float16"
        cfg.pop("dtype", None)
        cfg["quantization_config"] = quantization_config(tool, bits, group, sym, act_order)
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        byte_tokenizer().save_pretrained(d)
        print(f"{d}: {len(refs)} layers")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
