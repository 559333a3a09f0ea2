"""The runtime's GPU bars (docs/benchmarks.md, Engine) on a Llama-3-8B-shaped model of random
weights, in one process, where CUDA is:

    batch 1     128-token prompt, 256 output tokens: median TPOT (the step times after the first)
                against the roofline, bytes one decode step reads (every weight once, the
                embedding's one row, the KV so far) / the device's copy bandwidth; bf16 and
                W4A16 (RTN, group 128), with CUDA graphs and with --enforce-eager
    offline     N requests, prompts and outputs of lengths uniform in [100, 1024] (EOS ignored),
                all at once: output tok/s; transformers generate on the same requests, statically
                batched (longest output per batch; only each request's own tokens count)
    fp8 kv      KV tokens the same cache memory holds in bf16 and FP8; decode attention at 8K, 16K
                and 32K contexts, 16 sequences, bf16 cache against FP8 (the Triton kernel alone)

    python benchmarks/gpu_engine.py [--shape llama3-8b|tiny] [--device cuda] [--requests 256]
           [--hf-requests 64] [--parts batch1,offline,hf,kv] [--out benchmarks/results]

Random weights decode random tokens: timings are the model's shape's, nothing else. The tokenizer
is a word-level one over the model's vocabulary built here ("t0", "t1", ...), so the script needs
no download and no bundled model. `--shape tiny --device cpu` runs every part on a small model
(how the script is checked without a GPU; its figures mean nothing).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qtk import LLM, SamplingParams  # noqa: E402
from qtk.bench import git_commit  # noqa: E402

log = logging.getLogger("gpu_engine")

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=32768, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048),
}


def build_model(shape: str, path: Path, device: str) -> Path:
    """A Llama of `shape` with random bf16 weights (std 0.02, made on `device`) and a word-level
    tokenizer over its vocabulary, saved to path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", unk_token="t2").save_pretrained(path)
    del model
    return path


def quantize_w4a16(src: Path, dst: Path, device: str) -> Path:
    """RTN W4A16, group 128, through `qtk quantize` (one block at a time on `device`; RTN reads no
    calibration data)."""
    subprocess.run([sys.executable, "-m", "qtk.cli", "quantize", str(src), "--method", "rtn", "--scheme", "w4a16",
                    "--group-size", "128", "--device", device, "-o", str(dst)], check=True, cwd=REPO)
    return dst


def step_bytes(llm: LLM, context: int) -> int:
    """Bytes one batch-1 decode step reads: every parameter and buffer of the layers, the final
    norm and lm_head once, one embedding row, and the K/V of `context` tokens."""
    m = llm.model
    seen, total = set(), 0
    for module in (*m.layers, m.norm, m.lm_head):
        for t in (*module.parameters(), *module.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    total += m.embed_tokens.weight[0].numel() * m.embed_tokens.weight.element_size()
    kv_elem = torch.empty(0, dtype=llm.kv_dtype).element_size()
    return total + 2 * len(m.layers) * m.num_kv_heads * m.head_dim * kv_elem * context


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write); CPU: a 256 MiB copy."""
    n = 2**28 if device.startswith("cuda") else 2**26
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n * 4 / statistics.median(times)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batch1(llm: LLM, prompt: list[int], output_len: int) -> dict:
    """Median step time of one request's decode (every step after its prefill)."""
    llm.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    times = []
    while llm.has_unfinished_requests():
        t = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t)
    return {"tpot_ms": round(statistics.median(times[1:]) * 1e3, 4), "steps": len(times)}


def offline_requests(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
            for _ in range(n)]


def qtk_offline(llm: LLM, requests) -> dict:
    params = [SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True) for _, out in requests]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(requests), "tokens": tokens, "seconds": round(seconds, 2),
            "tok_s": round(tokens / seconds, 1)}


@torch.inference_mode()
def hf_offline(path: Path, requests, device: str, batch: int) -> dict:
    """transformers generate, `batch` requests at a time (sorted by prompt length), left-padded,
    each batch to its longest output; a request's tokens past its own length do not count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    order = sorted(requests, key=lambda r: len(r[0]))
    tokens, t = 0, time.perf_counter()
    for i in range(0, len(order), batch):
        group = order[i:i + batch]
        width, new = max(len(p) for p, _ in group), max(o for _, o in group)
        ids = torch.tensor([[1] * (width - len(p)) + p for p, _ in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group], device=device)
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=1)
        tokens += sum(o for _, o in group)
    sync(device)
    seconds = time.perf_counter() - t
    del model
    return {"requests": len(requests), "batch": batch, "tokens": tokens, "seconds": round(seconds, 2),
            "tok_s": round(tokens / seconds, 1)}


def kv_attention(shape: str, device: str, contexts: tuple[int, ...]) -> dict:
    """Decode attention of 16 sequences at each context, bf16 cache against FP8 (e4m3, per-tensor
    scales): median ms of the Triton kernel (triton.testing.do_bench)."""
    import triton

    from qtk.kernels import attention as ta

    s = SHAPES[shape]
    heads, kv_heads = s["num_attention_heads"], s["num_key_value_heads"]
    d, bs, b = s["hidden_size"] // heads, 16, 16
    out = {}
    for ctx in contexts:
        blocks = b * ctx // bs
        q = torch.randn(b, heads, d, device=device, dtype=torch.bfloat16)
        tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(b, -1)
        lens = torch.full((b,), ctx, device=device, dtype=torch.int32)
        row = {}
        for name in ("bf16", "fp8"):
            k = torch.randn(kv_heads, blocks * bs, d, device=device, dtype=torch.bfloat16)
            scale = None
            if name == "fp8":
                scale = torch.full((1,), 0.01, device=device)
                k = (k.float() / scale).to(torch.float8_e4m3fn)
            v = k.clone()
            fn = lambda: ta.decode_attention(q, k, v, tables, lens, d ** -0.5, bs, scale, scale)  # noqa: E731
            row[f"{name}_ms"] = round(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), 4)
            del k, v
        row["speedup"] = round(row["bf16_ms"] / row["fp8_ms"], 3)
        out[str(ctx)] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=64, help="transformers runs the first N requests")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--parts", default="batch1,offline,hf,kv")
    ap.add_argument("--work", default=None, help="where the model is written (default: a temp dir)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parts = set(args.parts.split(","))
    tiny = args.shape == "tiny"
    res = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "commit": git_commit(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": " ".join(sys.argv)}
    dest = Path(args.out) / f"gpu_engine-{args.shape}.json"

    def save():  # after each part: a run cut short keeps what it measured
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(res, indent=2) + "\n")

    cuda = args.device.startswith("cuda")
    res["copy_GBps"] = round(copy_bandwidth(args.device) / 1e9, 1)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        bf16 = build_model(args.shape, Path(work) / "bf16", args.device)
        models = {"bf16": bf16}
        if "batch1" in parts:
            models["w4a16"] = quantize_w4a16(bf16, Path(work) / "w4a16", args.device)
        requests = offline_requests(8 if tiny else args.requests, SHAPES[args.shape]["vocab_size"])
        if tiny:
            requests = [(p[:40], o // 20) for p, o in requests]
        engine = dict(device=args.device, dtype="bfloat16", max_num_seqs=256, max_model_len=4096)
        modes = (False, True) if cuda and "batch1" in parts else (not cuda,)  # enforce_eager
        for name, path in models.items():
            for eager in modes:
                llm = LLM(str(path), enforce_eager=eager, **engine)
                first = name == "bf16" and eager == modes[0]
                if first:
                    res["kv_tokens"] = {"bf16": llm.block_manager.num_blocks * llm.block_manager.block_size}
                if "batch1" in parts:
                    r = batch1(llm, list(range(3, 131)), 16 if tiny else 256)
                    r["step_bytes"] = step_bytes(llm, 128 + 128)
                    r["roofline_ms"] = round(r["step_bytes"] / (res["copy_GBps"] * 1e9) * 1e3, 4)
                    r["tpot_over_roofline"] = round(r["tpot_ms"] / r["roofline_ms"], 3)
                    res.setdefault("batch1", {})[f"{name}{'-eager' if eager else ''}"] = r
                if first and "offline" in parts:
                    res["offline_qtk"] = qtk_offline(llm, requests)
                del llm
                if cuda:
                    torch.cuda.empty_cache()
                save()
        if "hf" in parts:
            res["offline_hf"] = hf_offline(bf16, requests[:args.hf_requests], args.device, args.hf_batch)
            if "offline_qtk" in res:
                res["offline_ratio"] = round(res["offline_qtk"]["tok_s"] / res["offline_hf"]["tok_s"], 2)
            save()
        if "kv" in parts:
            llm = LLM(str(bf16), kv_cache_dtype="fp8", enforce_eager=True, **engine)
            res["kv_tokens"]["fp8"] = llm.block_manager.num_blocks * llm.block_manager.block_size
            del llm
            if cuda:  # the Triton kernel itself (the interpreter off CUDA would time nothing real)
                res["kv_attention"] = kv_attention(args.shape, args.device, (8192, 16384, 32768))
            save()
    log.info("%s: %s", dest, json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
