"""Which scheme vLLM would load each layer of a compressed-tensors checkpoint with, by vLLM's own
parser, with no kernel needed: runs in vLLM's venv (scripts/peer_env.sh vllm ...) on any CPU.

    python benchmarks/vllm_schemes.py JOB.json OUT.json     JOB: {"model": CHECKPOINT}

vLLM fuses the layers that read one input (LlamaForCausalLM.packed_modules_mapping: q/k/v into
qkv_proj, gate/up into gate_up_proj) and gives the fused layer one scheme, found from its shards'
names (compressed_tensors.utils.find_matched_target). A checkpoint whose shards of one fused layer
sit in different config groups is then loaded with a scheme some shards were not written in. For
every layer vLLM builds, OUT gets the weight bits vLLM resolves and each shard's own, and
"mismatched": the fused layers where they differ (empty: vLLM reads every layer as written).
"""
import json
import sys
from pathlib import Path


def resolve(checkpoint: Path) -> dict:
    import torch
    from safetensors import safe_open
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    from vllm.model_executor.models.registry import ModelRegistry

    config = json.loads((checkpoint / "config.json").read_text())
    if "quantization_config" not in config:
        return {"layers": {}, "mismatched": []}  # unquantized: every layer as written
    qc = CompressedTensorsConfig.from_config(config["quantization_config"])
    arch_cls = ModelRegistry._try_load_model_cls(config["architectures"][0])  # the class vLLM would build
    qc.packed_modules_mapping = dict(getattr(arch_cls, "packed_modules_mapping", {}))
    # an online rotation's stored matrix (transform_config: `<layer>.<group>_input.weight`) is no layer
    transforms = tuple(f".{g}_input" for g in (config["quantization_config"].get("transform_config") or {}).get(
        "config_groups", {}))
    shards = set()
    for f in checkpoint.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            shards |= {k.rsplit(".", 1)[0] for k in st.keys()  # Linear layers: packed, or a 2-D weight
                       if k.endswith(".weight_packed")
                       or (k.endswith(".weight") and len(st.get_slice(k).get_shape()) == 2)}
    shards = {s for s in shards if not s.endswith(transforms)}
    linear = torch.nn.Linear(1, 1)  # the class-name fallback ("Linear") sees a Linear, as vLLM's layers are

    def bits(name: str):
        d = qc.get_scheme_dict(linear, name)
        return None if d is None or d.get("weights") is None else d["weights"].num_bits

    layers, mismatched = {}, []
    done = set()
    for fused, parts in qc.packed_modules_mapping.items():
        for shard in sorted(shards):
            if not shard.endswith("." + parts[0]):
                continue
            name = shard[: -len(parts[0])] + fused
            members = [shard[: -len(parts[0])] + p for p in parts]
            if not all(m in shards for m in members):
                continue
            layers[name] = {"bits": bits(name), "shards": {m: bits(m) for m in members}}
            if any(b != layers[name]["bits"] for b in layers[name]["shards"].values()):
                mismatched.append(name)
            done |= set(members)
    for shard in sorted(shards - done):
        if ".layers." in shard:
            layers[shard] = {"bits": bits(shard), "shards": {shard: bits(shard)}}
    return {"layers": layers, "mismatched": mismatched}


if __name__ == "__main__":
    job = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(resolve(Path(job["model"])), indent=1))
