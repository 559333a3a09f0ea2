"""`qtk bench engine`: qtk's runtime against transformers `generate`, vLLM's CPU build and
llama.cpp on the same weights and requests, in one run (docs/benchmarks.md, Engine on CPU).

    throughput   N requests of a prompt set (bench/prompts.py: by default the 16 short chat
                 questions, repeated; fixed:N, random:LO-HI token windows or long-history
                 conversations with --prompts), M output tokens each, EOS ignored,
                 all submitted at once, after one warm-up batch: output tokens / wall seconds
                 (transformers: one request at a time over the first `sequential` requests, and
                 statically batched 16 at a time over all, left-padded)
    batch 1      one request, a 128-token prompt, 256 output tokens: output tok/s
    start-up     process start to the first token of a first request (a fresh process)
    roofline     the bytes one batch-1 decode step reads (every weight of the checkpoint once, float
                 ones in the dtype the step multiplies in; the KV cache at the mean context) over the
                 machine's measured copy bandwidth: the fastest a step can be; each engine's batch-1
                 rate as a fraction of it (llama.cpp's from its GGUF file's bytes)
    speculative  (--speculative CONFIG, repeatable) plain decoding against speculative decoding on the
                 same requests (--speculative-prompts, EOS honoured, greedy) at batch 1 and 4: each
                 one's output tok/s (best of 3, alternated), the ratio, whether the text is identical,
                 the acceptance rate and mean accepted length
Peers run in venvs of their own (scripts/peer_env.sh vllm | llamacpp): vLLM's CPU build reads the
same HF directory or qtk checkpoint; llama.cpp reads a GGUF (the bundled Q4_1 file by default),
its batch-1 figure is the 4-bit CPU anchor. Every engine computes on torch's thread count (vLLM's
worker OpenMP threads bound to that many CPUs, llama.cpp's n_threads). A peer that refuses the
model is recorded with its own reason. Writes JSON (command, commit, CPU, versions, date,
figures) and prints a table.
"""
from __future__ import annotations

import datetime
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..device import choose_dtype, cpu_name
from ..errors import InputError, NotFoundError
from ..kernels import cpu as cpu_kernels
from . import git_commit
from .prompts import PromptSet, token_prompts

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


def text_prompt(tokenizer, length: int) -> list[int]:
    """`length` tokens of the built-in evaluation text (the batch-1 prompt)."""
    from ..data import load_texts, token_stream

    return token_stream(tokenizer, load_texts("builtin", "evaluation"))[:length].tolist()


# -- qtk -------------------------------------------------------------------------------------------
def qtk_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    from ..runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t


STARTUP = """
import time; t0 = time.perf_counter()
import json, sys
from qtk import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[2], **json.loads(sys.argv[4]))
llm.generate([json.loads(sys.argv[3])], SamplingParams(max_tokens=1))
print(json.dumps({"startup_s": time.perf_counter() - t0}))
"""


def qtk_startup(model: str, dtype: str, prompt: list[int], engine_args: dict) -> float:
    out = subprocess.run([sys.executable, "-c", STARTUP, model, dtype, json.dumps(prompt), json.dumps(engine_args)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["startup_s"]


# -- transformers ----------------------------------------------------------------------------------
@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_tokens: int, batch: int, pad_id: int) -> tuple[int, float]:
    """Greedy, EOS ignored (min_new_tokens), `batch` prompts at a time, left-padded."""
    tokens, t = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(map(len, group))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=model.device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad_id)
        tokens += (out.shape[1] - width) * len(group)
    return tokens, time.perf_counter() - t


# -- peers -----------------------------------------------------------------------------------------
def run_peer(kind: str, script: str, job: dict, timeout: int = 1800) -> dict:
    """Run benchmarks/<script> in the peer's venv on `job`; its JSON result (or {"error": why})."""
    path = REPO / "benchmarks" / script
    if not path.is_file():
        raise NotFoundError(f"{path} is missing: `qtk bench engine --peer` runs from a qtk checkout")
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        t = time.perf_counter()
        proc = subprocess.run(["bash", str(REPO / "scripts" / "peer_env.sh"), kind, str(path), str(job_file),
                               str(out_file)], capture_output=True, text=True, timeout=timeout)
        if not out_file.is_file():
            return {"error": f"{kind} peer exited {proc.returncode}: {proc.stderr[-2000:]}"}
        result = json.loads(out_file.read_text())
        result["wall_s"] = time.perf_counter() - t
        if "error" in result:  # vLLM's workers print the root cause; its front end only says they failed
            result["error"] = "; ".join(dict.fromkeys([*root_causes(proc.stderr), result["error"]]))
        return result


def root_causes(stderr: str) -> list[str]:
    """The errors a peer's worker processes printed: the last few "...Error: message" lines and,
    where torch.compile traced the failing code, Dynamo's "raised exception X()" with the line of
    user code that raised it (Dynamo drops the exception's message)."""
    lines = [line.strip() for line in stderr.splitlines()]
    causes = [line for line in lines if "Error:" in line or "error:" in line][-3:]
    for i, line in enumerate(lines):
        if line.startswith("Developer debug context: raised exception") and "from user code:" in lines[i:]:
            code = []
            for src in lines[lines.index("from user code:", i) + 1:]:
                if src.startswith("Set TORCHDYNAMO_VERBOSE"):
                    break
                if src and not src.startswith(("File ", "^")):
                    code.append(src)
            if code:
                causes.insert(0, f"{line.rsplit(' ', 1)[-1]} raised at `{code[-1]}`")
    return causes


def rate(tokens: int, seconds: float) -> dict:
    return {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2)}


# -- roofline --------------------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 1 << 29, repeats: int = 7) -> float:
    """Bytes per second a large tensor copy moves (read + written, STREAM's copy convention), the median
    of `repeats` after a first copy that faults the destination's pages in, on torch's threads. The median,
    not the best: on a shared VM one copy in a few ran at 1.5-1.8x the others (a 2-core Zen 4 VM: 30-36
    GB/s most of the time, single copies at 50-55), which made the limit a burst's."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def checkpoint_step_bytes(path: Path, float_bytes: int) -> int:
    """The bytes a decode step reads of a checkpoint's weights: each tensor once (quantized ones as
    stored, float ones at `float_bytes` per element), the input embedding table not at all (a step
    reads one row of it) unless it is also the output layer (tied)."""
    from safetensors import safe_open

    tied = json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False)
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                t = f.get_slice(name)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                dtype = t.get_dtype()
                size = float_bytes if dtype in ("F32", "BF16", "F16") else {"I32": 4, "I8": 1, "U8": 1,
                                                                          "F8_E4M3": 1, "I64": 8}.get(dtype, 4)
                total += numel * size
    return total


def roofline(llm, model: str, batch1_rate: dict, context: int, bandwidth: float) -> dict:
    """qtk's batch-1 decode against the limit: bytes per step (weights + KV at `context` tokens),
    the limit in tok/s, and the fraction of it reached."""
    from ..loading import resolve
    from ..runtime.model_runner import kv_bytes_per_token
    from ..runtime.packed_linear import steps_in_bf16

    m = llm.model
    float_bytes = 2 if llm.dtype != torch.float32 or steps_in_bf16(m) else 4
    weights = checkpoint_step_bytes(resolve(model), float_bytes)
    kv = kv_bytes_per_token(m, llm.kv_dtype) * context
    return {**limit_row(weights, kv, batch1_rate["tok_s"], bandwidth),
            "kv_elements_per_token": 2 * len(m.attentions) * m.num_kv_heads * m.head_dim}


def limit_row(weights: int, kv: int, tok_s: float, bandwidth: float) -> dict:
    limit = bandwidth / (weights + kv)
    return {"weight_bytes": weights, "kv_bytes": kv, "limit_tok_s": round(limit, 1),
            "fraction": round(tok_s / limit, 3)}


# -- speculative decoding --------------------------------------------------------------------------
def speculative(model: str, dtype: str, engine_args: dict, configs: list[dict], prompts: list[list[int]],
                max_tokens: int, batches: tuple[int, ...] = (1, 4), rounds: int = 3) -> list[dict]:
    """Plain decoding against each speculative config on the same requests (greedy, EOS honoured), at
    each batch size: tok/s of each (best of `rounds`, alternated), the speed-up, identical text or not,
    acceptance rate and mean accepted length. Every batch size runs the same requests, the first
    max(batches) prompts, b at a time (batch 1: one after another; a single short answer is no measure)."""
    from ..runtime.engine import LLM
    from ..runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    plain = LLM(model, dtype=dtype, **engine_args)
    plain.generate(prompts[:1], SamplingParams(max_tokens=8))
    rows = []
    for config in configs:
        spec = LLM(model, dtype=dtype, speculative_config=config, **engine_args)
        spec.generate(prompts[:1], SamplingParams(max_tokens=8))
        row = {"config": config, "batches": {}}
        for b in batches:
            requests = prompts[:max(batches)]
            groups = [requests[i:i + b] for i in range(0, len(requests), b)]
            best, texts = {}, {}
            before = spec.stats().spec_decode
            for _ in range(rounds):
                for name, llm in (("plain", plain), ("speculative", spec)):
                    t = time.perf_counter()
                    outs = [o for group in groups for o in llm.generate(group, params)]
                    seconds = time.perf_counter() - t
                    texts[name] = [o.outputs[0].token_ids for o in outs]
                    r = rate(sum(map(len, texts[name])), seconds)
                    if name not in best or r["tok_s"] > best[name]["tok_s"]:
                        best[name] = r
            after = spec.stats().spec_decode
            drafts = after.num_drafts - before.num_drafts
            kept = after.num_accepted_tokens - before.num_accepted_tokens
            proposed = after.num_draft_tokens - before.num_draft_tokens
            row["batches"][str(b)] = {
                **best, "speedup": round(best["speculative"]["tok_s"] / best["plain"]["tok_s"], 2),
                "identical": texts["plain"] == texts["speculative"],
                "acceptance_rate": round(kept / proposed, 3) if proposed else None,
                "mean_accepted_length": round(1 + kept / drafts, 2) if drafts else None}
        rows.append(row)
        del spec
    return rows


def run(model: str, num_prompts: int = 64, output_len: int = 128, batch1_input_len: int = 128,
        batch1_output_len: int = 256, dtype: str = "auto", peers: tuple[str, ...] = ("transformers",),
        sequential: int = 16, gguf: str | None = None, out: str | Path = "benchmarks/results",
        name: str | None = None, device: str = "cpu", enforce_eager: bool = False,
        command: str | None = None, prompt_set: str = "builtin", speculative_configs: tuple[dict, ...] = (),
        speculative_prompts: str = "builtin", speculative_output_len: int = 256) -> tuple[dict, str]:
    """device: where qtk and transformers run (vLLM's CPU build and llama.cpp are CPU peers);
    enforce_eager: qtk without its CUDA graphs; command: the command line the JSON records;
    prompt_set: the throughput requests' prompts (bench/prompts.py; num_prompts 0: no throughput);
    speculative_configs: speculative decoding configs to run against plain decoding, on
    speculative_prompts (a prompt set) with speculative_output_len tokens at most."""
    from ..loading import bundled_gguf, load_model, resolve
    from ..runtime.engine import LLM

    if num_prompts < 0 or output_len < 1:
        raise InputError("--num-prompts must be at least 0 and --output-len at least 1")
    spec = PromptSet.parse(prompt_set)
    spec_prompts = PromptSet.parse(speculative_prompts, "--speculative-prompts")
    cpu_peers = [p for p in peers if p in ("vllm", "llama.cpp")]
    if torch.device(device).type != "cpu" and cpu_peers:
        raise InputError(f"--peer {' '.join(cpu_peers)}: these peers run on the CPU here; bench them with --device cpu")
    torch_dtype = choose_dtype(dtype, device, kernels_built=cpu_kernels.built).dtype
    dtype_name = str(torch_dtype).removeprefix("torch.")
    engine_args = {"device": device, "enforce_eager": enforce_eager}
    llm = LLM(model, dtype=dtype_name, **engine_args)
    prompts = token_prompts(llm.tokenizer, spec, num_prompts)
    batch1 = text_prompt(llm.tokenizer, batch1_input_len)
    res: dict = {"model": model, "dtype": dtype_name, "num_prompts": num_prompts, "prompts": str(spec),
                 "prompt_tokens": sum(map(len, prompts)), "output_len": output_len,
                 "batch1": {"input_len": batch1_input_len, "output_len": batch1_output_len}, "engines": {}}

    log.info("qtk: warm-up, throughput, batch 1, start-up")
    qtk_generate(llm, prompts[:16] or [batch1], 8)
    q = res["engines"]["qtk"] = {"batch1": rate(*qtk_generate(llm, [batch1], batch1_output_len))}
    if prompts:
        q["throughput"] = rate(*qtk_generate(llm, prompts, output_len))
    bandwidth = copy_bandwidth()
    context = batch1_input_len + batch1_output_len // 2  # the mean context of the batch-1 decode
    res["roofline"] = {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 2), "context": context,
                       "qtk": roofline(llm, model, q["batch1"], context, bandwidth)}
    spec_requests = token_prompts(llm.tokenizer, spec_prompts, 4) if speculative_configs else []
    del llm
    q["startup_s"] = round(qtk_startup(model, dtype_name, (prompts or [batch1])[0], engine_args), 2)
    if speculative_configs:
        log.info("speculative decoding against plain decoding, batch 1 and 4 (%s)", spec_prompts)
        res["speculative"] = {"prompts": str(spec_prompts), "max_tokens": speculative_output_len,
                              "runs": speculative(model, dtype_name, engine_args, list(speculative_configs),
                                                  spec_requests, speculative_output_len)}

    if "transformers" in peers and prompts:
        log.info("transformers: one request at a time (%d), static batches of 16 (%d)", sequential, num_prompts)
        hf, tok = load_model(model, dtype=torch_dtype, device=device)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        hf_generate(hf, prompts[:2], 8, 2, pad)  # warm-up
        res["engines"]["transformers"] = {
            "sequential": {**rate(*hf_generate(hf, prompts[:sequential], output_len, 1, pad)),
                           "requests": len(prompts[:sequential])},
            "static_16": rate(*hf_generate(hf, prompts, output_len, 16, pad)),
            "batch1": rate(*hf_generate(hf, [batch1], batch1_output_len, 1, pad))}
        del hf

    if "vllm" in peers and prompts:
        log.info("vLLM (CPU build, own venv): start-up, throughput, batch 1")
        longest = max(map(len, prompts)) + output_len
        job = {"model": str(resolve(model)), "dtype": dtype_name, "max_model_len": max(2048, longest),
               "threads": torch.get_num_threads(), "tasks": [
            {"kind": "generate", "name": "warmup", "prompts": prompts[:min(16, num_prompts)], "max_tokens": 8,
             "ignore_eos": True},
            {"kind": "generate", "name": "throughput", "prompts": prompts, "max_tokens": output_len, "ignore_eos": True},
            {"kind": "generate", "name": "batch1", "prompts": [batch1], "max_tokens": batch1_output_len,
             "ignore_eos": True}]}
        v = run_peer("vllm", "vllm_peer.py", job)
        res["engines"]["vllm"] = v if "error" in v else {
            "throughput": rate(v["tasks"]["throughput"]["tokens"], v["tasks"]["throughput"]["seconds"]),
            "batch1": rate(v["tasks"]["batch1"]["tokens"], v["tasks"]["batch1"]["seconds"]),
            "startup_s": round(v["startup_s"], 2), "omp_threads_bind": v.get("omp_threads_bind")}

    if "llama.cpp" in peers:
        gguf_path = str(gguf or bundled_gguf())
        log.info("llama.cpp (own venv) on %s: batch 1", gguf_path)
        v = run_peer("llamacpp", "llamacpp_peer.py", {"gguf": gguf_path, "prompt": batch1,
                                                       "max_tokens": batch1_output_len,
                                                       "threads": torch.get_num_threads()})
        res["engines"]["llama.cpp"] = v if "error" in v else {"gguf": gguf_path, "threads": v.get("threads"),
                                                              "batch1": rate(v["tokens"], v["seconds"])}
        if "error" not in v:  # its weights: the GGUF file; its KV cache: float16 at the same context
            kv = res["roofline"]["qtk"]["kv_elements_per_token"] * 2 * context
            res["roofline"]["llama.cpp"] = limit_row(Path(gguf_path).stat().st_size, kv,
                                                     res["engines"]["llama.cpp"]["batch1"]["tok_s"], bandwidth)
    res["qtk_engine_args"] = engine_args
    return record(res, out, name, command), summary(res)


def record(res: dict, out: str | Path, name: str | None, command: str | None) -> dict:
    """Add the run's provenance (command line, commit, date, device, versions) to `res` and write it
    to OUT/NAME.json."""
    res.update(command=command, commit=git_commit(), date=datetime.datetime.now().isoformat(),
               device=_device_name(res.get("qtk_engine_args", {}).get("device", "cpu")), cpu_capability=torch.backends.cpu.get_cpu_capability(),
               threads=torch.get_num_threads(), torch=torch.__version__)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (name or f"engine-{Path(res['model']).name}-{res['dtype']}").removesuffix(".json")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    return res


def summary(res: dict) -> str:
    lines = [f"{res['model']} ({res['dtype']}, {res.get('device')}, {res.get('threads')} threads)",
             f"{'engine':<24}{'throughput tok/s':>18}{'batch-1 tok/s':>15}{'start-up s':>12}"]
    for engine, r in res["engines"].items():
        if "error" in r:
            lines.append(f"{engine:<24}refused: {r['error'][:200]}")
            continue
        rows = [(engine, r.get("throughput"), r.get("batch1"), r.get("startup_s"))]
        if engine == "transformers":
            rows = [("transformers 1 at a time", r["sequential"], r["batch1"], None),
                    ("transformers batch 16", r["static_16"], None, None)]
        for label, thr, b1, st in rows:
            cell = lambda x: f"{x['tok_s']:.1f}" if x else "-"  # noqa: E731
            lines.append(f"{label:<24}{cell(thr):>18}{cell(b1):>15}{(f'{st:.1f}' if st else '-'):>12}")
    roof = res.get("roofline")
    if roof:
        lines.append(f"\nbatch-1 roofline: copy bandwidth {roof['copy_bandwidth_gb_s']} GB/s, context {roof['context']}")
        lines.append(f"{'engine':<24}{'MB per step':>14}{'limit tok/s':>14}{'fraction':>10}")
        for engine in ("qtk", "llama.cpp"):
            if engine in roof:
                r = roof[engine]
                lines.append(f"{engine:<24}{(r['weight_bytes'] + r['kv_bytes']) / 1e6:>14.1f}{r['limit_tok_s']:>14.1f}"
                             f"{r['fraction']:>10.2f}")
    spec = res.get("speculative")
    if spec:
        lines.append(f"\nspeculative decoding ({spec['prompts']} prompts, greedy, up to {spec['max_tokens']} tokens)")
        lines.append(f"{'config':<48}{'batch':>6}{'plain':>8}{'spec':>8}{'x':>6}{'same':>6}{'accept':>8}{'len':>6}")
        for run_ in spec["runs"]:
            label = json.dumps(run_["config"], separators=(",", ":"))[:47]
            for b, r in run_["batches"].items():
                acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
                mal = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
                lines.append(f"{label:<48}{b:>6}{r['plain']['tok_s']:>8.1f}{r['speculative']['tok_s']:>8.1f}"
                             f"{r['speedup']:>6.2f}{('yes' if r['identical'] else 'NO'):>6}{acc:>8}{mal:>6}")
    return "\n".join(lines)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else cpu_name()
