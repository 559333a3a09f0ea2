"""CUDA graphs of the decode step (vLLM's and nano-vllm's): at batch 1 a step of a small model is
hundreds of kernel launches of a few microseconds each, and the CPU issuing them is the bound.
A graph records them once per batch size and replays them with one call.

A graph replays fixed addresses and shapes, so each captured size B reads its inputs from static
buffers (sliced [:B] of buffers for the largest size) and writes the final hidden states into
one static output:

    input_ids, positions, slot_mapping  [max_batch]
    block_tables                        int32 [max_batch, cdiv(max_model_len, block_size)]
    context_lens                        int32 [max_batch]
    hidden                              [max_batch, hidden_size]

A step of b decodes runs the smallest captured size B >= b. Rows b..B are padding: slot -1 (the
store skips it), context length 0 (attention reads no key and writes zeros), token 0 at position
0; every row of the forward is independent of the others, so the first b rows are the eager
step's. Before each replay every slot and length is reset, or a padding row would keep the slot
of a sequence that decoded in that row a step earlier and overwrite its K/V.

Steps with a prefill chunk, and batches larger than the largest size, run eagerly. Only the
model's forward is captured: the lm_head of the sampling rows, the sampler and the grammar masks
run after it, eagerly (their inputs are per step).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from .attention import AttentionMetadata, KVCache

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512

def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture (nano-vllm's and vLLM's default ladder): 1, 2, 4, 8, then every
    16 up to max_num_seqs (capped at 512), and max_num_seqs itself."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = {s for s in (1, 2, 4, 8) if s <= top} | set(range(16, top + 1, 16)) | {top}
    return sorted(sizes)


Record = Callable[[Callable[[], None], object], tuple[Callable[[], None], object]]


def cuda_record(step: Callable[[], None], pool) -> tuple[Callable[[], None], object]:
    """Capture step() in a CUDA graph sharing `pool` -> (replay, the graph's memory pool). One
    eager run first, on a side stream as torch.cuda.graph asks, compiles the kernels and builds
    the layers' runtimes outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph.replay, graph.pool()


class DecodeGraphs:
    """One captured forward per batch size, replayed for steps of decodes only."""

    def __init__(self, model, kv_caches: list[KVCache], block_size: int, max_model_len: int, sizes: list[int],
                 device: torch.device, record: Record = cuda_record):
        """record: how a step is captured (cuda_record; the tests pass an eager stand-in that runs
        the same step on the same buffers, so the buffer logic runs without a GPU)."""
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        n, width = self.max_batch, -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, width, **i32)
        self.context_lens = torch.zeros(n, **i32)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=model.dtype, device=device)
        self.replays: dict[int, Callable[[], None]] = {}
        t0, pool = time.perf_counter(), None
        for b in reversed(self.sizes):  # the largest first: the smaller ones fit in its memory pool
            self.replays[b], pool = record(self._step(model, kv_caches, block_size, b), pool)
        log.info("CUDA graphs: %d decode batch sizes (1..%d) captured in %.1f s", len(self.sizes), self.max_batch,
                 time.perf_counter() - t0)

    def _step(self, model, kv_caches, block_size: int, b: int) -> Callable[[], None]:
        """The forward of b decodes over the first b rows of the static buffers."""
        meta = AttentionMetadata(self.slot_mapping[:b], torch.arange(b, device=self.hidden.device),
                                 self.block_tables[:b], None, [], block_size, self.context_lens[:b], "triton")

        def step():
            self.hidden[:b] = model(self.input_ids[:b], self.positions[:b], meta, kv_caches)
        return step

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [b, hidden] of a step of b <= max_batch decodes (the eager step's
        inputs: ModelRunner.prepare's)."""
        b = ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        self.input_ids[:b] = ids
        self.positions[:b] = positions
        self.slot_mapping[:b] = meta.slot_mapping
        self.block_tables[:b, :meta.block_tables.shape[1]] = meta.block_tables
        self.context_lens[:b] = meta.decode_lens
        self.replays[size]()
        return self.hidden[:b]
