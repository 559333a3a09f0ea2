"""Calibration text the model writes itself (`--dataset self`): offline, always available, and in
the model's own distribution (LLM-QAT's data-free samples, Liu et al. 2023; the chat form here).

Each sample starts where the model's chat template opens a user turn (or at BOS without a
template), so the model writes a user's message, ends the turn, answers it, and goes on, as in its
own chats; sampled through qtk's runtime at temperature 1 with top-p 0.95, each request with its
own seed (calibration seed x 100003 + its index), end-of-sequence ignored, until the sample is
seq_len tokens. `builtin+self` (any sources joined by +) splits the samples evenly between them.
"""
from __future__ import annotations

import logging
import time

import torch

from .chat_template import has_template, render
from .errors import InputError
from .runtime.config import EngineConfig
from .runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

SENTINEL = "\x00qtk\x00"
TOP_P = 0.95


def turn_opening(tokenizer) -> list[int]:
    """The token ids that open a user turn in the chat template (BOS alone without one)."""
    if not has_template(tokenizer):
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None:
            raise InputError("--dataset self: the tokenizer has neither a chat template nor a BOS or EOS token to "
                             "start the model's text from")
        return [bos]
    text = render(tokenizer, [{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    return tokenizer(text[:text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


def self_generated_ids(model: str, tokenizer, num_samples: int, seq_len: int, seed: int = 0,
                       device: str = "cpu") -> torch.Tensor:
    """[num_samples, seq_len] token ids the model at `model` wrote, each from a user turn's opening."""
    from .runtime.engine import LLM

    start = turn_opening(tokenizer)
    if len(start) >= seq_len:
        raise InputError(f"--dataset self: the chat template's opening is {len(start)} tokens, not shorter than "
                         f"--seq-len {seq_len}")
    t0 = time.perf_counter()
    llm = LLM(config=EngineConfig(model, device=device, max_model_len=seq_len))
    params = [SamplingParams(temperature=1.0, top_p=TOP_P, max_tokens=seq_len - len(start), ignore_eos=True,
                             seed=seed * 100003 + i) for i in range(num_samples)]
    outputs = llm.generate([list(start)] * num_samples, params)
    ids = torch.tensor([start + list(o.outputs[0].token_ids) for o in outputs], dtype=torch.long)
    log.info("calibration: %d samples x %d tokens the model wrote itself in %.0f s (seed %d)", num_samples,
             seq_len, time.perf_counter() - t0, seed)
    return ids
