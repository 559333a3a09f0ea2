"""The `qtk` command: thin click wrappers that parse, call the library, and print."""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import fields, replace
from pathlib import Path

import click
from click.core import ParameterSource

from . import optional
from .errors import InputError
from .runtime.config import EngineConfig

MODEL_HELP = "an HF model directory, a .gguf file, a qtk/compressed-tensors checkpoint, or 'smollm2-135m' (bundled)"


DTYPE_HELP = ("Compute dtype of qtk's runtime. auto: bfloat16 on CUDA; float32 on CPUs (qtk's CPU kernels take "
              "float32 activations, and ran faster than bf16 even on CPUs with bf16 units; there a bf16 "
              "checkpoint's layers multiply many rows, prefill chunks, in bf16, unless QTK_CPU_BF16=0; without a "
              "compiler for the kernels, bfloat16 where the CPU has bf16 units); the log says which and why.")


# seeds the libraries take: torch.Generator.manual_seed 64 bits either sign; lm-eval seeds numpy, 0..2**32-1
SEED = click.IntRange(-2 ** 63, 2 ** 64 - 1)
EVAL_SEED = click.IntRange(0, 2 ** 32 - 1)


class QtkGroup(click.Group):
    """Turns errors in the user's input (qtk.errors.QtkError) and a missing package (qtk/optional.py)
    into one clear line and exit code 2; anything else is a bug or an environment failure and keeps
    its traceback."""

    def invoke(self, ctx):
        from .errors import QtkError

        try:
            return super().invoke(ctx)
        except (QtkError, ModuleNotFoundError) as e:
            error = e if isinstance(e, QtkError) else optional.explain(e)  # a package no check below foresaw
            if error is None or logging.getLogger().isEnabledFor(logging.DEBUG):
                raise
            if os.environ.get("RANK", "0") == "0":  # several processes (quantize --nproc): the same line once
                click.echo(f"error: {error}", err=True)
            ctx.exit(2)


@click.group(cls=QtkGroup)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging (and full tracebacks).")
def main(verbose: bool):
    """qtk: quantize Hugging Face causal LMs, gate their quality, serve them."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class LazyChoice(click.Choice):
    """A Choice whose names are read when first needed: the methods' come from qtk.methods.METHODS,
    which imports torch and the kernels, so `qtk --help` and the commands that need neither stay
    light (and a missing optional kernel package is still one line)."""

    def __init__(self, names):
        self.names = names
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self.names())


def _methods() -> tuple[str, ...]:
    from .methods import METHODS

    return tuple(METHODS)


def _weight_quantizers() -> tuple[str, ...]:
    from .methods import WEIGHTS, named

    return named(WEIGHTS)


def _section(**kw):
    return {k: v for k, v in kw.items() if v is not None}


@main.command()
@click.argument("model")
@click.option("--method", type=LazyChoice(_methods), default=None,
              help="Calibration method. With neither --method nor --recipe: qtk's best 4-bit recipe, AWQ then GPTQ "
                   "(calibration/recipes/awq-gptq-w4a16.yaml).")
@click.option("--scheme", default=None, help="w4a16 (default for rtn/gptq/autoround), w4a16_asym (awq), w8a16, w8a8 "
              "(smoothquant), fp8 (per-channel weights, dynamic per-token activations), fp8_static.")
@click.option("--group-size", type=int, default=None,
              help="Weight group size for w4a16/w8a16 (default 128; -1 = per channel). Must divide every "
                   "quantized layer's input size; qtk refuses otherwise and suggests one that does.")
@click.option("--output", "-o", required=True, type=click.Path(), help="Checkpoint directory to write.")
@click.option("--force", is_flag=True, help="Replace --output if it exists (and start over where a run into it "
              "was interrupted).")
@click.option("--resume", is_flag=True, help="Continue the run into --output that was interrupted (killed, out of "
              "memory, Ctrl-C) after the last block it finished; the same model and recipe, the same checkpoint as "
              "an uninterrupted run. For recipes streamed block by block (no --rotate, --max-bits or distillation).")
@click.option("--nproc", type=click.IntRange(min=1), default=1,
              help="Calibrate in N processes on this machine (data-parallel: each runs its share of the calibration "
                   "batches, the statistics are summed across them, one writes; the CPU cores are split among them, "
                   "one GPU each on CUDA). The same checkpoint as one process, up to float rounding. For recipes "
                   "calibrated block by block with gptq, awq, smoothquant, rtn or fp8 (not autoround, --rotate, "
                   "--max-bits or distillation). `torchrun ... -m qtk quantize ...` runs it across machines.")
@click.option("--recipe", "recipe_file", type=click.Path(), default=None,
              help="YAML recipe (see calibration/recipes/); flags given here override it.")
@click.option("--weights", type=LazyChoice(_weight_quantizers), default=None,
              help="Weight quantizer after smoothing (awq, smoothquant): rtn (default), gptq or autoround.")
@click.option("--act-order/--no-act-order", default=None, help="GPTQ: solve columns by descending Hessian "
              "diagonal (static act-order: groups keep their order, no g_idx). On by default, as in llm-compressor.")
@click.option("--dampening", type=float, default=None, help="GPTQ: damping as a fraction of mean(diag H) (0.01).")
@click.option("--alpha", type=float, default=None, help="SmoothQuant migration strength (0.5).")
@click.option("--iters", type=int, default=None, help="AutoRound: signed-gradient steps per block, one calibration "
              "batch each (200, as auto-round; its light preset 50).")
@click.option("--distill-samples", type=int, default=None,
              help="After the block-wise method, train every group's scale end to end against the unquantized "
                   "model's next-token distributions (KL; codes fixed) on this many calibration samples, one "
                   "step each (the default recipe's 64; 0: not done).")
@click.option("--kv-cache", type=click.Choice(["fp8", "int8"]), default=None, help="Also calibrate KV-cache scales.")
@click.option("--kv-strategy", type=click.Choice(["tensor", "head"]), default=None, help="KV scales per tensor or per head.")
@click.option("--ignore", multiple=True, help="Extra layer names or 're:REGEX' patterns to keep in float (lm_head always).")
@click.option("--max-bits", type=float, default=None,
              help="Mixed precision: keep the layers that cost the most (KL divergence when each alone is "
                   "quantized, on calibration samples; q/k/v and gate/up together) at 8 bits while the average "
                   "bits per quantized weight stay within this (e.g. 4.6 beside w4a16's 4.3; 0: none).")
@click.option("--rotate", multiple=True, type=click.Choice(["residual", "v_o", "down", "none"]),
              help="Hadamard rotations before calibration, instead of the recipe's: residual rotates the residual "
                   "stream (the norms' weights folded into the next layers, embeddings, every layer's rows or "
                   "columns on it; fused; tied embeddings are untied, lm_head then written apart); v_o rotates each attention "
                   "head's values (v_proj rows, o_proj columns; fused, nothing to apply at run time); down rotates "
                   "each down_proj's input online (its columns, and a fast Walsh-Hadamard transform of its input "
                   "at run time, written as compressed-tensors' transform config, which qtk and vLLM apply and "
                   "transformers' loader does not; the default recipe's); none: no rotation (a checkpoint "
                   "transformers runs).")
@click.option("--gates", "gates_spec", default=None,
              help="Keep the fewest most sensitive layers at 8 bits (within --max-bits, or the recipe's) with "
                   "which the checkpoint passes these gates (a gates YAML, or default / ci) against MODEL "
                   "unquantized; each mix tried is calibrated and gated in full. Where none passes, the whole "
                   "budget's mix is written with its table and the exit code is 1.")
@click.option("--dataset", default=None, help="Calibration text: builtin (pydoc topics), FILE.txt, FILE.jsonl, hf:NAME, "
              "self (text the model writes itself, from its chat template's user turn), instruct (the model's "
              "answers to qtk's instructions: JSON records, lists, explanations, code); A+B splits the samples "
              "evenly (builtin+self).")
@click.option("--num-samples", type=int, default=None, help="Calibration samples (64; 128 in the default recipe).")
@click.option("--seq-len", type=int, default=None, help="Tokens per calibration sample (512).")
@click.option("--batch-size", type=int, default=None, help="Calibration samples per forward (8).")
@click.option("--chat-template", is_flag=True, default=None, help="Wrap calibration samples in the chat template.")
@click.option("--seed", type=SEED, default=None, help="Seed for picking calibration samples (0).")
@click.option("--calibrate-all-experts/--no-calibrate-all-experts", default=None,
              help="MoE: route every calibration token through every expert for statistics (the block's output "
                   "still uses the routed ones). On by default, as in llm-compressor.")
@click.option("--activations", type=click.Choice(["auto", "memory", "disk"]), default=None,
              help="Where calibration activations wait between blocks: memory, disk (memory-mapped files beside "
                   "the output, removed at the end) or auto (disk when they would take over half the memory "
                   "available; the log says so).")
@click.option("--device", default=None, help="Calibration device: cpu or cuda[:N] (one block at a time goes there).")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default=None,
              help="Model dtype while calibrating (auto: bfloat16 on CUDA and CPUs with bf16 units, float32 "
                   "elsewhere): block forwards run in it; Hessians, solves and searches accumulate in float32.")
def quantize(model, output, force, resume, nproc, recipe_file, gates_spec, act_order, dampening, alpha, iters, distill_samples, dataset,
             num_samples, seq_len, batch_size, chat_template, seed, calibrate_all_experts, activations, **top):
    """Quantize MODEL and write a compressed-tensors checkpoint to --output."""
    from . import distributed, pipeline, recipe as rec

    if nproc > 1:
        if os.environ.get("WORLD_SIZE"):
            raise click.UsageError("--nproc starts the processes itself; under torchrun leave it out")
        if gates_spec is not None:
            raise click.UsageError("--gates calibrates and gates each mix in one process; leave out --nproc")
        raise SystemExit(distributed.launch(nproc, _without_option(sys.argv[1:], "--nproc")))

    recipe = rec.build(recipe_file=recipe_file, **top,
                       gptq=_section(act_order=act_order, dampening=dampening),
                       smoothquant=_section(alpha=alpha), autoround=_section(iters=iters),
                       distill=_section(samples=distill_samples),
                       calibration=_section(dataset=dataset, num_samples=num_samples, seq_len=seq_len,
                                            batch_size=batch_size, chat_template=chat_template, seed=seed,
                                            calibrate_all_experts=calibrate_all_experts, activations=activations))
    needs = [optional.model_needs(model), optional.dataset_needs(recipe.calibration.dataset, "--dataset")]
    if gates_spec is not None:
        if resume:
            raise click.UsageError("--resume continues a streamed quantize; --gates calibrates each mix whole")
        return _quantize_gated(model, recipe, output, force, gates_spec, top["max_bits"], needs)
    optional.require(*needs)
    report = pipeline.quantize(model, recipe, output, force=force, resume=resume)
    method = recipe.method if recipe.smoothing is None or recipe.weights == "rtn" else f"{recipe.method}+{recipe.weights}"
    if distributed.writes():
        processes = f", {distributed.size()} processes" if distributed.active() else ""
        click.echo(f"wrote {output} ({method}, {len(report['layers'])} layers, "
                   f"{report['calibration_tokens']} calibration tokens{processes}, {report['seconds']:.1f} s quantize, "
                   f"{report['total_seconds']:.1f} s total)")
    distributed.finish()


def _without_option(argv: list[str], name: str) -> list[str]:
    """argv without `name VALUE` / `name=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def _quantize_gated(model, recipe, output, force, gates_spec, max_bits_flag, needs):
    from .evals.gates import gates_needs, load_gates
    from .gated import quantize_gated

    optional.require(*needs, gates_needs(load_gates(gates_spec)))
    # --max-bits 0: the scheme alone, gated; no --max-bits: the recipe's budget, or every layer
    budget = max_bits_flag if max_bits_flag is not None else recipe.max_bits
    report, v = quantize_gated(model, recipe, output, gates_spec, budget, force=force, echo=click.echo)
    g = report["gates"]
    click.echo("\n" + v.table())
    kept = report.get("mixed_precision", {}).get("kept_at_8_bits", {})
    click.echo(f"\n{'PASS' if g['passed'] else 'FAIL'}: wrote {output} with {len(kept)} layers at 8 bits "
               f"({len(g['candidates'])} mixes tried, {g['seconds']:.0f} s); see {output}/gates.md")
    if not g["passed"]:
        raise SystemExit(1)


@main.command()
@click.argument("model")
@click.option("--json", "json_out", is_flag=True, help="Print JSON instead of a table.")
def inspect(model, json_out):
    """Per-layer scheme, bits and size on disk against the bf16 original; the KV-cache scheme."""
    from .inspect import inspect_checkpoint, render

    optional.require(optional.model_needs(model))
    info = inspect_checkpoint(model)
    click.echo(json.dumps(info, indent=2) if json_out else render(info))


@main.command("eval")
@click.argument("model")
@click.option("--baseline", default=None,
              help="The model MODEL is compared with (e.g. the unquantized one): with --gates, gated against it; "
                   "without, --task runs on both and each metric is printed for both with its standard error.")
@click.option("--gates", "gates_spec", default=None,
              help="Gate MODEL against --baseline: a gates YAML, or default / ci (qtk's). Exit 0 pass, 1 regressed.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False), default=None,
              help="With --gates: write report.md, report.json and the pictures here.")
@click.option("--no-cache", is_flag=True, help="With --gates: recompute the baseline's scores even if cached.")
@click.option("--task", default="ppl", show_default=True,
              help="Without --gates: ppl (perplexity), kld (KL divergence from a baseline: a gate, see "
                   "evals/gates/default.yaml), needle (needle in a haystack), json (JSON validity, with and "
                   "without structured outputs), lm-eval:TASK[,TASK], tasks:FILE.jsonl (your own prompts with "
                   "expected answers: qtk/evals/user_tasks.py) or replay:LOG.jsonl (a request log, replayed "
                   "greedily: qtk/evals/replay.py).")
@click.option("--dataset", default="builtin", show_default=True,
              help="ppl: builtin (pydoc topics, evaluation split), FILE.txt, FILE.jsonl, hf:NAME. json: builtin "
                   "(qtk's 120 prompts with schemas) or a JSONL of {prompt, schema[, category, id]}. needle: the "
                   "filler, builtin or FILE.txt.")
@click.option("--seq-len", type=int, default=2048, show_default=True, help="ppl: window length in tokens.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="At most N windows (ppl), prompts (json, spread over the categories) or examples per task (lm-eval).")
@click.option("--lengths", default=None, help="needle: haystack lengths in tokens, comma-separated "
                                                "(default: 256 doubling up to the context, as far as the filler "
                                                "text goes).")
@click.option("--depths", default=None, help="needle: needle depths in percent, comma-separated (default 0,25,50,75,100).")
@click.option("--seed", type=EVAL_SEED, default=0, show_default=True,
              help="needle keys and positions; lm-eval's seeds.")
@click.option("--batch-size", type=int, default=1, show_default=True,
              help="ppl: windows the runtime computes per step (its token budget is batch-size x seq-len).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help=DTYPE_HELP)
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "bfloat16", "fp8", "int8"]), default="auto", show_default=True,
              help="KV cache as the runtime would serve MODEL (auto: the model dtype; a baseline always runs auto).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the result as JSON here.")
def eval_(model, baseline, gates_spec, report_dir, no_cache, task, dataset, seq_len, limit, lengths, depths, seed,
          batch_size, device, dtype, kv_cache_dtype, json_path):
    """Measure MODEL's quality through qtk's runtime, or gate it against a baseline (--gates).

    Tasks: perplexity by the protocol in docs/benchmarks.md; needle in a haystack
    (qtk/evals/needle.py); JSON validity (qtk/evals/json_validity.py); lm-eval tasks through qtk's
    runtime (qtk's local ones: evals/lm_eval); your own cases (tasks:FILE.jsonl) and
    traffic (replay:LOG.jsonl)."""
    from .evals.report import check_output_file, write_json
    from .evals.tasks import task_needs

    ctx = click.get_current_context()
    gating, comparing = gates_spec is not None, gates_spec is None and baseline is not None
    _check_eval_flags(ctx, gating, comparing)
    if json_path:
        check_output_file(Path(json_path))  # before any model runs
    if gating:
        return _eval_gates(model, baseline, gates_spec, report_dir, no_cache, seed, device, dtype, kv_cache_dtype,
                           json_path)
    optional.require(optional.model_needs(model, *([baseline] if comparing else [])),
                     task_needs(task, {"dataset": dataset, "constrained": True}, f"--task {task}"))
    if comparing:
        given = {p.name for p in ctx.command.params if ctx.get_parameter_source(p.name) is not ParameterSource.DEFAULT}
        flags = {"dataset": dataset, "filler": dataset, "seq_len": seq_len, "limit": limit, "batch_size": batch_size,
                 "lengths": _ints(lengths, "--lengths"), "depths": _ints(depths, "--depths")}
        return _eval_compare(model, baseline, task, {k: v for k, v in flags.items()
                                                     if k in given or (k == "filler" and "dataset" in given)},
                             no_cache, seed, device, dtype, kv_cache_dtype, json_path)
    result = _eval_task(model, task, dataset, seq_len, limit, lengths, depths, seed, batch_size, device, dtype,
                        kv_cache_dtype)
    if json_path:
        write_json(Path(json_path), {"model": model, "task": task, **result})


GATES_ONLY = ("report_dir", "no_cache")  # eval options that apply with --gates alone ...
TASK_ONLY = ("task", "dataset", "seq_len", "limit", "lengths", "depths", "batch_size")  # ... and without


def _check_eval_flags(ctx, gating: bool, comparing: bool) -> None:
    """An option the chosen mode ignores is a mistake (a gates file sets its tasks' options; a
    comparison, --task with --baseline, caches the baseline as the gates do)."""
    ignored = TASK_ONLY if gating else ("report_dir",) if comparing else GATES_ONLY
    given = [p.opts[0] for p in ctx.command.params
             if p.name in ignored and ctx.get_parameter_source(p.name) is not ParameterSource.DEFAULT]
    if given and gating:
        raise InputError(f"--gates ignores {', '.join(given)}: set a task's options under its args: in the "
                         "gates file")
    if given:
        raise InputError(f"{', '.join(given)}: only with --gates and --baseline")


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise InputError(f"{flag} takes comma-separated integers, got {text!r}") from e


def _eval_task(model, task, dataset, seq_len, limit, lengths, depths, seed, batch_size, device, dtype,
               kv_cache_dtype) -> dict:
    """One task (qtk.evals.tasks.TASKS), the flags given as its args (a gates file's names)."""
    from .evals.tasks import TASKS_HELP, lookup

    found = lookup(task)
    if found is None:
        raise InputError(f"unknown --task {task!r}: {TASKS_HELP}")
    flags = {"dataset": dataset, "filler": dataset, "seq_len": seq_len, "limit": limit, "batch_size": batch_size,
             "lengths": _ints(lengths, "--lengths"), "depths": _ints(depths, "--depths")}
    args = {name: value for name, value in flags.items() if name in found.args}
    engine = EngineConfig(model, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype)
    return found.show(engine, task.partition(":")[2] or None, args, seed, click.echo)


def _eval_compare(model, baseline, task, args, no_cache, seed, device, dtype, kv_cache_dtype, json_path):
    """--task on the baseline (cached as the gates cache it) and on MODEL: each metric of both, with
    standard errors by the paired bootstrap the gates use. The task's options are the flags given;
    the others take a gates file's defaults (kld: 8 windows of 512 tokens)."""
    from .evals.gates import compare_metrics
    from .evals.gate_args import check_args
    from .evals.report import write_json
    from .evals.scoring import score_model
    from .evals.tasks import TASKS, TASKS_HELP, Gate, lookup
    from .loading import resolve

    found = lookup(task)
    if found is None:
        raise InputError(f"unknown --task {task!r}: {TASKS_HELP}")
    for m in (model, baseline):
        resolve(m)  # a missing model fails now, before any work
    kind = task.split(":", 1)[0]
    args = check_args(f"--task {task}", kind, TASKS[kind].args, {k: v for k, v in args.items() if k in found.args},
                      Path.cwd())
    gate = Gate(kind, task, args, None, {}, None)
    engine = EngineConfig(baseline, dtype=dtype, device=device)
    base = score_model(engine, [gate], seed, "baseline", cache=not no_cache, echo=click.echo)
    cand = score_model(replace(engine, model=model, kv_cache_dtype=kv_cache_dtype), [gate], seed, "candidate",
                       cache=False, echo=click.echo, reference=base)
    rows = compare_metrics(gate, base[kind], cand[kind])
    for r in rows:
        click.echo(f"{r['metric']}: baseline {r['baseline_text']}, candidate {r['candidate_text']}")
    if json_path:
        write_json(Path(json_path), {"model": model, "baseline": baseline, "task": task, "args": args,
                                     "metrics": [{k: v for k, v in r.items() if not k.endswith("_text")}
                                                 for r in rows]})


def _eval_gates(model, baseline, gates_spec, report_dir, no_cache, seed, device, dtype, kv_cache_dtype, json_path):
    from dataclasses import asdict

    from .evals.gates import check_directions, gates_needs, load_gates, verdict
    from .evals.report import check_output_dir, write_json, write_report
    from .evals.scoring import score_model
    from .loading import resolve

    if gates_spec is None or baseline is None:
        raise InputError("gating needs both --baseline BASE_MODEL and --gates FILE (or default)")
    gates = load_gates(gates_spec)
    optional.require(optional.model_needs(model, baseline), gates_needs(gates),
                     optional.REPORT if report_dir else {})
    for m in (model, baseline):
        resolve(m)  # a missing model fails now, before any work
    if report_dir:
        check_output_dir(Path(report_dir))
    engine = EngineConfig(baseline, dtype=dtype, device=device)
    base = score_model(engine, gates.gates, seed, "baseline", cache=not no_cache, echo=click.echo)
    check_directions(gates, base)  # an lm-eval metric's direction is known now, before the candidate runs
    cand = score_model(replace(engine, model=model, kv_cache_dtype=kv_cache_dtype), gates.gates, seed, "candidate",
                       cache=False, echo=click.echo, reference=base)
    v = verdict(gates, base, cand)
    click.echo("\n" + v.table())
    click.echo(f"\n{'PASS' if v.passed else 'FAIL'}: {model} against {baseline} ({gates.path})")
    if report_dir:
        paths = write_report(Path(report_dir), v, baseline, model, gates.path)
        click.echo(f"report: {paths[0]}")
    if json_path:
        write_json(Path(json_path), {"passed": v.passed, "soft_score_pct": v.soft_score_pct,
                                     "rows": [asdict(r) for r in v.rows]})
    if not v.passed:
        raise SystemExit(1)


ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}
ENGINE_OPTIONS = [  # EngineConfig's fields as flags (vLLM's names: --max-num-seqs sets max_num_seqs)
    click.option("--device", default=ENGINE_DEFAULTS["device"], show_default=True, help="cpu or cuda[:N]."),
    click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default=ENGINE_DEFAULTS["dtype"],
                 show_default=True, help=DTYPE_HELP),
    click.option("--block-size", type=click.IntRange(min=1), default=ENGINE_DEFAULTS["block_size"], show_default=True,
                 help="Tokens per KV-cache block."),
    click.option("--max-num-seqs", type=click.IntRange(min=1), default=ENGINE_DEFAULTS["max_num_seqs"],
                 show_default=True, help="Sequences per step at most."),
    click.option("--max-num-batched-tokens", type=click.IntRange(min=1),
                 default=ENGINE_DEFAULTS["max_num_batched_tokens"],
                 help="Tokens per step at most (longer prompts are prefilled in chunks; default: 512 on CPU, "
                      "where smaller steps bring first tokens sooner, growing by 32 per decoding sequence up to "
                      "2048; 8192 on CUDA). A value given is fixed."),
    click.option("--max-model-len", type=click.IntRange(min=1), default=ENGINE_DEFAULTS["max_model_len"],
                 help="Context length (default: the model's)."),
    click.option("--kv-cache-memory", type=click.IntRange(min=1), default=ENGINE_DEFAULTS["kv_cache_memory"],
                 help="Bytes for the KV cache on CPU (default 2 GiB)."),
    click.option("--gpu-memory-utilization", type=float, default=ENGINE_DEFAULTS["gpu_memory_utilization"],
                 show_default=True,
                 help="CUDA: the fraction of the GPU's memory the engine may use (weights + KV cache)."),
    click.option("--kv-cache-dtype", type=click.Choice(["auto", "bfloat16", "fp8", "int8"]),
                 default=ENGINE_DEFAULTS["kv_cache_dtype"], show_default=True,
                 help="KV cache: auto, the model dtype (a bf16 checkpoint's bf16 where the CPU multiplies prefills "
                      "in bf16); bfloat16 (half a float32 model's bytes, no scales); or FP8 e4m3 / INT8 with the "
                      "checkpoint's scales (measured at load when it has none)."),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=ENGINE_DEFAULTS["enable_prefix_caching"],
                 show_default=True, help="Reuse the KV blocks of a prompt prefix already computed."),
    click.option("--enforce-eager", is_flag=True, default=ENGINE_DEFAULTS["enforce_eager"],
                 help="CUDA: run every step eagerly, without the decode steps' CUDA graphs."),
    click.option("--model-impl", type=click.Choice(["auto", "qtk", "transformers"]), default=ENGINE_DEFAULTS["model_impl"],
                 show_default=True, help="Model code: qtk's native forward where it has one (auto), only that (qtk), "
                                         "or transformers' modeling code with qtk's paged attention (transformers)."),
    click.option("--speculative-config", callback=lambda ctx, param, value: _json_object(value, param),
                 default=None, help='Speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": '
                                    '5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (drafts copied from the '
                                    'prompt and the output). Greedy output is unchanged; it comes in fewer steps.'),
]


def _json_object(value: str | None, param) -> dict | None:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON ({e}): give a JSON object", param=param) from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("give a JSON object, e.g. '{\"method\": \"ngram\"}'", param=param)
    return parsed


def engine_options(fn):
    """The engine's flags, shared by generate and serve: each command gets them as keyword
    arguments named as EngineConfig's fields (EngineConfig(model, **options))."""
    for option in reversed(ENGINE_OPTIONS):
        fn = option(fn)
    return fn


@main.command()
@click.argument("model")
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="New tokens to generate.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample among the k likeliest (0 = all).")
@click.option("--seed", type=SEED, default=None, help="Seed of this request's sampling.")
@engine_options
def generate(model, prompt, max_tokens, chat, temperature, top_p, top_k, seed, **engine_options):
    """Generate a continuation of --prompt with MODEL (float or quantized) on qtk's runtime."""
    from .generate import generate as gen

    optional.require(optional.model_needs(model))
    click.echo(gen(EngineConfig(model, **engine_options), prompt, max_tokens=max_tokens, chat=chat,
                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed))


@main.command()
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--served-model-name", default=None, help="The model name clients send (default: MODEL).")
@click.option("--api-key", default=None, envvar="QTK_API_KEY", help="Require Authorization: Bearer KEY.")
@click.option("--max-queue", type=int, default=None, help="Answer 503 (Retry-After) with this many requests waiting.")
@click.option("--log-requests", type=click.Path(dir_okay=False), default=None,
              help="Append each request served (body and response text, never the key) to this JSONL, "
                   "rotated at 64 MiB (for replaying against another checkpoint).")
@click.option("--chat-template", default=None,
              help="A Jinja chat template (a file, or the template itself) instead of the model's own, as vLLM's.")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help='Let the model choose its tool calls (tool_choice "auto"); needs --tool-call-parser.')
@click.option("--tool-call-parser", type=click.Choice(["hermes"]), default=None,
              help="The syntax the model writes its tool calls in (hermes: Qwen2.5, Qwen3, Hermes 2 Pro / 3).")
@click.option("--reasoning-parser", type=click.Choice(["deepseek_r1", "qwen3"]), default=None,
              help="Split a thinking model's thought (<think>...</think>) into the message's `reasoning`.")
@engine_options
def serve(model, host, port, served_model_name, api_key, max_queue, log_requests, chat_template,
          enable_auto_tool_choice, tool_call_parser, reasoning_parser, **engine_options):
    """Serve MODEL over the OpenAI API (/v1/completions, /v1/chat/completions) on qtk's runtime."""
    import signal

    if enable_auto_tool_choice != (tool_call_parser is not None):
        raise click.UsageError("--enable-auto-tool-choice and --tool-call-parser go together (as in vLLM): the "
                               "parser reads the calls a model chooses to make")

    optional.require(optional.model_needs(model), optional.SERVE)
    import uvicorn

    from .data import read_text
    from .entrypoints.openai.api_server import build_app
    from .runtime.async_engine import AsyncLLM
    from .runtime.engine import LLM

    template = None
    if chat_template is not None:
        try:
            is_file = Path(chat_template).is_file()
        except OSError:  # a long inline template is no file name
            is_file = False
        template = read_text(Path(chat_template), "--chat-template file") if is_file else chat_template
        if "{" not in template:
            raise click.BadParameter(f"{chat_template!r} is neither a file nor a Jinja template",
                                     param_hint="--chat-template")
        import jinja2
        from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers' own Jinja

        try:  # (loop controls, {% generation %}), as it will render the template
            _compile_jinja_template(template)
        except jinja2.TemplateSyntaxError as e:
            raise click.BadParameter(f"line {e.lineno}: {e.message}", param_hint="--chat-template") from None
    engine = AsyncLLM(LLM(config=EngineConfig(model, **engine_options)))
    app = build_app(engine, served_model_name or model, api_key=api_key, max_queue=max_queue,
                    log_requests=log_requests, tool_call_parser=tool_call_parser, chat_template=template,
                    reasoning_parser=reasoning_parser)
    # uvicorn stops taking requests on SIGTERM and lets in-flight ones finish (30 s at most), then
    # raises the signal again for the handler it found: ours, which lets serve return (exit 0)
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)
    finally:
        engine.shutdown()


def _command_line() -> str:
    """The command line as a user typed it (`qtk ...`, however the CLI was started), for the JSON
    a benchmark writes."""
    return " ".join(["qtk", *sys.argv[1:]])


@main.group()
def bench():
    """Benchmarks that print and record numbers (protocols: docs/benchmarks.md)."""


@bench.command("kernels")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="cuda: the Triton GEMMs against cuBLAS; cpu: qtk's CPU kernels against the float32 matmul "
                   "(default: cuda when there is one).")
@click.option("--shapes", default=None, help="Model shapes to run (default: llama3-8b on cuda, smollm2-135m on cpu).")
@click.option("--m", "ms", default=None, help="Comma-separated M values (default: 1,16,64,256,1024,4096 on cuda, "
              "1,2,4,8,16,64,256 on cpu).")
@click.option("--out", type=click.Path(), default="benchmarks/results", show_default=True, help="Directory for the JSON.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True,
              help="cuda: activation dtype (cpu: float32).")
def bench_kernels(device, shapes, ms, out, dtype):
    """Quantized GEMMs on a model's layer shapes against the dense matmul and the hardware limit."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    optional.require({"triton": "qtk bench kernels --device cuda"} if device == "cuda" else {})
    m_list = _ints(ms, "--m")
    if device == "cpu":
        from .bench.kernels_cpu import run as run_cpu

        _, summary = run_cpu(shapes=shapes or "smollm2-135m", ms=m_list, out=out, command=_command_line())
    else:
        from .bench.kernels_gpu import run

        _, summary = run(shapes=shapes or "llama3-8b", ms=m_list or [1, 16, 64, 256, 1024, 4096], out=out,
                         dtype=dtype, command=_command_line())
    click.echo(summary)


@bench.command("engine")
@click.argument("model")
@click.option("--num-prompts", type=int, default=64, show_default=True,
              help="Chat requests, all submitted at once (0: no throughput run).")
@click.option("--prompts", "prompt_set", default="builtin", show_default=True,
              help="The requests' prompts: builtin (16 short chat questions), fixed:N or random:LO-HI (N-token "
                   "windows of the built-in text), conversation (chats with long histories).")
@click.option("--output-len", type=int, default=128, show_default=True, help="Output tokens per request (EOS ignored).")
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens of the batch-1 request.")
@click.option("--batch1-output-len", type=int, default=256, show_default=True, help="Output tokens of the batch-1 request.")
@click.option("--peer", "peers", multiple=True, type=click.Choice(["transformers", "vllm", "llama.cpp"]),
              default=("transformers",), show_default=True, help="Engines to run beside qtk (repeat the option).")
@click.option("--sequential", type=int, default=16, show_default=True,
              help="Requests transformers runs one at a time (the rate is per token, so fewer suffice).")
@click.option("--gguf", default=None, help="GGUF for llama.cpp (default: the bundled Q4_1 file).")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help=DTYPE_HELP)
@click.option("--out", type=click.Path(), default="benchmarks/results", show_default=True, help="Directory for the JSON.")
@click.option("--name", default=None, help="JSON file name (default engine-MODEL-DTYPE).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N]: where qtk and transformers run.")
@click.option("--enforce-eager", is_flag=True, help="CUDA: qtk without its decode CUDA graphs.")
@click.option("--speculative", "speculative_configs", multiple=True,
              callback=lambda ctx, param, value: tuple(_json_object(v, param) for v in value),
              help='A speculative_config (JSON, as --speculative-config) to run against plain decoding at batch 1 '
                   'and 4, greedy, on --speculative-prompts (repeat the option for several).')
@click.option("--speculative-prompts", default="builtin", show_default=True,
              help="The speculative runs' prompts: a prompt set as --prompts takes (edit: paragraphs to rewrite).")
@click.option("--speculative-output-len", type=click.IntRange(min=1), default=256, show_default=True,
              help="Output tokens at most per speculative request (EOS honoured).")
def bench_engine(model, num_prompts, prompt_set, output_len, input_len, batch1_output_len, peers, sequential, gguf,
                 dtype, out, name, device, enforce_eager, speculative_configs, speculative_prompts,
                 speculative_output_len):
    """qtk's runtime against transformers generate, vLLM's CPU build and llama.cpp (CPU protocol)."""
    from .bench.engine import run

    optional.require(optional.model_needs(model))
    _, text = run(model, num_prompts=num_prompts, output_len=output_len, batch1_input_len=input_len,
                  batch1_output_len=batch1_output_len, dtype=dtype, peers=peers, sequential=sequential, gguf=gguf,
                  out=out, name=name, device=device, enforce_eager=enforce_eager, command=_command_line(),
                  prompt_set=prompt_set, speculative_configs=speculative_configs,
                  speculative_prompts=speculative_prompts, speculative_output_len=speculative_output_len)
    click.echo(text)


@bench.command("serve")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The server (any OpenAI-compatible one).")
@click.option("--model", default=None, help="Model name to send (default: the server's first in /v1/models).")
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--request-rate", type=float, default=float("inf"), show_default=True,
              help="Poisson arrivals per second (inf: all at once).")
@click.option("--max-concurrency", type=int, default=None, help="Requests in flight at most.")
@click.option("--dataset", default="builtin", show_default=True,
              help="builtin (16 short chat questions), fixed:N or random:LO-HI (N-token windows of the built-in "
                   "text, one user message each), conversation (chats with long histories), FILE.jsonl (messages "
                   "or prompt per line) or FILE.txt.")
@click.option("--tokenizer", default=None, help="fixed / random: the tokenizer that counts N (default: the bundled "
                                                "model's).")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Output tokens per request (EOS ignored).")
@click.option("--api-key", default=None, envvar="QTK_API_KEY")
@click.option("--out", type=click.Path(), default="benchmarks/results", show_default=True, help="Directory for the JSON.")
@click.option("--name", default=None, help="JSON file name.")
def bench_serve(url, model, num_prompts, request_rate, max_concurrency, dataset, tokenizer, max_tokens, api_key, out,
                name):
    """TTFT, TPOT, inter-token latency p50/p99 and throughput of a server under load."""
    optional.require(optional.BENCH_SERVE)
    from .bench.serve import run

    _, text = run(url, model, num_prompts, request_rate, max_concurrency, dataset, max_tokens, api_key, out=out,
                  name=name, command=_command_line(), tokenizer=tokenizer)
    click.echo(text)


if __name__ == "__main__":
    sys.exit(main())
