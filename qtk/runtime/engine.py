"""LLM: the offline engine (vLLM's `LLM` API) over Scheduler -> ModelRunner -> Sampler.

    llm = LLM("smollm2-135m")                      # any model qtk reads: HF dir, .gguf, qtk checkpoint
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text

One step: the scheduler picks the sequences and how many tokens of each to compute, the runner
runs one packed forward over them, the sampler picks a token for each sequence whose known tokens
are all computed, and finished sequences give back their KV blocks.
"""
from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, field, replace

import torch

from ..chat_template import has_template, prompt_ids
from ..device import check_device, choose_dtype
from ..errors import InputError
from ..kv_scales import cache_scheme, grid_absmax
from .attention import KV_DTYPES
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer, find_stop, held_back
from .model_runner import ModelRunner, kv_bytes_per_token, measure_kv_scales
from .models.llama import FUSED, LlamaModel
from ..kernels import cpu as cpu_kernels
from ..kernels.dispatch import prepare
from ..kernels.fp8 import fp8_supported
from .packed_linear import bf16_lm_head, kernel_summary, pack_linears
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence
from .structured_outputs import GrammarEngine, short

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop token) or "length"
    logprobs: list[dict[int, float]] | None = None  # per token: the sampled one's and the top-k's


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # None for the first token, as vLLM
    queue_time: float | None = None  # seconds from add_request to the first scheduled step
    error: str | None = None  # the request failed inside the engine (the engine goes on)

    @property
    def finished(self) -> bool:
        return self.error is not None or all(o.finish_reason is not None for o in self.outputs)

    def snapshot(self) -> RequestOutput:
        """A copy the engine will not change afterwards (lists copied, entries shared)."""
        outs = [replace(o, token_ids=list(o.token_ids), logprobs=None if o.logprobs is None else list(o.logprobs))
                for o in self.outputs]
        return replace(self, outputs=outs)


class LLM:
    def __init__(self, model: str, dtype: str = "auto", device: str = "cpu", block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 kv_cache_memory: int | None = None, enable_prefix_caching: bool = True,
                 kv_cache_dtype: str = "auto", gpu_memory_utilization: float = 0.9, max_logprobs: int = 20,
                 enforce_eager: bool = False):
        """As vLLM's LLM. enforce_eager: on CUDA, run every step eagerly instead of replaying the
        decode steps' CUDA graphs (captured at start-up; cuda_graphs.py)."""
        from ..loading import load_model

        t0 = time.perf_counter()
        check_device(device)
        self.dtype = choose_dtype(dtype, device, kernels_built=cpu_kernels.built).dtype
        hf_model, self.tokenizer = load_model(model, dtype=self.dtype, device=device)
        bf16_lm_head(hf_model)
        pack_linears(hf_model, fuse=FUSED)
        self.model = LlamaModel(hf_model)
        limit = getattr(hf_model.config, "max_position_embeddings", None) or 2048
        if max_model_len is not None and max_model_len > limit:  # positions the model never saw: cut
            log.warning("max_model_len %d is longer than the model's context (max_position_embeddings %d): "
                        "using %d", max_model_len, limit, limit)
        self.max_model_len = min(max_model_len or limit, limit)
        self.kv_dtype, kv_scales = self._kv_cache(kv_cache_dtype, device)
        per_token = kv_bytes_per_token(self.model, self.kv_dtype)
        memory = kv_cache_memory or self._default_kv_memory(device, gpu_memory_utilization)
        num_blocks = memory // (per_token * block_size)
        if num_blocks * block_size < self.max_model_len:
            raise InputError(f"the KV cache ({memory} bytes, {per_token} per token) holds "
                             f"{num_blocks * block_size} tokens, fewer than max_model_len {self.max_model_len}: "
                             "raise kv_cache_memory or lower max_model_len")
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, self.max_model_len),
                                   self.block_manager)
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.kv_dtype, kv_scales, device=device)
        self.vocab_size = hf_model.get_input_embeddings().num_embeddings  # the ids a prompt may hold
        self.max_logprobs = self.vocab_size if max_logprobs == -1 else min(max_logprobs, self.vocab_size)
        self.eos_token_ids = self._eos_ids(hf_model)
        self.grammars = GrammarEngine(self.tokenizer, hf_model.config.vocab_size, self.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, self.grammars)
        self._requests: dict[str, tuple[RequestOutput, list[Sequence]]] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._next_id = 0
        prepare(self.model, device, self.dtype)  # decode and repack the weights now, not at the first step
        graphs = "off (enforce_eager)" if enforce_eager else "none (CPU)" if self.runner.device.type != "cuda" else None
        if graphs is None:
            graphs = self._capture_graphs(max_num_seqs)
        log.info("engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens, %s), max_model_len %d; "
                 "linear layers: %s; attention: %s; CUDA graphs: %s", time.perf_counter() - t0, num_blocks,
                 block_size, num_blocks * block_size, str(self.kv_dtype).removeprefix("torch."), self.max_model_len,
                 kernel_summary(self.model), self.runner.attention_backend, graphs)

    def _capture_graphs(self, max_num_seqs: int) -> str:
        """Capture the decode steps' CUDA graphs -> what the start-up log says of them. A failed
        capture is an optimization lost, not an engine lost: it warns and the steps run eagerly."""
        try:
            why = self.runner.capture_graphs(max_num_seqs, self.max_model_len)
        except Exception as e:
            self.runner.graphs = None
            log.warning("capturing the decode steps in CUDA graphs failed (%s: %s); every step runs eagerly "
                        "(--enforce-eager skips the capture)", type(e).__name__, e)
            return "off: the capture failed"
        return f"off: {why}" if why else f"decode batch sizes up to {self.runner.graphs.max_batch}"

    @staticmethod
    def _default_kv_memory(device, utilization: float) -> int:
        """CPU: 2 GiB. CUDA: what remains of utilization x the device's memory once the weights
        are loaded, less a margin for the step's activations (vLLM's gpu_memory_utilization)."""
        if not 0 < utilization <= 1:
            raise InputError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
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

    def _kv_cache(self, kv_cache_dtype: str, device) -> tuple[torch.dtype, list | None]:
        """(cache dtype, per layer (k_scale, v_scale) float32 [kv_heads | 1, 1, 1] for FP8 / INT8).
        As vLLM: "auto" is the model dtype; fp8 / int8 take the checkpoint's calibrated scales
        (rescaled to the asked grid when the checkpoint calibrated the other one), or scales
        measured at load on built-in text, with a warning."""
        if kv_cache_dtype == "auto":
            return self.dtype, None
        if kv_cache_dtype not in KV_DTYPES:
            raise InputError(f"kv_cache_dtype must be auto, fp8 or int8, not {kv_cache_dtype!r}")
        dtype = KV_DTYPES[kv_cache_dtype]
        cuda = torch.device(device).type == "cuda"
        if kv_cache_dtype == "fp8" and cuda and not fp8_supported(torch.device(device)):
            raise InputError("kv_cache_dtype fp8 on CUDA needs a GPU with FP8 support (compute capability 8.9+: "
                             "Ada, Hopper); use kv_cache_dtype int8 on this one")
        attns = [layer.self_attn for layer in self.model.layers]
        if all(hasattr(a, "k_scale") and hasattr(a, "kv_scheme") for a in attns):
            scales, asked = [], grid_absmax(cache_scheme(dtype))
            for a in attns:
                rescale = grid_absmax(a.kv_scheme) / asked  # absmax = scale * grid_absmax on either grid
                scales.append(tuple((getattr(a, n).float() * rescale).reshape(-1, 1, 1).to(device)
                                    for n in ("k_scale", "v_scale")))
            return dtype, scales
        log.warning("the checkpoint has no KV-cache scales: measuring them on built-in text at load; "
                    "calibrated ones are better (qtk quantize --kv-cache %s)", kv_cache_dtype)
        from ..data import builtin_texts, token_stream

        ids = token_stream(self.tokenizer, builtin_texts("calibration"))[:512].tolist()
        return dtype, measure_kv_scales(self.model, ids, dtype, device)

    def _eos_ids(self, hf_model) -> set[int]:
        ids = set()
        for source in (getattr(hf_model, "generation_config", None), hf_model.config, self.tokenizer):
            e = getattr(source, "eos_token_id", None)
            ids.update(e if isinstance(e, (list, tuple)) else [] if e is None else [e])
        return ids

    # -- requests ----------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int] | dict) -> list[int]:
        """A prompt as vLLM takes one (text, token ids, {"prompt": text} or {"prompt_token_ids": ids},
        a dict with an optional "cache_salt") as token ids, each checked against the vocabulary: an
        id outside it would fail inside a step, and take the batch's other requests with it."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise InputError(f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got keys {sorted(prompt)}")
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if not isinstance(prompt, (list, tuple)):
            raise InputError(f"a prompt is text, a list of token ids or a dict holding one; got {type(prompt).__name__}")
        ids = []
        for i, t in enumerate(prompt):
            try:
                ids.append(operator.index(t))
            except TypeError:
                raise InputError(f"token ids are integers; position {i} of the prompt holds {t!r}") from None
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InputError(f"token id {ids[bad]} (position {bad} of the prompt) is outside this model's "
                             f"vocabulary: ids run from 0 to {self.vocab_size - 1}")
        return ids

    def check_params(self, p: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the limits of this model and engine."""
        for name, k in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
            if k is not None and k > self.max_logprobs:
                raise InputError(f"{name}={k} is more than max_logprobs={self.max_logprobs} (an LLM(...) argument)")
        if p.n > self.scheduler.config.max_num_seqs:
            raise InputError(f"n={p.n} is more than max_num_seqs={self.scheduler.config.max_num_seqs}, the sequences "
                             "this engine runs at once")
        for name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", p.logit_bias or ())):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InputError(f"{name}: token ids {bad[:8]} are outside this model's vocabulary: ids run from 0 "
                                 f"to {self.vocab_size - 1}")

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids = self.prompt_ids(prompt)
        salt = _cache_salt(prompt)
        self.check_params(params)
        if not ids:
            raise InputError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InputError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if request_id is not None and request_id in self._requests:
            raise InputError(f"request id {request_id!r} is already running; give each request its own")
        while request_id is None or request_id in self._requests:  # a generated id never takes a given one's
            request_id = str(self._next_id)
            self._next_id += 1
        out = RequestOutput(request_id, ids, [CompletionOutput(i, "", []) for i in range(params.n)])
        # with a seed, choice i draws from seed + i (as vLLM's parallel sampling): n seeded choices differ
        seqs = [Sequence(ids, params if params.seed is None or params.n == 1 else
                         replace(params, seed=(params.seed + i) % 2 ** 64), self.block_manager.block_size,
                         cache_salt=salt, request_id=request_id) for i in range(params.n)]
        if params.structured_outputs is not None:  # a bad schema fails here, before anything is held
            for s, m in zip(seqs, self.grammars.matchers(params.structured_outputs, len(seqs))):
                s.grammar = m
        for s in seqs:
            self._detok[s.seq_id] = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self._requests[request_id] = (out, seqs)
        for s in seqs:
            self.scheduler.add(s)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (nothing happens for an unknown or finished one)."""
        _, seqs = self._requests.pop(request_id, (None, []))
        for s in seqs:
            self.scheduler.finish(s)
            self.sampler.forget(s)
            self._detok.pop(s.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns a snapshot of every request that got a token in it (its
        text and tokens so far; `finished` once every completion has a finish_reason)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        logits, prompt_hidden = self.runner.run(batch)
        for seq in batch.seqs:
            if seq.seq_id in prompt_hidden and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
                # a recompute after preemption repeats positions already recorded: keep the first
                new = self.runner.prompt_logprobs(seq, prompt_hidden[seq.seq_id], seq.params.prompt_logprobs)
                seq.prompt_logprobs.extend(new[max(0, len(seq.prompt_logprobs) - seq.num_computed_tokens):])
        tokens = self.sampler(logits, sampling) if sampling else []
        for seq, row, token in zip(sampling, logits, tokens):
            if seq.params.logprobs is not None:
                seq.logprobs.append(self.sampler.logprobs(row, token, seq.params.logprobs))
        self.scheduler.finish_step(batch, {s.seq_id: t for s, t in zip(sampling, tokens)})
        updated: dict[str, RequestOutput] = {}
        for seq in sampling:
            if seq.request_id not in self._requests:
                continue  # a sibling (n > 1) of a request aborted or failed in this step
            try:
                out = self._update(seq, self._stop_reason(seq))
            except Exception as e:  # this request's failure (its text, its stop check): it alone ends
                log.exception("request %s failed", seq.request_id)
                out = self._requests[seq.request_id][0].snapshot()
                out.error = f"{type(e).__name__}: {e}"
                self.abort(seq.request_id)
                updated[seq.request_id] = out
                continue
            updated[seq.request_id] = out
            if out.finished:
                del self._requests[seq.request_id]
        return [out.snapshot() for out in updated.values()]

    def _stop_reason(self, seq: Sequence) -> str | None:
        """After seq got a new token: "stop" (EOS, a stop token, a stop string: the text ends
        before it; or its grammar is complete), "length", or None; the token's text is added to
        seq.text unless it stops."""
        p = seq.params
        last = seq.token_ids[-1]
        if seq.grammar is not None and seq.grammar.is_error():
            raise RuntimeError(f"structured outputs: token {last} broke the grammar: {short(seq.grammar.get_error())}")
        may_stop = seq.num_generated_tokens >= p.min_tokens
        if may_stop and ((last in self.eos_token_ids and not p.ignore_eos) or last in p.stop_token_ids):
            return "stop"
        at_length = (p.max_tokens is not None and seq.num_generated_tokens >= p.max_tokens) or len(seq) >= self.max_model_len
        complete = seq.grammar is not None and seq.grammar.is_stopped()  # only EOS could follow
        delta = self._detok[seq.seq_id].step(seq.token_ids, final=at_length or complete)
        seq.text += delta
        # as vLLM: the text of the first min_tokens tokens is never searched for a stop string
        hit = find_stop(seq.text, p.stop, len(delta)) if seq.num_generated_tokens > p.min_tokens else None
        if hit is not None:
            where, stop = hit
            seq.text = seq.text[:where + len(stop) if p.include_stop_str_in_output else where]
            return "stop"
        if complete:
            return "stop"
        return "length" if at_length else None

    def _update(self, seq: Sequence, reason: str | None) -> RequestOutput:
        """seq's completion after its new token; a finished seq gives back its blocks. Text that
        may be the start of a stop string is held back until the next tokens decide."""
        out, seqs = self._requests[seq.request_id]
        if out.queue_time is None and seqs[0].first_scheduled_time is not None:
            out.queue_time = seqs[0].first_scheduled_time - seqs[0].arrival_time
        completion = out.outputs[seqs.index(seq)]
        completion.token_ids = seq.generated_token_ids
        completion.finish_reason = reason
        hold = 0 if reason is not None or seq.params.include_stop_str_in_output else held_back(seq.text, seq.params.stop)
        completion.text = seq.text[:len(seq.text) - hold]
        if seq.params.logprobs is not None:
            completion.logprobs = seq.logprobs
        if (seq.params.prompt_logprobs is not None and out.prompt_logprobs is None
                and len(seq.prompt_logprobs) >= seq.num_prompt_tokens - 1):  # with the first token (a stream's echo)
            out.prompt_logprobs = [None, *seq.prompt_logprobs]
        if reason is not None:
            self.scheduler.finish(seq)
            self.sampler.forget(seq)
            self._detok.pop(seq.seq_id, None)
        return out

    # -- offline API -------------------------------------------------------------------------
    def generate(self, prompts: str | list[str] | list[list[int]] | list[dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Outputs in the order of the prompts."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(params)} sampling params: give one, or one per prompt")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
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


def _cache_salt(prompt) -> str | None:
    """A prompt dict's cache_salt (vLLM's): requests share cached KV blocks only under the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise InputError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt
