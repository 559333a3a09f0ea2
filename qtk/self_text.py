"""Calibration text the model writes itself (`--dataset self`): offline, always available, and in
the model's own distribution (LLM-QAT's data-free samples, Liu et al. 2023; the chat form here).

Each sample starts where the model's chat template opens a user turn (or at BOS without a
template), so the model writes a user's message, ends the turn, answers it, and goes on, as in its
own chats; sampled through qtk's runtime at temperature 1 with top-p 0.95, each request with its
own seed (calibration seed x 100003 + its index), end-of-sequence ignored, until the sample is
seq_len tokens. `builtin+self` (any sources joined by +) splits the samples evenly between them.

`--dataset instruct` is the model's answers to instructions put to it: a chat of user turns drawn
from qtk's instruction templates (qtk/assets/corpus/instructions.json: JSON records, lists,
explanations, letters, code, rewrites), each answered by the model at temperature 0.7 with top-p
0.95 (at most 256 tokens, the json task's limit), turn after turn until the sample is seq_len
tokens. The self samples' user turns are the model's own, rarely a request for a structure; these
hold the answers a served model gives to the requests it is given, structured ones included.
"""
from __future__ import annotations

import json
import logging
import random
import time

import torch

from . import assets
from .chat_template import has_template, prompt_ids, render
from .errors import InputError
from .runtime.config import EngineConfig
from .runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

SENTINEL = "\x00qtk\x00"
TOP_P = 0.95
ANSWER_TEMPERATURE = 0.7  # instruct: answers near the greedy ones a gate reads, still varied
MAX_ANSWER = 256


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


def _joined(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def instruction(rng: random.Random, spec: dict) -> str:
    """One instruction: a template of spec["templates"] with its {slots} filled from spec's lists
    ({record} and {fields} from one entry of spec["record"])."""
    record = rng.choice(spec["record"])
    slots = {k: rng.choice(v) for k, v in spec.items() if isinstance(v, list) and k not in ("templates", "record")}
    slots.update(record=record["record"], fields=_joined(record["fields"]))
    return rng.choice(spec["templates"]).format(**slots)


def instructed_ids(model: str, tokenizer, num_samples: int, seq_len: int, seed: int = 0,
                   device: str = "cpu") -> torch.Tensor:
    """[num_samples, seq_len] token ids of chats in which the model at `model` answers instructions
    drawn from qtk's templates, one turn after another until each chat is seq_len tokens long."""
    from .runtime.engine import LLM

    if not has_template(tokenizer):
        raise InputError("--dataset instruct: the tokenizer has no chat template to put instructions in; "
                         "calibrate on self or builtin")
    spec = json.loads(assets.instructions_file().read_text())
    rng = random.Random(seed)
    t0 = time.perf_counter()
    llm = LLM(config=EngineConfig(model, device=device, max_model_len=seq_len))
    chats: list[list[dict]] = [[] for _ in range(num_samples)]
    ids: list[list[int]] = [[] for _ in range(num_samples)]
    turn = 0
    while unfinished := [i for i in range(num_samples) if len(ids[i]) < seq_len]:
        asked = []
        for i in unfinished:
            chats[i].append({"role": "user", "content": instruction(rng, spec)})
            prompt = prompt_ids(tokenizer, chats[i])
            if len(prompt) >= seq_len:  # the question fills the sample
                ids[i] = prompt
            else:
                asked.append((i, prompt))
        params = [SamplingParams(temperature=ANSWER_TEMPERATURE, top_p=TOP_P, seed=(seed * 100003 + i) * 1009 + turn,
                                 max_tokens=min(MAX_ANSWER, seq_len - len(prompt))) for i, prompt in asked]
        for (i, _), out in zip(asked, llm.generate([prompt for _, prompt in asked], params) if asked else []):
            chats[i].append({"role": "assistant", "content": out.outputs[0].text})
            ids[i] = tokenizer(render(tokenizer, chats[i], add_generation_prompt=False),
                               add_special_tokens=False)["input_ids"]
        turn += 1
    log.info("calibration: %d samples x %d tokens of the model's answers to %d instructions in %.0f s (seed %d)",
             num_samples, seq_len, sum(len(c) // 2 for c in chats), time.perf_counter() - t0, seed)
    return torch.tensor([x[:seq_len] for x in ids], dtype=torch.long)
