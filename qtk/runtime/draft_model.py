"""The draft model of speculative decoding: loaded from a path, or the target's own 4-bit twin, and its
proposer (k greedy decode steps on its own paged cache).

    speculative_config = {"model": "build/default"}      # any model qtk runs with the target's tokenizer
    speculative_config = {"model": "self-quantized"}     # the target's weights rounded to int4 at load

The twin: every Linear of the target rounded to nearest on int4 asymmetric groups (w4a16_asym, the group
size the largest power of two up to 128 that divides each layer's input), as `qtk quantize --method rtn`
would write them, and its lm_head too (a checkpoint keeps it in bf16 for the engines that read it; a
draft only has to guess, and on a small model the lm_head is much of what a step reads: SmolLM2-135M's
is 57 of the 125 MB of its default checkpoint), then run on qtk's CPU int4 kernels. RTN costs seconds and
needs no data; a calibrated checkpoint of the same model (`qtk quantize`) agrees with the target on more
tokens and is given by its path.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from ..errors import InputError
from ..methods.rtn import to_quant_linear
from ..quant import quantize_weight
from ..schemes import dividing_group_size, preset
from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner
from .models import build
from .scheduler import Batch
from .sequence import Sequence
from .spec_decode import SELF_QUANTIZED, SpeculativeConfig

log = logging.getLogger(__name__)


def quantized_twin(model: nn.Module) -> nn.Module:
    """model with every nn.Linear (lm_head included; a tied input embedding stays float) replaced, in
    place, by its RTN w4a16_asym QuantLinear."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    group = dividing_group_size({name: m.in_features for name, m in linears.items()}, at_most=128)
    if group is None:
        raise InputError("self-quantized: no int4 group size divides every layer's input size; give a draft "
                         "model's path instead")
    scheme = preset("w4a16_asym", group_size=group)
    for name, linear in linears.items():
        q, scale, zp = quantize_weight(linear.weight.data, scheme.weights)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, to_quant_linear(linear, q, scale, zp, scheme))
    return model


def load_draft(spec: SpeculativeConfig, config: EngineConfig, dtype: torch.dtype, max_model_len: int,
               tokenizer) -> DraftModelProposer:
    """The proposer of spec.model (a path or name, or "self-quantized": the target's twin) in the target's
    dtype and device, with a KV pool of the target's size, no prefix cache; InputError where its
    tokenizer or context differs from the target's."""
    from ..loading import load_model

    name = config.model if spec.model == SELF_QUANTIZED else spec.model
    hf_model, draft_tokenizer = load_model(name, dtype=dtype, device=config.device)
    if spec.model == SELF_QUANTIZED:
        quantized_twin(hf_model)
    elif draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise InputError(f"the draft model {spec.model} has another tokenizer than the target {config.model}; "
                         "a draft must share the target's vocabulary")
    limit = getattr(hf_model.config, "max_position_embeddings", None) or max_model_len
    if limit < max_model_len:
        raise InputError(f"the draft model {spec.model} has a context of {limit} tokens, shorter than the target's "
                         f"max_model_len {max_model_len}; lower max_model_len")
    model = build(hf_model, config.model_impl)
    runner = ModelRunner.for_engine(model, config, dtype, max_model_len, draft_tokenizer)
    log.info("draft model %s: %d KV blocks", spec.model, runner.num_blocks)
    return DraftModelProposer(runner, BlockManager(runner.num_blocks, config.block_size, enable_prefix_caching=False))


class DraftModelProposer:
    """k greedy decode steps of a draft model, on its own paged cache, for every sequence at once.

    Each target sequence has a shadow here: the same tokens, computed in the draft's cache up to where
    they still agree with the target's (after a step, the drafts the target rejected are rolled back,
    their blocks given back). A proposal first computes what the shadow lacks (the prompt the first
    time; then the tokens the target's last step added) and takes the argmax of its last position as
    the first draft; each further draft is one decode step. Drafts are greedy, so the proposer's
    distribution is one-hot: the RejectionSampler's rule for sampled requests keeps the target's
    distribution exactly."""

    def __init__(self, runner, block_manager):
        """runner: the draft model's ModelRunner; block_manager: its pool (prefix caching off: shadows
        hold drafts that may be rolled back)."""
        self.runner = runner
        self.bm = block_manager
        self.shadows: dict[int, Sequence] = {}
        # seconds of a draft decode step (every shadow one token), once measured: a draft's cost when the
        # shadows are in step with their targets (a shadow catching up after steps without drafts pays
        # more once; that is not what drafting every step costs)
        self.step_seconds: float | None = None

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """(target sequence, the most drafts) -> seq_id -> its drafts (fewer, or none, where the draft's
        pool runs dry)."""
        active = [(seq, self._sync(seq), k) for seq, k in wants]
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq, _, _ in active}
        while active:
            batch = Batch()
            for seq, shadow, k in active:
                n = shadow.num_uncomputed_tokens
                if self.bm.allocate_slots(shadow, n):
                    batch.add(shadow, n)
                else:  # no room: this sequence goes on with the drafts it has; its shadow starts over later
                    self.forget(seq)
            if not batch.seqs:
                break
            t = time.perf_counter()
            logits, _ = self.runner.run(batch)
            chosen = logits.argmax(dim=-1).tolist()
            if batch.total_tokens == len(batch):  # a decode step of every shadow: what a draft costs once in step
                seconds = time.perf_counter() - t
                self.step_seconds = seconds if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * seconds
            for shadow, n, token in zip(batch.seqs, batch.num_tokens, chosen):
                shadow.num_computed_tokens += n
                shadow.token_ids.append(token)
            for seq, shadow, _ in active:
                if seq.seq_id in self.shadows:
                    drafts[seq.seq_id] = shadow.token_ids[len(seq):]
            active = [(seq, shadow, k) for seq, shadow, k in active
                      if seq.seq_id in self.shadows and len(drafts[seq.seq_id]) < k]
        return drafts

    def _sync(self, seq: Sequence) -> Sequence:
        """seq's shadow, holding seq's tokens, computed as far as they agree with what it computed."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Sequence(seq.token_ids, block_size=self.bm.block_size)
            return shadow
        old, new = shadow.token_ids, seq.token_ids
        m = min(len(old), len(new), shadow.num_computed_tokens)
        same = np.asarray(old[:m]) == np.asarray(new[:m])
        agree = m if same.all() else int(np.argmin(same))
        shadow.token_ids = list(new)
        shadow.num_computed_tokens = agree
        del shadow.block_hashes[agree // self.bm.block_size:]
        self.bm.trim(shadow)
        return shadow

    def forget(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.bm.free(shadow)
