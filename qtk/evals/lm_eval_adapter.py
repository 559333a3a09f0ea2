"""lm-evaluation-harness on qtk's runtime: `lm_eval --model qtk` scores what `qtk serve` runs.

    lm_eval --model qtk --model_args pretrained=MODEL,kv_cache_dtype=fp8,dtype=float32 --tasks qtk_local \
        --include_path evals/lm_eval
    run_lm_eval("smollm2-135m", ["qtk_mc"], limit=8, kv_cache_dtype="fp8")     # from Python / qtk's CLI

QtkLM is lm-eval's LM over one qtk.LLM. It tokenizes as lm-eval's HFLM does (TemplateLM's
_encode_pair: context + continuation encoded whole and split at the context's length, the
context's trailing whitespace moved to the continuation; an empty context is the BOS token, or
EOS without one) and scores through the engine's prompt logprobs, every request of a call in one
generate() (the engine batches them).

Registration. lm-eval 0.4.13 resolves `--model NAME` in its registry before any user code runs
and reads no entry points. qtk declares the `lm_eval.models` entry point (pyproject.toml), which
lm-eval reads from the release after 0.4.13 on (upstream PR #4013); for 0.4.13,
`python -m qtk.evals.lm_eval_adapter install-hook` writes a one-line .pth into site-packages
that registers "qtk" as a lazy placeholder when lm_eval.api.registry is first imported (this
module itself is imported only when a run asks for --model qtk or one of qtk's tasks).

The local tasks (qtk_mc, qtk_paragraphs, qtk_gen; group qtk_local) live in evals/lm_eval/,
installed as package data (qtk.assets) so a wheel install has them; their YAMLs read their JSONL
through `local_dataset`, which resolves data files against that directory rather than the
working one.
"""
from __future__ import annotations

import difflib
import logging
import sys
import sysconfig
from pathlib import Path
from typing import get_args, get_type_hints

import jinja2
import lm_eval.models  # noqa: F401  (see below)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import get_metric_aggregation, register_model
from lm_eval.models.utils import (handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs,
                                  postprocess_generated_text)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from ..assets import eval_data
from ..chat_template import ChatTemplateError, render
from ..errors import InputError
from ..runtime.config import ENGINE_OPTIONS, EngineConfig
from ..version import __version__
from . import bootstrap

log = logging.getLogger(__name__)

TASKS_DIR = eval_data("lm_eval")
ENGINE_ARGS = tuple(name for name in ENGINE_OPTIONS if name != "device")  # EngineConfig's (device apart)
INTEGER_ARGS = tuple(name for name, hint in get_type_hints(EngineConfig).items() if int in (hint, *get_args(hint)))
# lm-eval's CLI always passes the batch sizes (the engine forms its own batches), and `lm_eval
# --trust_remote_code` adds trust_remote_code (qtk runs its own model code, never a checkpoint's)
IGNORED_ARGS = ("batch_size", "max_batch_size", "trust_remote_code")
SAMPLING_KWARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # SamplingParams' names
DEFAULT_MAX_GEN_TOKS = 256  # HFLM's

# lm-eval fills its registry with its own models (hf, vllm, ...) only when a lookup finds the
# registry empty: registering "qtk" first would hide them, so lm_eval.models is imported above.


@register_model("qtk")
class QtkLM(TemplateLM):
    """lm-eval's LM on qtk.LLM. model_args: pretrained (any model qtk reads, or a built qtk.LLM
    to share one engine, as HFLM takes a loaded model), device (default: cuda when available, as
    HFLM), and EngineConfig's other fields (dtype, kv_cache_dtype, max_model_len or lm-eval's name
    for it, max_length, as HFLM and lm-eval's vLLM model take it, ...)."""

    def __init__(self, pretrained=None, device: str | None = None, **args):
        super().__init__()
        from ..runtime.engine import LLM

        unknown = sorted(set(args) - set(ENGINE_ARGS) - {"max_length"} - set(IGNORED_ARGS))
        if unknown:
            raise InputError(f"unknown qtk model_args {', '.join(unknown)}; qtk takes pretrained, device, "
                             f"{', '.join(ENGINE_ARGS)}, max_length (= max_model_len) "
                             f"(and ignores {', '.join(IGNORED_ARGS)})")
        if pretrained is None:
            raise InputError("qtk needs model_args pretrained=MODEL (an HF dir, a .gguf or a qtk checkpoint)")
        engine_args = _engine_args(args)
        if isinstance(pretrained, LLM):
            given = sorted(engine_args) + (["device"] if device is not None else [])
            if given:
                raise InputError(f"{', '.join(given)} set how qtk loads a model, but pretrained is an engine already")
            self.llm, name = pretrained, pretrained.tokenizer.name_or_path
        else:
            config = EngineConfig(str(pretrained), device=_device(device), **engine_args)
            self.llm, name = LLM(config=config), str(pretrained)
        self.tokenizer = self.llm.tokenizer
        self.info = {"pretrained": name, **engine_args, "qtk_version": __version__}

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> QtkLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> QtkLM:
        """model_args win over the CLI's --device and --batch_size, which lm-eval always passes
        (device cuda:0 by default) and would otherwise collide with a device= in model_args."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    # -- tokenization, as HFLM -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window condition on: BOS, else EOS (HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.llm.max_model_len

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """The tokenizer's own special-token default, except a string that already starts with
        the prefix token (a chat-templated prompt) gets none added (HFLM)."""
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template as text (HFLM); a template that rejects the system role
        gets the conversation without it."""
        def chat(messages):
            return render(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                          continue_final_message=not add_generation_prompt)
        try:
            return chat(chat_history)
        except ChatTemplateError as e:
            if not isinstance(e.__cause__, jinja2.exceptions.TemplateError):
                raise
            log.warning("the chat template failed; retrying without the system message")
            return chat([m for m in chat_history if m["role"] != "system"])

    def get_model_info(self) -> dict:
        return dict(self.info)

    # -- scoring -------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """requests: (cache key, context ids, continuation ids) -> (sum log p(continuation), every
        continuation token is the argmax). One prompt-logprob request each, left-truncated to
        max_model_len - 1 tokens (the engine keeps a slot for the token it samples)."""
        from ..runtime.sampling_params import SamplingParams

        limit = self.max_length - 1
        prompts, starts, truncated = [], [], 0
        for _, context, continuation in requests:
            if len(continuation) >= limit:
                raise InputError(f"a continuation of {len(continuation)} tokens leaves no context within "
                                 f"max_model_len {self.max_length}")
            whole = context + continuation
            truncated += len(whole) > limit
            prompts.append(whole[-limit:])
            starts.append(len(prompts[-1]) - len(continuation))
        if truncated:
            log.warning("%d of %d requests are longer than %d tokens: their contexts are left-truncated",
                        truncated, len(requests), limit)
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        results = []
        for (key, _, _), ids, start, out in zip(requests, prompts, starts, outs):
            answer = score_continuation(ids[start:], out.prompt_logprobs[start:])
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Per document, the summed log p of all its tokens over lm-eval's disjoint rolling
        windows (the first conditioned on the prefix token). A window predicts max_model_len - 2
        tokens, one less than HFLM's: with its one context token it must leave the engine a slot
        to sample (as lm-eval's vLLM model does)."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 2, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows) if windows else []):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each (context, gen_kwargs): greedy unless do_sample, up to max_gen_toks (default 256),
        the text cut before the first `until` string (EOS stops too). Contexts are left-truncated
        to max_model_len - max_gen_toks tokens (HFLM). All requests in one generate().

        The text is HFLM's: the generated tokens decoded alone, then cut at the stop strings. The
        engine's own text is decoded after the prompt's tokens, which keeps the leading space a
        SentencePiece tokenizer (Llama 2, Mistral, Gemma) drops from a text's first token."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS))
            until = handle_stop_sequences(kwargs.pop("until"), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise InputError(f"max_gen_toks {max_gen_toks} leaves no room for a prompt within max_model_len "
                                 f"{self.max_length}: lower it (--gen_kwargs max_gen_toks=N)")
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen_toks)
            prompts.append(ids or [self.prefix_token_id])
            params.append(sampling_params(kwargs, until, max_gen_toks))
            stops.append(until)
        outs = self.llm.generate(prompts, params) if prompts else []
        texts = [postprocess_generated_text(self.tok_decode(out.outputs[0].token_ids), until, None)
                 for out, until in zip(outs, stops)]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts


def score_continuation(tokens: list[int], logprobs: list[dict[int, float]]) -> tuple[float, bool]:
    """(sum of the tokens' logprobs, whether each token is its position's argmax); logprobs[i]
    holds tokens[i]'s logprob and the top-ranked token's (prompt_logprobs=1)."""
    total = sum(entry[token] for token, entry in zip(tokens, logprobs))
    greedy = all(max(entry, key=entry.get) == token for token, entry in zip(tokens, logprobs))
    return total, greedy


def sampling_params(kwargs: dict, until: list[str], max_gen_toks: int):
    """SamplingParams from lm-eval's normalized gen_kwargs: do_sample=False is greedy;
    do_sample=True without a temperature samples at 1.0 (transformers' default). The stop strings
    are looked for in the text with its special tokens, as HFLM's stopping criterion decodes it:
    an `until` such as "</s>" or "<|endoftext|>" stops at that token even when it is not EOS."""
    from ..runtime.sampling_params import SamplingParams

    do_sample = kwargs.pop("do_sample")
    temperature = float(kwargs.pop("temperature", 1.0)) if do_sample else 0.0
    kwargs.pop("temperature", None)  # normalize_gen_kwargs writes 0.0 when do_sample is False
    unknown = sorted(set(kwargs) - set(SAMPLING_KWARGS))
    if unknown:
        raise InputError(f"qtk does not support the generation kwargs {', '.join(unknown)}; it takes until, "
                         f"max_gen_toks, do_sample, {', '.join(SAMPLING_KWARGS)}")
    return SamplingParams(max_tokens=max_gen_toks, stop=tuple(until), temperature=temperature,
                          skip_special_tokens=False, **kwargs)


def _engine_args(args: dict) -> dict:
    """The engine's model_args: lm-eval's max_length as max_model_len, and the integer ones as
    ints (lm-eval reads kv_cache_memory=4e9 as the float 4e9)."""
    args = dict(args)
    max_length = args.pop("max_length", None)
    if max_length is not None:
        if args.get("max_model_len") is not None:
            raise InputError("max_length and max_model_len are one setting (the context length): give one")
        args["max_model_len"] = max_length
    for name in INTEGER_ARGS:
        value = args.get(name)
        if isinstance(value, float) and value.is_integer():
            args[name] = int(value)
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InputError(f"model_args {name} must be an integer, got {value!r}")
    return {k: v for k, v in args.items() if k in ENGINE_ARGS}


def _device(device: str | None) -> str:
    """None -> cuda if available, else cpu; a CUDA device on a machine without one falls back to
    the CPU with a warning (lm-eval's CLI passes cuda:0 unless told otherwise)."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s asked but CUDA is not available: running on the CPU", device)
        return "cpu"
    return device


# -- local tasks ---------------------------------------------------------------------------------
def local_dataset(data_files: dict[str, str], **task_metadata):
    """The YAMLs' custom_dataset: JSON-lines files named relative to TASKS_DIR (lm-eval passes
    the task's metadata and model_args along too; they are not needed here)."""
    import datasets

    return datasets.load_dataset("json", data_files={split: str(TASKS_DIR / f) for split, f in data_files.items()})


def task_manager(tasks: list[str]):
    """A TaskManager that knows every name in `tasks`: qtk's local tasks alone when they are all
    local (indexing lm-eval's ~15k bundled task YAMLs takes 5-15 s), else lm-eval's with them.
    An unknown name is an InputError listing close matches."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    if all(local.match_tasks([t]) for t in tasks):
        return local
    manager = TaskManager(include_path=str(TASKS_DIR))
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        close = {t: difflib.get_close_matches(t, manager.all_tasks, n=5) for t in unknown}
        hints = "; ".join(f"{t!r}" + (f" (close: {', '.join(c)})" if c else "") for t, c in close.items())
        raise InputError(f"unknown lm-eval task {hints}; qtk's local tasks are {', '.join(local.all_tasks)}")
    return manager


def tasks_under(tasks: list[str]) -> set[str]:
    """`tasks` and every name under them (a group's tasks and subgroups, a tag's tasks), from
    lm-eval's index of task YAMLs: nothing is built or downloaded."""
    manager = task_manager(tasks)
    index = manager.task_index
    names, todo = set(), list(manager.match_tasks(tasks))
    while todo:
        name = todo.pop()
        entry = index.get(name)
        if name in names or entry is None:
            continue
        names.add(name)
        children = (entry.cfg or {}).get("task") if entry.kind.name == "GROUP" else None
        child_names = [c.get("group") or c.get("task") if isinstance(c, dict) else c for c in children or []]
        todo += [c for c in child_names if isinstance(c, str)]  # an inline config names its task or group
        todo += sorted(entry.tags) if entry.kind.name == "TAG" else []  # a tag's entry lists its tasks
    return names | set(tasks)


def run_lm_eval(model, tasks: list[str], limit: int | None = None, seed: int = 0,
                num_fewshot: int | None = None, **engine_args) -> dict:
    """lm-eval's simple_evaluate of `tasks` (qtk's local ones or lm-eval's) on qtk's engine:
    `model` is a name or path qtk loads with engine_args, or a qtk.LLM already built.
    Returns {"results": {task: {metric: value}}, "higher_is_better": {task: {metric: bool}},
    "versions": {...}, "config": {...}}; metric names keep their filter only when it is not
    lm-eval's "none" (exact_match,strip); higher_is_better is lm-eval's, by metric name."""
    import lm_eval

    manager = task_manager(tasks)
    lm = QtkLM(pretrained=model, **engine_args)
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=True, random_seed=seed,
                                  numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    results = {task: _metrics(values) for task, values in out["results"].items()}
    return {"results": {task: metrics for task, metrics in results.items() if metrics},  # a group has none
            "higher_is_better": {task: dict(values) for task, values in out.get("higher_is_better", {}).items()},
            "units": {key: u for task, samples in out.get("samples", {}).items()
                      for key, u in _units(task, samples, out["configs"].get(task, {})).items()},
            "versions": {"lm_eval": lm_eval.__version__, "qtk": __version__,
                         "tasks": dict(out["versions"])},
            "config": {"model": lm.info["pretrained"], "limit": limit, "seed": seed, "num_fewshot": num_fewshot,
                       **engine_args}}


def _units(task: str, samples: list[dict], config: dict) -> dict[str, dict]:
    """{TASK/METRIC[,FILTER]: bootstrap units} from lm-eval's logged samples: each document's
    value of each metric, in document order, for the metrics whose aggregation the bootstrap
    knows (mean, bits_per_byte, weighted_perplexity, perplexity; others get no standard error)."""
    declared = {m["metric"]: m.get("aggregation") for m in config.get("metric_list") or [] if isinstance(m, dict)}
    by_key: dict[str, tuple[str, list]] = {}
    for sample in sorted(samples, key=lambda x: x["doc_id"]):
        for metric in sample.get("metrics", []):
            agg = declared.get(metric)
            if not isinstance(agg, str):  # a task's default, or a function given in Python
                found = agg if callable(agg) else get_metric_aggregation(metric)
                agg = getattr(found, "__name__", None)
            if agg not in bootstrap.AGGREGATES or metric not in sample:
                continue
            key = f"{task}/{metric}" + ("" if sample["filter"] == "none" else f",{sample['filter']}")
            value = sample[metric]
            by_key.setdefault(key, (agg, []))[1].append(
                [float(x) for x in value] if isinstance(value, (tuple, list)) else float(value))
    return {key: bootstrap.units(agg, values) for key, (agg, values) in by_key.items()}


def _metrics(values: dict) -> dict[str, float]:
    """{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...} -> {"acc": 0.5, "acc_stderr": 0.1}."""
    metrics = {}
    for key, value in values.items():
        name, _, filter_name = key.partition(",")
        if filter_name and isinstance(value, (int, float)):
            metrics[name if filter_name == "none" else key] = float(value)
    return metrics


# -- registration for lm-eval 0.4.13 -------------------------------------------------------------
PLACEHOLDER = "qtk.evals.lm_eval_adapter:QtkLM"
HOOK_FILE = "qtk_lm_eval.pth"
_HOOK_SOURCE = f'''
import importlib, importlib.machinery, sys

class RegisterQtk:
    """Meta-path finder: when lm_eval.api.registry is first imported, register "qtk" lazily."""

    def find_spec(self, name, path=None, target=None):
        if name != "lm_eval.api.registry":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            registry = getattr(module, "model_registry", None)
            if registry is not None and "qtk" not in registry:
                importlib.import_module("lm_eval.models")  # lm-eval adds its own only to an empty registry
                registry.register("qtk", target={PLACEHOLDER!r})

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, RegisterQtk())
'''


def install_lm_eval_hook(site_dir: str | Path | None = None) -> Path:
    """Write the .pth that makes lm-eval 0.4.13 know `--model qtk` into site_dir (default: this
    interpreter's site-packages). site runs a .pth's `import` line at every start; this one only
    installs a finder that waits for lm_eval's registry, so nothing is imported until then.
    Remove the file to undo."""
    path = Path(site_dir or sysconfig.get_paths()["purelib"]) / HOOK_FILE
    path.write_text(f"import sys; exec({_HOOK_SOURCE!r}, {{}})\n")
    return path


if __name__ == "__main__":
    if sys.argv[1:2] != ["install-hook"] or len(sys.argv) > 3:
        sys.exit("usage: python -m qtk.evals.lm_eval_adapter install-hook [SITE_DIR]")
    print(install_lm_eval_hook(sys.argv[2] if len(sys.argv) == 3 else None))
