"""JSON validity: asked for JSON that matches a schema, does the model write it?

The prompt set (evals/json_prompts.jsonl, written by this team: 120 prompts in six
categories, flat and nested objects, arrays, enums, numbers, strings that need escapes; each with
a JSON Schema whose objects are closed and whose strings, arrays and numbers are bounded, as
OpenAI's strict mode asks) is run greedily through qtk's runtime, with the chat template when the
model has one, and each answer is checked twice:
  parsed  json.loads accepts the answer stripped of surrounding whitespace or, when the answer
          has a Markdown code fence (```json ... ```, which chat models wrap JSON in and then
          talk on after), the first fenced block; nothing else is forgiven (prose before
          unfenced JSON, single quotes, trailing commas fail)
  valid   the parsed value validates against the prompt's schema (jsonschema, the schema's draft)
Unconstrained, this measures the model (what a quantized checkpoint must not lose); constrained
(structured outputs: the schema as a grammar while decoding) it measures the serving stack, where
anything under 100% valid is a bug unless the answer ran into max_tokens (counted as `truncated`).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..assets import eval_data
from ..chat_template import has_template, prompt_ids
from ..data import jsonl_rows
from ..errors import InputError

PROMPTS = eval_data("json_prompts.jsonl")
FENCE = re.compile(r"```(?:json)?[ \t]*\r?\n(.*?)```", re.S | re.I)  # ```JSON too, and CRLF line ends


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The prompt set: dicts with id, category, prompt and schema. limit takes the first N of each
    category in turn, so a small limit still covers every category."""
    path = Path(path) if path else PROMPTS
    rows = []
    for n, row in jsonl_rows(path, "JSON prompt set"):
        if not isinstance(row, dict):
            raise InputError(f"{path}:{n}: each line must be a JSON object with prompt and schema")
        missing = {"prompt", "schema"} - set(row)
        if missing:
            raise InputError(f"{path}:{n}: missing {', '.join(sorted(missing))} (each line needs prompt and schema)")
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise InputError(f"{path}:{n}: prompt must be non-empty text, got {row['prompt']!r}"[:300])
        _check_schema(f"{path}:{n}", row["schema"])
        rows.append({"id": row.get("id", f"line-{n}"), "category": row.get("category", "all"), **row})
    if not rows:
        raise InputError(f"{path}: no prompts (each line a JSON object with prompt and schema)")
    if limit is not None:
        by_cat: dict[str, list[dict]] = {}
        for r in rows:
            by_cat.setdefault(r["category"], []).append(r)
        rows = [r for i in range(limit) for cat in by_cat.values() if i < len(cat) for r in [cat[i]]][:limit]
    return rows


def _check_schema(where: str, schema) -> None:
    """A JSON Schema object its draft's metaschema accepts (else every answer would fail to
    validate only after the model ran)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise InputError(f"{where}: schema must be a JSON Schema object, got {schema!r}"[:300])
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        raise InputError(f"{where}: schema is not a valid JSON Schema: {e.message}"[:300]) from e


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def parse_answer(text: str):
    """The JSON value of an answer (its first fenced block, if it has one), or raise ValueError.
    Standard JSON only: Python's NaN / Infinity extensions are not accepted."""
    fenced = FENCE.search(text)
    return json.loads(fenced.group(1) if fenced else text.strip(), parse_constant=_not_json)


@dataclass
class Tally:
    n: int = 0
    parsed: int = 0
    valid: int = 0
    truncated: int = 0  # ran into max_tokens
    valid_finished: int = 0  # valid among the answers that ended by themselves

    def add(self, parsed: bool, valid: bool, truncated: bool) -> None:
        self.n += 1
        self.parsed += parsed
        self.valid += valid
        self.truncated += truncated
        self.valid_finished += valid and not truncated

    @property
    def finished_valid_rate(self) -> float:
        """Schema-valid among the answers that did not run into max_tokens: with structured
        outputs, anything under 1 is a serving bug (a cut-off answer is the length limit's).
        0 when no answer finished: every one cut off is no evidence of valid output."""
        return self.valid_finished / (self.n - self.truncated) if self.n > self.truncated else 0.0

    @property
    def parse_rate(self) -> float:
        return self.parsed / self.n if self.n else 0.0

    @property
    def valid_rate(self) -> float:
        return self.valid / self.n if self.n else 0.0


@dataclass
class JsonValidityResult:
    constrained: bool
    overall: Tally
    by_category: dict[str, Tally]
    answers: list[dict] = field(repr=False)  # id, category, text, parsed, valid, finish_reason

    def to_dict(self, answers: bool = False) -> dict:
        out = {"constrained": self.constrained,
               "overall": {**asdict(self.overall), "parse_rate": self.overall.parse_rate,
                           "valid_rate": self.overall.valid_rate},
               "by_category": {k: {**asdict(t), "parse_rate": t.parse_rate, "valid_rate": t.valid_rate}
                               for k, t in self.by_category.items()}}
        if answers:
            out["answers"] = self.answers
        return out

    def __str__(self) -> str:
        t = self.overall
        head = (f"JSON {'constrained' if self.constrained else 'unconstrained'}: parsed {t.parse_rate:.1%}, "
                f"schema-valid {t.valid_rate:.1%} of {t.n}" + (f" ({t.truncated} hit max_tokens)" if t.truncated else ""))
        cats = ", ".join(f"{k} {v.valid_rate:.0%}" for k, v in self.by_category.items())
        return f"{head}; valid by category: {cats}"


def json_validity(llm, prompts: list[dict], constrained: bool, max_tokens: int = 256) -> JsonValidityResult:
    """Every prompt greedily, as one batch on the engine; each answer parsed and validated."""
    import jsonschema

    from ..runtime.sampling_params import SamplingParams
    from ..runtime.structured_outputs import StructuredOutputsParams

    chat = has_template(llm.tokenizer)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0,
                             structured_outputs=StructuredOutputsParams(json=p["schema"]) if constrained else None)
              for p in prompts]
    if chat:
        ids = [prompt_ids(llm.tokenizer, [{"role": "user", "content": p["prompt"]}]) for p in prompts]
    else:
        ids = [llm.tokenizer(p["prompt"]).input_ids for p in prompts]
    outs = llm.generate(ids, params)
    overall, by_cat, answers = Tally(), {}, []
    for p, out in zip(prompts, outs):
        c = out.outputs[0]
        try:
            value = parse_answer(c.text)
            parsed = True
        except ValueError:
            value, parsed = None, False
        valid = parsed and jsonschema.validators.validator_for(p["schema"])(p["schema"]).is_valid(value)
        truncated = c.finish_reason == "length"
        overall.add(parsed, valid, truncated)
        by_cat.setdefault(p["category"], Tally()).add(parsed, valid, truncated)
        answers.append({"id": p["id"], "category": p["category"], "text": c.text, "parsed": parsed, "valid": valid,
                        "finish_reason": c.finish_reason})
    return JsonValidityResult(constrained, overall, by_cat, answers)
