"""ModelRunner: owns the KV cache tensors, turns a scheduled Batch into one packed forward, returns
the logits of the sequences that sample this step."""
from __future__ import annotations

import torch

from .attention import AttentionMetadata, PrefillChunk
from .sampler import logprob_entry
from .scheduler import Batch
from .sequence import Sequence


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * len(model.layers) * model.num_kv_heads * model.head_dim * elem


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu"):
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        kv_dtype = kv_dtype or model.dtype
        shape = (num_blocks * block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=kv_dtype, device=self.device)) for _ in model.layers]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            for k, v in self.kv_caches:
                k[dst * bs:(dst + 1) * bs] = k[src * bs:(src + 1) * bs]
                v[dst * bs:(dst + 1) * bs] = v[src * bs:(src + 1) * bs]

    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Cache slots of seq's positions [start, end)."""
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(input_ids [T], positions [T], attention metadata, packed index of each sampling token)."""
        ids, positions, slot_mapping, sample_index = [], [], [], []
        decode_index, decode_slots, prefills = [], [], []
        t = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.append(torch.arange(start, start + n))
            context = self.slots(seq, 0, start + n)
            slot_mapping.append(context[start:])
            if n == 1:
                decode_index.append(t)
                decode_slots.append(context)
            else:
                prefills.append(PrefillChunk(t, n, context.to(self.device)))
            t += n
            if batch.samples(i):
                sample_index.append(t - 1)
        longest = max((s.numel() for s in decode_slots), default=0)
        padded = torch.zeros(len(decode_slots), longest, dtype=torch.long)
        mask = torch.zeros(len(decode_slots), longest, dtype=torch.bool)
        for j, s in enumerate(decode_slots):
            padded[j, :s.numel()] = s
            mask[j, :s.numel()] = True
        dev = self.device
        meta = AttentionMetadata(torch.cat(slot_mapping).to(dev), torch.tensor(decode_index, dtype=torch.long, device=dev),
                                 padded.to(dev), mask.to(dev), prefills)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.cat(positions).to(dev), meta, sample_index)

    @torch.inference_mode()
    def run(self, batch: Batch) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(logits [number of sampling sequences, vocab] in float32, in batch order;
        seq_id -> final hidden states [n, hidden] of the prompt tokens this step computed, for
        the sequences that asked for prompt logprobs)."""
        self.copy_blocks(batch.copies)
        ids, positions, meta, sample_index = self.prepare(batch)
        hidden = self.model(ids, positions, meta, self.kv_caches)
        prompt_hidden, t = {}, 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.params.prompt_logprobs is not None and seq.is_prefill:
                prompt_hidden[seq.seq_id] = hidden[t:t + n]
            t += n
        return self.model.logits(hidden[torch.tensor(sample_index, dtype=torch.long, device=self.device)]), prompt_hidden

    @torch.inference_mode()
    def prompt_logprobs(self, seq, hidden: torch.Tensor, top: int, chunk: int = 256) -> list[dict[int, float]]:
        """For prompt positions computed from seq.num_computed_tokens on (hidden [n, hidden]): the
        logprob of each next prompt token (and the top ones), in chunks of `chunk` tokens."""
        start = seq.num_computed_tokens
        targets = seq.token_ids[start + 1:min(start + 1 + hidden.shape[0], seq.num_prompt_tokens)]
        out = []
        for i in range(0, len(targets), chunk):
            lp = self.model.logits(hidden[i:i + chunk][:len(targets) - i]).log_softmax(-1)
            out.extend(logprob_entry(row, target, top) for row, target in zip(lp, targets[i:i + chunk]))
        return out
