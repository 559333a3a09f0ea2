"""xgrammar vs llguidance as the grammar engine behind structured outputs (OpenAI `response_format`
json_object / json_schema), measured with the bundled model's tokenizer (SmolLM2-135M-Instruct,
vocab 49152) on the CPU. Results and the choice: benchmarks/results/grammar_backends.md.

Neither package is a qtk dependency, so this runs in a scratch venv that sees the system torch /
transformers (do not let pip replace torch):

    python3 -m venv --system-site-packages /tmp/gram-venv
    /tmp/gram-venv/bin/pip install xgrammar==0.2.8 llguidance==1.9.1 jsonschema
    /tmp/gram-venv/bin/python benchmarks/grammar_backends.py [--tokenizer DIR] [--threads 2]
        [--repeats 5] [--samples 20] [--max-tokens 300] [--json OUT.json]

What it measures, for each backend (medians over --repeats; every figure is wall time):
  setup      tokenizer info / compiler construction (once per model)
  compile    the built-in JSON grammar (json_object) and 5 JSON schemas, with the cache off, and the
             time to the first token mask afterwards (llguidance builds its lexer lazily)
  features   extra JSON-schema keywords, one at a time: rejected at compile time, or accepted and then
             enforced / ignored (judged by validating random samples)
  mask       per decoding step: the allowed-token bitmask for 1, 16 and 64 sequences (each its own
             matcher, mid-way through a document, grammars mixed), the batched/threaded API and a
             serial loop; the accept-token call; applying the bitmask to float32 logits [B, vocab]
             with each library's own helper
  samples    correctness: each grammar is driven with tokens drawn uniformly among the allowed ones
             (EOS included once allowed) until it terminates or --max-tokens; the ids are decoded with
             the HF tokenizer, then json.loads and jsonschema (with the format checker)
  behaviour  termination / EOS / rollback, printed as observed
All JSON is compiled with compact separators (no free whitespace), so uniform random sampling can
finish a document within --max-tokens; both libraries can also allow free whitespace.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import statistics
import time
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")

DEFAULT_TOKENIZER = "smollm2-135m"  # the bundled model (its bf16 conversion's folder); or any HF folder

# --------------------------------------------------------------------------------------------- schemas
S = {"type": "string", "maxLength": 12}   # bounded so that uniform random sampling ends strings

SCHEMAS = {
    "nested_required": {
        "type": "object",
        "properties": {
            "name": S,
            "address": {"type": "object",
                        "properties": {"street": S, "city": S,
                                       "geo": {"type": "object",
                                               "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                                               "required": ["lat", "lon"], "additionalProperties": False}},
                        "required": ["street", "city", "geo"], "additionalProperties": False},
            "active": {"type": "boolean"},
        },
        "required": ["name", "address", "active"], "additionalProperties": False,
    },
    "array_min_max": {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 4,
                                 "items": {"type": "object",
                                           "properties": {"id": {"type": "integer"}, "label": S},
                                           "required": ["id", "label"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                       "level": {"enum": [1, 2.5, None, True, "top"]},
                       "kind": {"const": "widget"}},
        "required": ["color", "size", "level", "kind"], "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "count": {"type": "integer", "minimum": 10, "maximum": 999},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "temp": {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60}},
        "required": ["age", "count", "score", "temp"], "additionalProperties": False,
    },
    "string_escapes": {
        "type": "object",
        "properties": {"path": {"type": "string", "pattern": r"^[A-Z]:\\[a-z]{1,8}$"},
                       "quoted": {"type": "string", "pattern": r'^"[a-z ]{1,10}"$'},
                       "free": {"type": "string", "maxLength": 8},
                       "email": {"type": "string", "format": "email", "maxLength": 40},
                       "day": {"type": "string", "format": "date"}},
        "required": ["path", "quoted", "free", "email", "day"], "additionalProperties": False,
    },
    "no_additional": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10000},
                       "tag": S,
                       "meta": {"type": "object", "properties": {"k": S},
                                "patternProperties": {"^x_[a-z]{1,3}$": {"type": "integer"}},
                                "additionalProperties": False}},
        "required": ["id"],
        "additionalProperties": False,
    },
}
JSON_OBJECT = "json_object"           # {"type": "object"}: what response_format json_object asks for
JSON_BUILTIN = "json_builtin"         # xgrammar's built-in JSON grammar (any value, free whitespace)
GRAMMARS = [JSON_OBJECT] + list(SCHEMAS)


def _wrap(frag):
    return {"type": "object", "properties": {"v": frag}, "required": ["v"], "additionalProperties": False}


FEATURE_PROBES = {
    "pattern": _wrap({"type": "string", "pattern": "^[a-c]{2}-[0-9]{2}$"}),
    "format: email": _wrap({"type": "string", "format": "email", "maxLength": 30}),
    "format: date": _wrap({"type": "string", "format": "date"}),
    "format: date-time": _wrap({"type": "string", "format": "date-time"}),
    "format: uuid": _wrap({"type": "string", "format": "uuid"}),
    "minLength/maxLength": _wrap({"type": "string", "minLength": 3, "maxLength": 5}),
    "multipleOf": _wrap({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 1000}),
    "uniqueItems": _wrap({"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3, "maxItems": 3,
                          "uniqueItems": True}),
    "contains": _wrap({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                       "minItems": 1, "maxItems": 3, "contains": {"const": 7}}),
    "prefixItems": _wrap({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
                          "items": False}),
    "min/maxProperties": _wrap({"type": "object", "additionalProperties": {"type": "integer"},
                                "minProperties": 2, "maxProperties": 3}),
    "patternProperties": _wrap({"type": "object", "patternProperties": {"^x_[a-z]{1,3}$": {"type": "integer"}},
                                "additionalProperties": False}),
    "propertyNames": _wrap({"type": "object", "propertyNames": {"pattern": "^[a-z]{1,4}$"},
                            "additionalProperties": {"type": "integer"}}),
    "anyOf": _wrap({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}),
    "oneOf (overlapping)": _wrap({"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                            {"type": "integer", "minimum": 5, "maximum": 20}]}),
    "allOf": _wrap({"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 9}]}),
    "$ref + $defs (recursive)": {"$defs": {"node": {"type": "object",
                                                     "properties": {"n": {"type": "integer"},
                                                                    "kids": {"type": "array", "maxItems": 2,
                                                                             "items": {"$ref": "#/$defs/node"}}},
                                                     "required": ["n"], "additionalProperties": False}},
                                 "$ref": "#/$defs/node"},
    "not": _wrap({"not": {"type": "string"}}),
    "if/then/else": _wrap({"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 20},
                           "else": {"maximum": 0}}),
}


# --------------------------------------------------------------------------------------------- helpers
def med(xs):
    return statistics.median(xs)


def timed(fn, repeats):
    out, ts = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return out, med(ts)


def allowed_ids(mask_row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def validator_for(name, schema):
    import jsonschema
    if name == JSON_OBJECT:
        return lambda doc: isinstance(doc, dict)
    if name == JSON_BUILTIN:
        return lambda doc: True
    v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return lambda doc: v.is_valid(doc)


# --------------------------------------------------------------------------------------------- backends
class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab, threads):
        import xgrammar as xgr
        self.xgr, self.vocab, self.threads, self.eos = xgr, vocab, threads, tok.eos_token_id
        self.version = importlib.metadata.version("xgrammar")
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[self.eos])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    @staticmethod
    def setup(tok, vocab, threads):
        import xgrammar as xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
        return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def compile(self, name, schema):
        if name == JSON_BUILTIN:
            return self.compiler.compile_builtin_json_grammar()
        s = {"type": "object"} if name == JSON_OBJECT else schema
        return self.compiler.compile_json_schema(json.dumps(s), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def alloc(self, b):
        return self.xgr.allocate_token_bitmask(b, self.vocab)

    def fill(self, m, bitmask, i=0):
        m.fill_next_token_bitmask(bitmask, i)

    def fill_batch(self, ms, bitmask):
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m, t):
        return m.accept_token(t)

    def accept_batch(self, ms, ts):
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, ts)

    def done(self, m):
        return m.is_terminated()

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab, threads):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.lt, self.vocab, self.eos = llguidance, llguidance.torch, vocab, tok.eos_token_id
        self.version = llguidance.__version__
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=self.eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    @staticmethod
    def setup(tok, vocab, threads):
        import llguidance
        import llguidance.hf
        t = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=tok.eos_token_id)
        llguidance.LLExecutor(num_threads=threads)
        return t

    def compile(self, name, schema):
        if name == JSON_BUILTIN:
            raise ValueError("no built-in JSON grammar object; json_object is compiled from {\"type\": \"object\"}")
        s = {"type": "object"} if name == JSON_OBJECT else schema
        grammar = self.llg.LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)  # builds the grammar (lexer is lazy)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def alloc(self, b):
        return self.lt.allocate_token_bitmask(b, self.vocab)

    def fill(self, m, bitmask, i=0):
        self.lt.fill_next_token_bitmask(m, bitmask, i)

    def fill_batch(self, ms, bitmask):
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def accept(self, m, t):
        return m.consume_token(t)

    def accept_batch(self, ms, ts):
        return self.lt.consume_token_par(self.executor, list(zip(ms, ts)))

    def done(self, m):
        return m.is_stopped()

    def apply(self, logits, bitmask):
        self.lt.apply_token_bitmask_inplace(logits, bitmask)


# --------------------------------------------------------------------------------------------- measurements
def random_walk(be, compiled, vocab, rng, max_tokens, bitmask=None):
    """Drive a fresh matcher with uniformly drawn allowed tokens. Returns (ids incl. EOS, status)."""
    m = be.matcher(compiled)
    bitmask = be.alloc(1) if bitmask is None else bitmask
    ids = []
    for _ in range(max_tokens):
        be.fill(m, bitmask)
        allowed = allowed_ids(bitmask[0], vocab)
        if len(allowed) == 0:
            return ids, "empty-mask"
        t = int(allowed[rng.randrange(len(allowed))])
        if not be.accept(m, t):
            return ids, "rejected-allowed-token"
        ids.append(t)
        if be.done(m):
            return ids, "terminated"
    return ids, "max-tokens"


def sample_check(be, compiled, name, schema, tok, vocab, n, max_tokens, seed):
    rng = random.Random(seed)
    ok_valid = validator_for(name, schema)
    res = {"terminated": 0, "eos": 0, "parsed": 0, "valid": 0, "other": {}, "bad_examples": []}
    bitmask = be.alloc(1)
    for _ in range(n):
        ids, status = random_walk(be, compiled, vocab, rng, max_tokens, bitmask)
        if status != "terminated":
            res["other"][status] = res["other"].get(status, 0) + 1
            continue
        res["terminated"] += 1
        if ids and ids[-1] == tok.eos_token_id:
            res["eos"] += 1
            ids = ids[:-1]
        text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        try:
            doc = json.loads(text)
        except ValueError:
            res["bad_examples"].append(text[:200])
            continue
        res["parsed"] += 1
        if ok_valid(doc):
            res["valid"] += 1
        elif len(res["bad_examples"]) < 3:
            res["bad_examples"].append(text[:200])
    return res


def mid_document_matchers(be, compiled_list, b, vocab, rng):
    """b matchers, grammar i % len, each walked a random 5..25 allowed tokens into its document
    (re-drawn if the walk terminates early)."""
    ms = []
    bitmask = be.alloc(1)
    while len(ms) < b:
        m = be.matcher(compiled_list[len(ms) % len(compiled_list)])
        steps, okay = rng.randint(5, 25), True
        for _ in range(steps):
            be.fill(m, bitmask)
            allowed = allowed_ids(bitmask[0], vocab)
            allowed = allowed[allowed != be.eos]
            if len(allowed) == 0:
                okay = False
                break
            be.accept(m, int(allowed[rng.randrange(len(allowed))]))
            if be.done(m):
                okay = False
                break
        if okay:
            ms.append(m)
    return ms


def step_costs(be, compiled_list, b, vocab, steps, seed, batched):
    """Decode `steps` steps of b sequences from mid-document states: time the mask fill (the batched
    API, or a serial loop over the matchers) and the accept call (batched for b > 1); a finished
    sequence restarts. The same seed walks the same states in both modes."""
    rng = random.Random(seed)
    ms = mid_document_matchers(be, compiled_list, b, vocab, rng)
    bitmask = be.alloc(b)
    t_fill, t_accept = [], []
    for _ in range(steps):
        t = time.perf_counter()
        if batched and b > 1:
            be.fill_batch(ms, bitmask)
        else:
            for i, m in enumerate(ms):
                be.fill(m, bitmask, i)
        t_fill.append(time.perf_counter() - t)
        toks = []
        for i in range(b):
            allowed = allowed_ids(bitmask[i], vocab)
            allowed = allowed[allowed != be.eos] if len(allowed) > 1 else allowed
            toks.append(int(allowed[rng.randrange(len(allowed))]))
        t = time.perf_counter()
        if b > 1:
            be.accept_batch(ms, toks)
        else:
            be.accept(ms[0], toks[0])
        t_accept.append(time.perf_counter() - t)
        for i, m in enumerate(ms):
            if be.done(m):
                ms[i] = be.matcher(compiled_list[i % len(compiled_list)])
    us = lambda xs: round(med(xs) * 1e6, 1)
    return {("fill_batched_us" if batched else "fill_serial_us"): us(t_fill), "accept_us": us(t_accept)}


def apply_costs(be, b, vocab, repeats):
    torch.manual_seed(0)
    logits = torch.randn(b, vocab, dtype=torch.float32)
    bitmask = be.alloc(b)
    bitmask.random_(-(2 ** 31), 2 ** 31 - 1)
    t = time.perf_counter()
    be.apply(logits.clone(), bitmask)     # warm-up (llguidance's helper is torch.compile'd)
    first = time.perf_counter() - t
    ts = []
    for _ in range(max(repeats, 20)):
        x = logits.clone()
        t = time.perf_counter()
        be.apply(x, bitmask)
        ts.append(time.perf_counter() - t)
    # check against a reference
    ref = logits.clone()
    bits = torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab])
    ref[bits == 0] = float("-inf")
    correct = torch.equal(x, ref)
    # plain torch for comparison (what qtk's sampler could do by itself): a 256 x 8 lookup table
    # from the bitmask's bytes to booleans, then masked_fill_
    lut = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()
    tt = []
    for _ in range(max(repeats, 20)):
        y = logits.clone()
        t = time.perf_counter()
        keep = lut[bitmask.view(torch.uint8).long()].view(b, -1)[:, :vocab]
        y.masked_fill_(~keep, float("-inf"))
        tt.append(time.perf_counter() - t)
    correct = correct and torch.equal(y, ref)
    return {"apply_us": round(med(ts) * 1e6, 1), "first_call_s": round(first, 3),
            "apply_plain_torch_us": round(med(tt) * 1e6, 1), "correct": correct}


def feature_probe(be, name, schema, tok, vocab, n, max_tokens, seed):
    try:
        t = time.perf_counter()
        compiled = be.compile(name, schema)
        dt = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001
        return {"status": "rejected", "error": str(e).splitlines()[0][:160]}
    r = sample_check(be, compiled, name, schema, tok, vocab, n, max_tokens, seed)
    status = ("enforced" if r["valid"] == r["terminated"] else "NOT enforced") if r["terminated"] else "no sample ended"
    return {"status": status, "compile_ms": round(dt * 1e3, 1), "valid": r["valid"], "terminated": r["terminated"],
            "bad_examples": r["bad_examples"][:1]}


def behaviour(be, tok, vocab):
    """Termination, EOS and rollback as observed on {"type":"object","properties":{"a":{"const":1}},...}."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    compiled = be.compile("probe", schema)
    m = be.matcher(compiled)
    bm = be.alloc(1)
    out = {}
    be.fill(m, bm)
    out["eos_allowed_at_start"] = bool(tok.eos_token_id in set(allowed_ids(bm[0], vocab).tolist()))
    for text in ('{"a":7}', '{"a": 7}'):      # compact separators differ: llguidance ":", xgrammar ": "
        ids = tok.encode(text, add_special_tokens=False)
        if all(be.accept(m, t) for t in ids):
            break
        m = be.matcher(compiled)
    out["doc"] = text
    be.fill(m, bm)
    allowed = allowed_ids(bm[0], vocab).tolist()
    out["allowed_after_complete_doc"] = [tok.convert_ids_to_tokens(a) for a in allowed[:5]] + (["..."] if len(allowed) > 5 else [])
    out["done_before_eos"] = be.done(m)
    if be.name == "xgrammar":
        out["is_completed_before_eos"] = m.is_completed()
    else:
        out["is_accepting_before_eos"] = m.is_accepting()
    out["accept_eos"] = be.accept(m, tok.eos_token_id)
    out["done_after_eos"] = be.done(m)
    try:
        be.fill(m, bm)
        out["n_allowed_after_eos"] = int(len(allowed_ids(bm[0], vocab)))
    except Exception as e:  # noqa: BLE001
        out["n_allowed_after_eos"] = f"fill raises: {str(e).splitlines()[-1][-100:]}"
    # rollback over the EOS and the closing brace, then refill
    try:
        r = m.rollback(2)
        out["rollback_2_ok"] = True if r is None else bool(r)
        out["done_after_rollback"] = be.done(m)
        be.fill(m, bm)
        out["allowed_after_rollback"] = [tok.convert_ids_to_tokens(a) for a in allowed_ids(bm[0], vocab).tolist()[:5]]
    except Exception as e:  # noqa: BLE001
        out["rollback_2_ok"] = f"error: {e}"
    # wrong token before completion
    m2 = be.matcher(compiled)
    out["accept_eos_at_start"] = be.accept(m2, tok.eos_token_id)
    # an object schema without additionalProperties: may another key follow "a"?
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}
    mo = be.matcher(be.compile("open", open_schema))
    for t in tok.encode(text[:-1], add_special_tokens=False):
        be.accept(mo, t)
    be.fill(mo, bm)
    out["open_object_allows_extra_key"] = bool(tok.encode(",", add_special_tokens=False)[0]
                                               in set(allowed_ids(bm[0], vocab).tolist()))
    m3 = be.matcher(compiled)
    out["accept_invalid_token"] = be.accept(m3, tok.encode("x", add_special_tokens=False)[0])
    if be.name == "llguidance":
        out["after_invalid_is_error"] = m3.is_error()
        out["after_invalid_error"] = m3.get_error()[:120]
    else:
        out["after_invalid_can_continue"] = be.accept(m3, tok.encode("{", add_special_tokens=False)[0])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--probe-samples", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    ap.add_argument("--backends", default="xgrammar,llguidance")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: features,samples")
    ap.add_argument("--json", help="write all figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))

    from transformers import AutoTokenizer

    from qtk.loading import resolve
    folder = str(resolve(args.tokenizer))
    tok = AutoTokenizer.from_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    results = {"python": platform.python_version(), "torch": torch.__version__,
               "transformers": importlib.metadata.version("transformers"),
               "jsonschema": importlib.metadata.version("jsonschema"),
               "cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
               "loadavg_start": os.getloadavg(), "vocab": vocab, "args": vars(args), "backends": {}}
    classes = {"xgrammar": XGrammar, "llguidance": LLGuidance}
    for bname in args.backends.split(","):
        cls = classes[bname]
        R = results["backends"][bname] = {}
        print(f"== {bname}", flush=True)
        _, R["setup_s"] = timed(lambda: cls.setup(tok, vocab, args.threads), args.repeats)
        be = cls(tok, vocab, args.threads)
        R["version"] = be.version
        print(f"  setup {R['setup_s'] * 1e3:.0f} ms", flush=True)

        R["compile"], compiled = {}, {}
        bm = be.alloc(1)
        for name in [JSON_BUILTIN] + GRAMMARS:
            schema = SCHEMAS.get(name)
            try:
                c, dt = timed(lambda: be.compile(name, schema), args.repeats)
            except Exception as e:  # noqa: BLE001
                R["compile"][name] = {"error": str(e).splitlines()[0][:200]}
                print(f"  compile {name}: ERROR {R['compile'][name]['error']}", flush=True)
                continue
            compiled[name] = c
            firsts = []
            for _ in range(args.repeats):
                m = be.matcher(c)
                t = time.perf_counter()
                be.fill(m, bm)
                firsts.append(time.perf_counter() - t)
            R["compile"][name] = {"compile_ms": round(dt * 1e3, 2), "first_mask_us": round(med(firsts) * 1e6, 1)}
            print(f"  compile {name}: {R['compile'][name]}", flush=True)

        clist = [compiled[n] for n in GRAMMARS if n in compiled]
        R["steps"] = {}
        for b in (1, 16, 64):
            R["steps"][b] = step_costs(be, clist, b, vocab, args.steps, seed=b, batched=False)
            R["steps"][b].update(step_costs(be, clist, b, vocab, args.steps, seed=b, batched=True))
            R["steps"][b].update(apply_costs(be, b, vocab, args.repeats))
            print(f"  B={b}: {R['steps'][b]}", flush=True)

        if "samples" not in skip:
            R["samples"] = {}
            for k, name in enumerate(GRAMMARS):
                if name not in compiled:
                    continue
                r = sample_check(be, compiled[name], name, SCHEMAS.get(name), tok, vocab, args.samples,
                                 args.max_tokens, seed=1000 + k)
                R["samples"][name] = r
                print(f"  samples {name}: terminated {r['terminated']}/{args.samples} (eos {r['eos']}) "
                      f"parsed {r['parsed']} valid {r['valid']} other {r['other']} bad {r['bad_examples'][:2]}",
                      flush=True)

        if "features" not in skip:
            R["features"] = {}
            for k, (name, schema) in enumerate(FEATURE_PROBES.items()):
                R["features"][name] = feature_probe(be, name, schema, tok, vocab, args.probe_samples,
                                                    args.max_tokens, seed=2000 + k)
                print(f"  feature {name}: {R['features'][name]}", flush=True)

        R["behaviour"] = behaviour(be, tok, vocab)
        print(f"  behaviour: {json.dumps(R['behaviour'])}", flush=True)
    results["loadavg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
