"""The JSON-validity eval: its prompt set loads and covers every category, answers are parsed as
documented (whitespace and one Markdown fence forgiven, nothing else), and constrained decoding
makes a random-weight model's answers all valid where unconstrained ones are not."""
from __future__ import annotations

import json

import pytest

from qtk.errors import InputError, NotFoundError
from qtk.evals.json_validity import json_validity, load_prompts, parse_answer

SMALL = [{"id": f"t-{i}", "category": cat, "prompt": f"Give JSON number {i}.",
          "schema": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                                         "maximum": 9}},
                     "required": ["k", "n"], "additionalProperties": False}}
         for i, cat in enumerate(["x", "y", "x", "y"])]


def test_the_prompt_set_is_whole():
    rows = load_prompts()
    cats = {r["category"] for r in rows}
    assert len(rows) >= 100 and len(cats) >= 6 and len({r["id"] for r in rows}) == len(rows)
    import jsonschema

    for r in rows:
        jsonschema.validators.validator_for(r["schema"]).check_schema(r["schema"])
    assert {r["category"] for r in load_prompts(limit=len(cats))} == cats  # a small limit still has them all


def test_load_prompts_errors(tmp_path):
    with pytest.raises(NotFoundError, match="not found"):
        load_prompts(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(InputError, match="missing schema"):
        load_prompts(bad)
    bad.write_text("{oops\n")
    with pytest.raises(InputError, match="bad.jsonl:1: not valid JSON"):
        load_prompts(bad)
    # a schema or prompt that could only fail after the model ran, and a set that would score nothing
    for line, message in [('{"prompt": "x", "schema": {"type": "objekt"}}', "bad.jsonl:1: schema is not a valid JSON"),
                          ('{"prompt": "x", "schema": "object"}', "bad.jsonl:1: schema must be a JSON Schema object"),
                          ('{"prompt": 5, "schema": {"type": "object"}}', "bad.jsonl:1: prompt must be non-empty text"),
                          ("", "bad.jsonl: no prompts")]:
        bad.write_text(line + "\n")
        with pytest.raises(InputError, match=message):
            load_prompts(bad)


def test_parse_answer_forgives_only_whitespace_and_a_fence():
    assert parse_answer(' {"a": 1}\n') == {"a": 1}
    assert parse_answer('```json\n{"a": 1}\n```') == {"a": 1}
    assert parse_answer('Here it is:\n```json\n{"a": 1}\n```\nThis JSON has ```two``` fences.') == {"a": 1}
    assert parse_answer('```JSON\n{"a": 1}\n```') == {"a": 1}
    assert parse_answer('Here it is:\r\n```json\r\n{"a": 1}\r\n```\r\nDone.') == {"a": 1}
    assert parse_answer('```Json \r\n{"a": 1}```') == {"a": 1}
    for text in ('Sure! {"a": 1}', '{"a": 1} hope this helps', "{'a': 1}", "", '```json\n{"a": 1,}\n```',
                 '{"n": NaN}', '{"n": Infinity}', "-Infinity"):  # Python's extensions, not JSON
        with pytest.raises(ValueError):
            parse_answer(text)


def test_constrained_answers_are_all_valid(tiny_dir):
    from qtk import LLM

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8)
    free = json_validity(llm, SMALL, constrained=False, max_tokens=30)
    held = json_validity(llm, SMALL, constrained=True, max_tokens=30)
    assert free.overall.valid < 4  # a random model does not write this by chance
    assert held.overall.n == held.overall.parsed == held.overall.valid == 4 and held.overall.truncated == 0
    assert set(held.by_category) == {"x", "y"} and held.by_category["x"].n == 2
    d = held.to_dict(answers=True)
    assert d["overall"]["valid_rate"] == 1.0 and len(d["answers"]) == 4
    assert all(json.loads(a["text"])["k"] in ("a", "b") for a in d["answers"])


def test_cli_eval_json(tiny_dir, tmp_path):
    from click.testing import CliRunner

    from qtk.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in SMALL))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["eval", str(tiny_dir), "--task", "json", "--dataset", str(prompts), "--limit", "2",
                                  "--dtype", "float32", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "JSON constrained: parsed 100.0%, schema-valid 100.0% of 2" in r.output
    res = json.loads(out.read_text())["results"]
    assert [x["constrained"] for x in res] == [False, True] and res[1]["overall"]["valid"] == 2
    missing = CliRunner().invoke(main, ["eval", str(tiny_dir), "--task", "json", "--dataset", str(tmp_path / "no.jsonl")])
    assert missing.exit_code == 2 and "not found" in missing.output


def test_a_fixed_answer_scores_exactly(tiny_dir, tmp_path):
    """Constrained decoding fixes the answer (every value a const): the text is known, so the
    metric code is checked against it; the same prompt unconstrained from a random model is not."""
    from qtk import LLM

    schema = {"type": "object", "properties": {"a": {"const": "x"}, "b": {"const": [1, 2]}},
              "required": ["a", "b"], "additionalProperties": False}
    rows = [{"id": "fixed", "category": "c", "prompt": "Anything.", "schema": schema}]
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8)
    held = json_validity(llm, rows, constrained=True, max_tokens=30)
    assert held.answers[0]["text"] == '{"a":"x","b":[1,2]}'
    assert (held.overall.parsed, held.overall.valid, held.by_category["c"].valid_rate) == (1, 1, 1.0)
    import jsonschema

    free = json_validity(llm, rows, constrained=False, max_tokens=30).answers[0]
    try:
        expected = jsonschema.Draft202012Validator(schema).is_valid(parse_answer(free["text"]))
    except ValueError:
        expected = False
    assert free["valid"] == expected


def test_finished_valid_rate_leaves_out_answers_cut_by_max_tokens():
    from qtk.evals.json_validity import Tally

    t = Tally()
    t.add(True, True, False)
    t.add(False, False, True)  # ran into max_tokens mid-document
    assert t.valid_rate == 0.5 and t.finished_valid_rate == 1.0
    t.add(True, False, False)  # ended by itself, invalid: with structured outputs, a bug
    assert t.finished_valid_rate == 0.5
    assert Tally().finished_valid_rate == 0.0
    cut = Tally()
    for _ in range(3):
        cut.add(False, False, True)
    assert cut.finished_valid_rate == 0.0  # nothing finished: no evidence of valid output, a gate on it fails
