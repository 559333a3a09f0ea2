"""LLM: the offline engine (vLLM's `LLM` API), drawn as nano-vllm and vLLM v1 draw it.

    llm = LLM("smollm2-135m")                      # any model qtk reads: HF dir, .gguf, qtk checkpoint
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text

A request goes through the InputProcessor once (prompt ids, params, grammar matchers) and becomes
sequences in the Scheduler. One step: the scheduler picks the sequences and how many tokens of
each to compute, the ModelRunner runs one packed forward over them, the Sampler picks a token for
each sequence whose known tokens are all computed, and the OutputProcessor turns the new tokens
into RequestOutputs (text, stops, logprobs); finished sequences give back their KV blocks.

With speculative_config (spec_decode.py), a proposer gives each decoding sequence drafts before the
step, the step computes them after its last token, and the RejectionSampler keeps those the target
agrees with: a sequence may get several tokens in one step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from ..chat_template import has_template, prompt_ids
from ..device import check_device, choose_dtype
from ..errors import InputError
from ..kernels import cpu as cpu_kernels
from .block_manager import BlockManager
from .config import EngineConfig
from .draft_model import load_draft
from .host_memory import keep_freed_memory
from .input_processor import EngineRequest, InputProcessor
from .model_runner import ModelRunner
from .models import build
from .output_processor import CompletionOutput, OutputProcessor, RequestOutput
from .packed_linear import kernel_summary
from .rejection_sampler import RejectionSampler
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Batch, Scheduler
from .sequence import Sequence
from .spec_decode import SpecDecodeStats, SpecDecoder
from .structured_outputs import GrammarEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and counters at one moment (what a server's /metrics reports)."""

    num_running: int  # sequences in the batch
    num_waiting: int  # sequences waiting for admission
    kv_cache_usage: float  # fraction of KV blocks in use (1 = full)
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens found there
    spec_decode: SpecDecodeStats | None = None  # drafts proposed and kept (speculative decoding)


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **options):
        """As vLLM's LLM: LLM(model, **options), the options EngineConfig's (dtype, device,
        max_model_len, kv_cache_dtype, ...), or LLM(config=EngineConfig(...))."""
        from ..loading import load_model

        if config is None:
            config = EngineConfig(model, **options)
        elif model is not None or options:
            raise InputError("give LLM either a config or a model and its options, not both")
        self.config = c = config
        t0 = time.perf_counter()
        check_device(c.device)
        self.dtype = choose_dtype(c.dtype, c.device, kernels_built=cpu_kernels.built).dtype
        hf_model, self.tokenizer = load_model(c.model, dtype=self.dtype, device=c.device)
        self.model = build(hf_model, c.model_impl)  # NativeModel for its families, else GenericModel (models/__init__.py)
        if not c.device.startswith("cuda"):
            keep_freed_memory()  # each step's activations reuse the pages of the one before (host_memory.py)
        limit = getattr(hf_model.config, "max_position_embeddings", None) or 2048
        if c.max_model_len is not None and c.max_model_len > limit:  # positions the model never saw: cut
            log.warning("max_model_len %d is longer than the model's context (max_position_embeddings %d): "
                        "using %d", c.max_model_len, limit, limit)
        self.max_model_len = min(c.max_model_len or limit, limit)
        self.runner = ModelRunner.for_engine(self.model, c, self.dtype, self.max_model_len, self.tokenizer)
        self.kv_dtype = self.runner.kv_dtype
        self.block_manager = BlockManager(self.runner.num_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(c.scheduler_config(self.max_model_len), self.block_manager)
        self.vocab_size = hf_model.get_input_embeddings().num_embeddings  # the ids a prompt may hold
        self.max_logprobs = self.vocab_size if c.max_logprobs == -1 else min(c.max_logprobs, self.vocab_size)
        self.eos_token_ids = _eos_ids(hf_model, self.tokenizer)
        self.grammars = GrammarEngine(self.tokenizer, hf_model.config.vocab_size, self.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, self.grammars)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.spec = None
        if c.speculative_config is not None:
            spec = c.speculative_config
            draft = (load_draft(spec, c, self.dtype, self.max_model_len, self.tokenizer)
                     if spec.method == "draft_model" else None)
            self.spec = SpecDecoder(spec, self.max_model_len, draft)
        self.processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, self.max_logprobs,
                                        c.max_num_seqs, self.grammars)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self._next_id = 0
        tokens = self.runner.num_blocks * c.block_size
        log.info("engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens, %s), max_model_len %d; "
                 "model: %s; linear layers: %s; attention: %s; CUDA graphs: %s", time.perf_counter() - t0,
                 self.runner.num_blocks, c.block_size, tokens, str(self.kv_dtype).removeprefix("torch."),
                 self.max_model_len, type(self.model).__name__, kernel_summary(self.model),
                 self.runner.attention_backend,
                 self.runner.graphs_status)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(config=config)

    # -- requests ----------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int] | dict) -> list[int]:
        """The prompt's token ids, checked against the vocabulary (InputProcessor.prompt_ids)."""
        return self.processor.prompt_ids(prompt)

    def add_request(self, prompt: str | list[int] | dict | EngineRequest, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """prompt: as vLLM takes one, checked here by the InputProcessor, or an EngineRequest it
        made already (a server's: then params is not given)."""
        request = prompt if isinstance(prompt, EngineRequest) else self.processor.process(prompt, params)
        if request_id is not None and request_id in self.output_processor:
            raise InputError(f"request id {request_id!r} is already running; give each request its own")
        while request_id is None or request_id in self.output_processor:  # a generated id never takes a given one's
            request_id = str(self._next_id)
            self._next_id += 1
        ids, params = request.prompt_token_ids, request.params
        out = RequestOutput(request_id, ids, [CompletionOutput(i, "", []) for i in range(params.n)])
        # with a seed, choice i draws from seed + i (as vLLM's parallel sampling): n seeded choices differ
        seqs = [Sequence(ids, params if params.seed is None or params.n == 1 else
                         replace(params, seed=(params.seed + i) % 2 ** 64), self.block_manager.block_size,
                         cache_salt=request.cache_salt, request_id=request_id) for i in range(params.n)]
        for s, m in zip(seqs, request.grammars or ()):
            s.grammar = m
        self.output_processor.add(out, seqs)
        for s in seqs:
            self.scheduler.add(s)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (nothing happens for an unknown or finished one)."""
        for s in self.output_processor.pop(request_id):
            self._free(s)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_waiting_requests(self) -> int:
        """Requests (not their n sequences) waiting for admission. Safe from another thread:
        tuple() copies the deque in one C call, which the stepping thread cannot interleave
        (iterating it in Python could meet it mid-change)."""
        return len({s.request_id for s in tuple(self.scheduler.waiting)})

    def stats(self) -> EngineStats:
        sched, bm = self.scheduler, self.block_manager
        return EngineStats(len(sched.running), len(sched.waiting), 1 - bm.num_free_blocks / bm.num_blocks,
                           sched.num_preemptions, bm.prefix_queries, bm.prefix_hits,
                           None if self.spec is None else replace(self.spec.stats, accepted_per_pos=list(
                               self.spec.stats.accepted_per_pos)))

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns a snapshot of every request that got a token in it (its
        text and tokens so far; `finished` once every completion has a finish_reason)."""
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        t1 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        drafts = None if self.spec is None else [len(s.spec_token_ids) for s in batch.seqs]  # (finish_step takes them)
        sampled, tokens = self._run(batch)
        if drafts is not None and batch.total_tokens == len(batch) + sum(drafts):  # decodes only: it times the drafts
            self.spec.observe(t1 - t0, time.perf_counter() - t1, drafts)
        self.scheduler.finish_step(batch, {s.seq_id: t for s, t in zip(sampled, tokens)})
        return self.output_processor.process(sampled, self._free, [len(t) for t in tokens])

    def _run(self, batch: Batch) -> tuple[list[Sequence], list[list[int]]]:
        """The batch's forward, prompt logprobs and sampling -> (the sequences that sampled, the new
        tokens of each: one, or the drafts kept and the token after them)."""
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        logits, prompt_hidden = self.runner.run(batch)
        for seq in batch.seqs:
            # a recompute after preemption repeats positions already recorded: keep the first
            if seq.seq_id in prompt_hidden and seq.params.prompt_logprobs is not None \
                    and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
                new = self.runner.prompt_logprobs(seq, prompt_hidden[seq.seq_id], seq.params.prompt_logprobs)
                seq.prompt_logprobs.extend(new[max(0, len(seq.prompt_logprobs) - seq.num_computed_tokens):])
            if seq.seq_id in prompt_hidden and seq.prompt_rows is not None:
                done, pos = sum(len(r) for r in seq.prompt_rows), seq.num_computed_tokens
                for rows, _ in self.runner.prompt_log_softmax(seq, prompt_hidden[seq.seq_id]):
                    if pos + len(rows) > done:
                        seq.prompt_rows.append(rows[max(0, done - pos):].cpu())
                    pos += len(rows)
                    done = max(done, pos)
        counts = [1 + len(s.spec_token_ids) for s in sampling]
        rows = logits.split(counts)  # per sequence: its last token's row, then one per draft
        plain = [i for i, n in enumerate(counts) if n == 1]  # sampled as a batch
        tokens: list[list[int]] = [[] for _ in sampling]
        if plain:
            one = logits if len(plain) == len(sampling) else torch.cat([rows[i] for i in plain])
            for i, token in zip(plain, self.sampler(one, [sampling[i] for i in plain])):
                tokens[i] = [token]
        for i, n in enumerate(counts):
            if n > 1:
                seq = sampling[i]
                tokens[i] = self.rejection_sampler(rows[i], seq)
                last = len(tokens[i]) - 1  # the token after the kept drafts, unless a stop cut the drafts
                kept = last + (last < n - 1 and tokens[i][last] == seq.spec_token_ids[last])
                self.spec.record(seq, n - 1, kept)
        for seq, r, new in zip(sampling, rows, tokens):
            if seq.params.logprobs is not None:
                for row, token in zip(r, new):
                    seq.logprobs.append(self.sampler.logprobs(row, token, seq.params.logprobs))
        return sampling, tokens

    def _free(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.sampler.forget(seq)
        if self.spec is not None:
            self.spec.forget(seq)

    # -- offline API -------------------------------------------------------------------------
    def generate(self, prompts: str | list[str] | list[list[int]] | list[dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Outputs in the order of the prompts."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(params)} sampling params: give one, or one per prompt")
        return self._run_all(zip(prompts, params))

    def prompt_log_probs(self, prompts: list[list[int]]) -> list:
        """The model's next-token distribution at every position of each prompt but the last:
        per prompt a tensor [len - 1, vocab] of float32 log-probabilities on the CPU, row i the
        distribution of token i + 1 given tokens 0..i (what prompt_logprobs reads one entry of;
        no prefix cache, so every row is computed). All prompts run as one batch."""
        short = [i for i, p in enumerate(prompts) if len(p) < 2]
        if short:
            raise InputError(f"prompt {short[0]} has {len(prompts[short[0]])} token(s): scoring needs at least 2")
        rows: list[list] = [[] for _ in prompts]
        self._run_all(((p, SamplingParams(max_tokens=1, temperature=0.0)) for p in prompts), rows)
        return [torch.cat(r) for r in rows]

    def _run_all(self, requests, prompt_rows: list[list] | None = None) -> list[RequestOutput]:
        """Add every (prompt, params), step until all finish; outputs in order. With prompt_rows
        (a list per request), each request's prompt log-softmax rows are appended to its list."""
        ids: list[str] = []
        try:
            for k, (p, sp) in enumerate(requests):
                ids.append(self.add_request(p, sp))
                if prompt_rows is not None:
                    for seq in self.output_processor.requests[ids[-1]][1]:
                        seq.prompt_rows = prompt_rows[k]
        except InputError:  # all or nothing: the prompts taken before the bad one are let go
            for i in ids:
                self.abort(i)
            raise
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None):
        """One conversation (a list of {"role", "content"}) or several, through the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if not has_template(self.tokenizer):
            raise InputError("this model has no chat template; use generate()")
        return self.generate([prompt_ids(self.tokenizer, c) for c in convs], sampling_params)



def _eos_ids(hf_model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer):
        e = getattr(source, "eos_token_id", None)
        ids.update(e if isinstance(e, (list, tuple)) else [] if e is None else [e])
    return ids
