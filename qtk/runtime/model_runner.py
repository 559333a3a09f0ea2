"""ModelRunner: owns the KV cache tensors, turns a scheduled Batch into one packed forward, returns
the logits of the sequences that sample this step.

For the engine (ModelRunner.for_engine) it also makes the cache: its dtype and FP8 / INT8 scales
(the checkpoint's, or measured at load), its size from the memory it may take, then the weights
repacked for the kernels and the decode steps captured in CUDA graphs.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from ..errors import InputError
from ..kernels import cpu as cpu_kernels
from ..kernels.dispatch import prepare
from ..kernels.fp8 import fp8_supported
from ..kv_scales import cache_scheme, grid_absmax, kv_scale
from .attention import KV_DTYPES, SCALED_KV, AttentionMetadata, KVCache, PrefillChunk
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs, Record, capture_sizes, cuda_record
from .packed_linear import kernel_weights, numerics_of, steps_in_bf16
from .sampler import logprob_entry
from .scheduler import Batch
from .sequence import Sequence

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * len(model.attentions) * model.num_kv_heads * model.head_dim * elem


@torch.inference_mode()
def measure_kv_scales(model, ids: list[int], dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_scale, v_scale) [kv_heads, 1, 1] float32 of K (after RoPE) and V over the prompt
    `ids`, read from a float cache that its prefill filled: kv_scale of their absmax, the formula of
    calibrated checkpoints (absmax / 448 for fp8, absmax / 127.5 for int8)."""
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    runner = ModelRunner(model, num_blocks, block_size, device=device)
    seq = Sequence(ids, block_size=block_size)
    seq.block_table = list(range(num_blocks))
    runner.run(Batch([seq], [len(ids)]))
    kv = cache_scheme(dtype)
    # cache [kv_heads, slots, D] -> absmax [kv_heads, 1, 1]
    return [tuple(kv_scale(t.float().abs().amax(dim=(1, 2)).view(-1, 1, 1), kv) for t in (c.k, c.v))
            for c in runner.kv_caches]


def kv_cache_spec(model, kv_cache_dtype: str, dtype: torch.dtype, device, tokenizer) -> tuple[torch.dtype, list | None]:
    """(cache dtype, per layer (k_scale, v_scale) float32 [kv_heads | 1, 1, 1] for FP8 / INT8).
    As vLLM: "auto" is the model dtype, and a bf16 checkpoint's is bf16: so where qtk's float32
    runtime runs its steps in bf16 (packed_linear.steps_in_bf16: a bf16 checkpoint, float or quantized,
    on a CPU with bf16 units), its cache is bf16 too, half the bytes a decode step reads (decode steps of 16 sequences
    over 1024-token contexts: 69.5 -> 54.7 ms on a 2-core Zen 4); QTK_CPU_BF16=0 keeps float32
    throughout. fp8 / int8 take the checkpoint's calibrated scales (rescaled to the asked grid when
    the checkpoint calibrated the other one), or scales measured at load on built-in text, with a
    warning."""
    if kv_cache_dtype == "auto":
        if dtype == torch.float32 and torch.device(device).type == "cpu" and steps_in_bf16(model):
            return torch.bfloat16, None
        return dtype, None
    kv_dtype = KV_DTYPES[kv_cache_dtype]
    if kv_dtype not in SCALED_KV:  # a float cache (bfloat16): no scales
        return kv_dtype, None
    cuda = torch.device(device).type == "cuda"
    if kv_cache_dtype == "fp8" and cuda and not fp8_supported(torch.device(device)):
        raise InputError("kv_cache_dtype fp8 on CUDA needs a GPU with FP8 support (compute capability 8.9+: "
                         "Ada, Hopper); use kv_cache_dtype int8 on this one")
    attns = model.attentions
    if all(hasattr(a, "k_scale") and hasattr(a, "kv_scheme") for a in attns):
        scales, asked = [], grid_absmax(cache_scheme(kv_dtype))
        for a in attns:
            rescale = grid_absmax(a.kv_scheme) / asked  # absmax = scale * grid_absmax on either grid
            scales.append(tuple((getattr(a, n).float() * rescale).reshape(-1, 1, 1).to(device)
                                for n in ("k_scale", "v_scale")))
        return kv_dtype, scales
    log.warning("the checkpoint has no KV-cache scales: measuring them on built-in text at load; "
                "calibrated ones are better (qtk quantize --kv-cache %s)", kv_cache_dtype)
    from ..data import builtin_texts, token_stream

    ids = token_stream(tokenizer, builtin_texts("calibration"))[:512].tolist()
    return kv_dtype, measure_kv_scales(model, ids, kv_dtype, device)


def default_kv_memory(device, utilization: float) -> int:
    """CPU: 2 GiB. CUDA: what remains of utilization x the device's memory once the weights
    are loaded, less a margin for the step's activations (vLLM's gpu_memory_utilization)."""
    if torch.device(device).type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    activations = 2 * 2**30
    left = int(utilization * total) - used - activations
    if left <= 0:
        raise InputError(f"gpu_memory_utilization {utilization} leaves no room for a KV cache "
                         f"({used / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB); raise it")
    return left


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None,
                 kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 device: torch.device | str = "cpu", attention_backend: str | None = None):
        """kv_scales: per layer (k_scale, v_scale) for an FP8 / INT8 cache (kv_dtype);
        attention_backend: "triton" (the default on CUDA), "cpu" (qtk's C++ ops: the default on
        CPU for a float32 model where they are built) or "torch"."""
        self.model = model
        if hasattr(model, "drop_decode_layers"):  # the model's one-call decode step held another runner's caches
            model.drop_decode_layers()
        self.block_size = block_size
        self.device = torch.device(device)
        self.attention_backend = attention_backend or (
            "triton" if self.device.type == "cuda" else "cpu" if model.cpu_ops is not None else "torch")
        kv_dtype = self.kv_dtype = kv_dtype or model.dtype
        self.num_blocks = num_blocks
        shape = (model.num_kv_heads, num_blocks * block_size, model.head_dim)
        self.kv_caches = []
        for i in range(len(model.attentions)):
            k_scale, v_scale = kv_scales[i] if kv_scales else (None, None)
            self.kv_caches.append(KVCache(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                                          torch.zeros(shape, dtype=kv_dtype, device=self.device), k_scale, v_scale))
        self.graphs: DecodeGraphs | None = None
        self.graphs_status = "not captured"  # what the engine's start-up log says of them

    @classmethod
    def for_engine(cls, model, config: EngineConfig, dtype: torch.dtype, max_model_len: int,
                   tokenizer) -> ModelRunner:
        """The engine's runner over `model` (loaded in `dtype`): the KV cache's dtype and scales,
        as many blocks as its memory holds (InputError if fewer than max_model_len tokens), the
        weights prepared for the kernels, the decode steps captured in CUDA graphs."""
        device, block_size = config.device, config.block_size
        kv_dtype, kv_scales = kv_cache_spec(model, config.kv_cache_dtype, dtype, device, tokenizer)
        per_token = kv_bytes_per_token(model, kv_dtype)
        memory = config.kv_cache_memory or default_kv_memory(device, config.gpu_memory_utilization)
        num_blocks = memory // (per_token * block_size)
        if num_blocks * block_size < max_model_len:
            raise InputError(f"the KV cache ({memory} bytes, {per_token} per token) holds "
                             f"{num_blocks * block_size} tokens, fewer than max_model_len {max_model_len}: "
                             "raise kv_cache_memory or lower max_model_len")
        runner = cls(model, num_blocks, block_size, kv_dtype, kv_scales, device=device)
        prepare(model, device, dtype)  # decode and repack the weights now, not at the first step
        if runner.device.type == "cpu":
            moved = cpu_kernels.onto_huge_pages(kernel_weights(model))
            log.debug("%.1f MB of kernel weights on 2 MB pages", moved / 1e6)
        runner.graphs_status = ("off (enforce_eager)" if config.enforce_eager else
                                "none (CPU)" if runner.device.type != "cuda" else
                                runner.try_capture_graphs(config.max_num_seqs, max_model_len))
        return runner

    def try_capture_graphs(self, max_num_seqs: int, max_model_len: int) -> str:
        """Capture the decode steps' CUDA graphs -> what the start-up log says of them. A failed
        capture is an optimization lost, not an engine lost: it warns and the steps run eagerly."""
        try:
            why = self.capture_graphs(max_num_seqs, max_model_len)
        except Exception as e:
            self.graphs = None
            log.warning("capturing the decode steps in CUDA graphs failed (%s: %s); every step runs eagerly "
                        "(--enforce-eager skips the capture)", type(e).__name__, e)
            return "off: the capture failed"
        return f"off: {why}" if why else f"decode batch sizes up to {self.graphs.max_batch}"

    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, max_model_len: int, record: Record = cuda_record) -> str | None:
        """Capture the decode step in CUDA graphs (cuda_graphs.py) -> None, or why it cannot be."""
        why = self._why_no_graphs(max_model_len)
        if why is None:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_model_len,
                                       capture_sizes(max_num_seqs), self.device, record)
        return why

    def _why_no_graphs(self, max_model_len: int) -> str | None:
        if self.model.why_no_graphs:
            return self.model.why_no_graphs
        if self.attention_backend != "triton":
            return f"attention backend {self.attention_backend!r} (the graphs replay the Triton kernels)"
        window = min((w for w in self.model.windows if w is not None), default=None)
        if window is not None and window < max_model_len:  # a graph's step would run the kernels, which have none
            return f"sliding window {window} < max_model_len {max_model_len} (windowed steps run in torch)"
        return None  # RoPE of every scaling type is fixed at load (models/native.py frozen_rope): capturable

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            for cache in self.kv_caches:
                for t in (cache.k, cache.v):
                    t[:, dst * bs:(dst + 1) * bs] = t[:, src * bs:(src + 1) * bs]

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Cache slots of seq's positions [start, end)."""
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(input_ids [T], positions [T], attention metadata, packed index of each sampled position).
        Decodes cost a few list operations each; a prefill chunk a few tensor operations."""
        ids, positions, slot_mapping, sample_index = [], [], [], []
        decode_index, tables, lens, prefills = [], [], [], []
        t = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed_tokens
            if n == 1:
                ids.append(seq.token_ids[start])
                positions.append(start)
                slot_mapping.append(self.slot(seq, start))
                decode_index.append(t)
                tables.append(seq.block_table)
                lens.append(start + 1)
            elif self.device.type == "cpu" and seq.spec_token_ids and n == 1 + len(seq.spec_token_ids):
                # a decode with drafts to verify, on a CPU: each token a decode of its own over the same block
                # table, attending as plain decoding's step would (the decode kernel, not the prefill one)
                ids.extend(seq.step_token_ids(start, n))
                for j in range(n):
                    positions.append(start + j)
                    slot_mapping.append(self.slot(seq, start + j))
                    decode_index.append(t + j)
                    tables.append(seq.block_table)
                    lens.append(start + j + 1)
            else:  # a prompt chunk, or a decode with drafts to verify on a GPU (causal over the chunk, as a prefill)
                ids.extend(seq.step_token_ids(start, n))
                positions.extend(range(start, start + n))
                context = self.slots(seq, 0, start + n)
                slot_mapping.extend(context[start:].tolist())
                prefills.append(PrefillChunk(t, n, context.to(self.device), seq.block_table))
            t += n
            if batch.samples(i):  # the last token's logits, and each draft's before them
                sample_index.extend(range(t - 1 - len(seq.spec_token_ids), t))
        width = max(map(len, tables), default=0)
        block_tables = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.long)
        mask = torch.arange(width * self.block_size)[None, :] < torch.tensor(lens, dtype=torch.long)[:, None]
        dev = self.device
        meta = AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=dev),
                                 torch.tensor(decode_index, dtype=torch.long, device=dev),
                                 block_tables.reshape(len(tables), width).to(dev), mask.to(dev), prefills,
                                 self.block_size, torch.tensor(lens, dtype=torch.long, device=dev),
                                 self.attention_backend, max(lens + [p.slots.numel() for p in prefills], default=0))
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, sample_index)

    @torch.inference_mode()
    def run(self, batch: Batch) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(logits [sampled positions, vocab] in float32, in batch order: one row per sampling
        sequence, 1 + len(drafts) for one that verifies drafts;
        seq_id -> final hidden states [n, hidden] of the prompt tokens this step computed, for
        the sequences that score their prompt: Sequence.scores_prompt)."""
        self.copy_blocks(batch.copies)
        ids, positions, meta, sample_index = self.prepare(batch)
        drafts = sum(len(seq.spec_token_ids) for seq in batch.seqs)
        if self.graphs is not None and not meta.prefills and len(batch.seqs) <= self.graphs.max_batch:
            hidden = self.graphs.run(ids, positions, meta)
        elif drafts:  # each token computed as plain decoding's step would (its kernels chosen by its rows)
            with numerics_of(len(ids) - drafts):
                hidden = self.model(ids, positions, meta, self.kv_caches)
        else:
            hidden = self.model(ids, positions, meta, self.kv_caches)
        prompt_hidden, t = {}, 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.scores_prompt and seq.is_prefill:
                prompt_hidden[seq.seq_id] = hidden[t:t + n]
            t += n
        sampled = hidden[torch.tensor(sample_index, dtype=torch.long, device=self.device)]
        with numerics_of(len(sample_index) - drafts) if drafts else contextlib.nullcontext():
            return self.model.logits(sampled), prompt_hidden

    @torch.inference_mode()
    def prompt_logprobs(self, seq, hidden: torch.Tensor, top: int) -> list[dict[int, float]]:
        """For prompt positions computed from seq.num_computed_tokens on (hidden [n, hidden]): the
        logprob of each next prompt token (and the top ones)."""
        return [logprob_entry(row, target, top) for lp, targets in self.prompt_log_softmax(seq, hidden)
                for row, target in zip(lp, targets)]

    @torch.inference_mode()
    def prompt_log_softmax(self, seq, hidden: torch.Tensor, chunk: int = 256):
        """(log-softmax rows [m, vocab] float32, the next prompt tokens [m]) for the positions
        computed from seq.num_computed_tokens on (hidden [n, hidden]), in chunks of `chunk` rows
        (the last prompt token has no next one)."""
        start = seq.num_computed_tokens
        targets = seq.token_ids[start + 1:min(start + 1 + hidden.shape[0], seq.num_prompt_tokens)]
        for i in range(0, len(targets), chunk):
            yield self.model.logits(hidden[i:i + chunk][:len(targets) - i]).log_softmax(-1), targets[i:i + chunk]
