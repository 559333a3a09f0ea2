"""Structured outputs: the grammar's mask, the engine finishing a document, and every output of a
random-weight model (the harshest writer: it would put any token anywhere) parsing and matching
its schema, greedy and sampled, while the rows without a grammar are untouched."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from qtk.errors import InputError
from qtk.runtime.sampling_params import SamplingParams
from qtk.runtime.structured_outputs import GrammarEngine, StructuredOutputsParams

S = {"type": "string", "maxLength": 8}
# a random model's greedy choice in a number without multipleOf is "9" forever (99.999...: still
# below 180); multipleOf bounds the decimals
LAT = {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.001}
LON = {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.001}

# bounded (strings, arrays, closed objects) so that a random walk ends well inside the tiny model's 256 tokens
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {"name": S,
                       "address": {"type": "object",
                                   "properties": {"city": S, "geo": {"type": "object",
                                                                     "properties": {"lat": LAT, "lon": LON},
                                                                     "required": ["lat", "lon"],
                                                                     "additionalProperties": False}},
                                   "required": ["city", "geo"], "additionalProperties": False},
                       "active": {"type": "boolean"}},
        "required": ["name", "address", "active"], "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "label": S},
                                           "required": ["id", "label"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "level": {"enum": [1, 2.5, None, True, "top"]},
                       "kind": {"const": "widget"}},
        "required": ["color", "level", "kind"], "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "temp": {"type": "number", "minimum": -50, "maximum": 60, "multipleOf": 0.5}},
        "required": ["age", "score", "temp"], "additionalProperties": False,
    },
    "escapes": {  # the string values hold a backslash and quotes: the JSON text must escape them
        "type": "object",
        "properties": {"path": {"type": "string", "pattern": r"^[A-Z]:\\[a-z]{1,6}$"},
                       "quoted": {"type": "string", "pattern": r'^"[a-z ]{1,6}"$'},
                       "free": S},
        "required": ["path", "quoted", "free"], "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def llm(tiny_dir):
    from qtk import LLM

    return LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=2**22, block_size=8)


def test_params_take_exactly_one_constraint():
    assert StructuredOutputsParams(json_object=True).json_object
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    for bad in (dict(), dict(json={"type": "object"}, regex="a+"), dict(choice=[]), dict(choice=["a", ""])):
        with pytest.raises(InputError, match="structured outputs"):
            StructuredOutputsParams(**bad)


def test_unsupported_or_malformed_grammars_are_input_errors(llm):
    cases = [(StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
             (StructuredOutputsParams(json="{not json"), "structured outputs"),
             (StructuredOutputsParams(json="[1, 2]"), "must be an object"),
             (StructuredOutputsParams(regex="(unclosed"), "unclosed group"),
             # a regex's reason is on a later line of llguidance's message: the 400 says it
             (StructuredOutputsParams(json={"type": "string", "pattern": "[z-a]"}), "start must be <= the end"),
             (StructuredOutputsParams(grammar="start: nonexistent_rule"), "structured outputs")]
    for spec, message in cases:
        with pytest.raises(InputError, match=message):
            llm.grammars.check(spec)
        with pytest.raises(InputError, match=message):  # the engine refuses it before holding anything
            llm.add_request("Hello", SamplingParams(structured_outputs=spec))
    assert not llm.has_unfinished_requests() and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_an_overlapping_one_of_is_refused_with_the_way_to_ask_for_any_of(llm):
    """llguidance cannot enforce a oneOf whose branches overlap: a 400 that says how a schema asks
    for anyOf instead, and with that option each output matches a branch."""
    shape = {"type": "object", "properties": {"v": {"oneOf": [{"type": "string", "maxLength": 4},
                                                              {"type": "string", "pattern": "^[a-c]{1,3}$"},
                                                              {"type": "integer", "minimum": 0, "maximum": 99}]}},
             "required": ["v"], "additionalProperties": False}
    with pytest.raises(InputError, match=r'"x-guidance": \{"coerce_one_of": true\}'):
        llm.grammars.check(StructuredOutputsParams(json=shape))
    spec = StructuredOutputsParams(json={**shape, "x-guidance": {"coerce_one_of": True}})
    llm.grammars.check(spec)
    outs = llm.generate(["Reply in JSON:"] * 3, [SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                                structured_outputs=spec) for i in range(3)])
    as_any = json.loads(json.dumps(shape).replace('"oneOf"', '"anyOf"'))
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), as_any)


def test_mask_forbids_exactly_the_disallowed_tokens(llm):
    g: GrammarEngine = llm.grammars
    m = g.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    V = llm.model.embed_tokens.weight.shape[0]
    logits = torch.randn(3, V)
    before = logits.clone()
    g.mask(logits, [(m, 1)])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])  # rows without a grammar
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and torch.equal(logits[1, allowed], before[1, allowed])
    tok = llm.tokenizer
    assert all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t in allowed)
    assert tok.encode("yes", add_special_tokens=False)[0] in allowed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_parses_and_matches_its_schema(llm, temperature):
    names = list(SCHEMAS)
    params = [SamplingParams(max_tokens=200, temperature=temperature, seed=i, n=1 if temperature == 0 else 3,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]))
              for i, name in enumerate(names)]
    plain = SamplingParams(max_tokens=20, temperature=0)  # rides along in the same batches, unconstrained
    outs = llm.generate(["Reply in JSON:"] * len(names) + ["Reply in JSON:"], params + [plain])
    for name, out in zip(names, outs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (name, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
    alone = llm.generate("Reply in JSON:", plain)[0].outputs[0]
    assert outs[-1].outputs[0].token_ids == alone.token_ids  # a neighbour's grammar changes nothing here


def test_json_object_regex_choice_and_lark(llm):
    specs = [StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
             StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
             StructuredOutputsParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/')]
    outs = llm.generate(["Answer:"] * 4, [SamplingParams(max_tokens=200, temperature=1.0, seed=3,
                                                          structured_outputs=s) for s in specs])
    obj, code, choice, expr = (o.outputs[0] for o in outs)
    if obj.finish_reason == "stop":  # any object: its keys are free, so a random walk may run long
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", code.text) and code.finish_reason == "stop"
    assert choice.text in ("positive", "negative", "neutral") and choice.finish_reason == "stop"
    assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", expr.text) or expr.finish_reason == "length"


def test_logprobs_are_the_models_own_and_preemption_keeps_the_grammar(tiny_dir):
    """A grammar request preempted for recompute goes on from where its matcher is; its logprobs
    come from the unmasked distribution (as vLLM reports them)."""
    from qtk import LLM

    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x float32 bytes
    small = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory=40 * 8 * per_token,
                block_size=8, enable_prefix_caching=False)  # 320 token slots: six long requests cannot all stay
    spec = StructuredOutputsParams(json=SCHEMAS["array"])
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, logprobs=0, structured_outputs=spec)
              for i in range(6)]
    outs = small.generate(["Reply in JSON: " * 15] * 6, params)
    assert small.scheduler.num_preemptions > 0
    for out in outs:
        c = out.outputs[0]
        jsonschema.validate(json.loads(c.text), SCHEMAS["array"])
        assert len(c.logprobs) == len(c.token_ids)
        assert c.logprobs[0][c.token_ids[0]] < -1.0  # "{" is forced, yet unlikely to the random model
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks
