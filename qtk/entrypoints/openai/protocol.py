"""The OpenAI API's request shapes as vLLM accepts them (pydantic), and their SamplingParams.

Unknown fields are ignored, as OpenAI's and vLLM's servers do; a field of the wrong type or out of
range is a 400 that names it (api_server.py turns pydantic's and SamplingParams' errors into OpenAI's
error shape). vLLM's extensions are accepted under their names: top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, skip_special_tokens, include_stop_str_in_output, cache_salt,
structured_outputs (json, json_object, regex, choice, grammar). response_format {"type": "json_object"} or {"type": "json_schema", "json_schema":
{"schema": ...}} constrains the output as OpenAI's does; logit_bias shifts token logits as OpenAI's
does; chat tools and tool_choice are read as vLLM reads them without a tool-call parser
(ChatCompletionRequest).
"""
from __future__ import annotations

import contextlib
import json
import math
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ...errors import InputError
from ...runtime.sampling_params import SamplingParams
from ...runtime.structured_outputs import StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # always enforced here: the grammar masks every step


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON Schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one constraint."""
    model_config = ConfigDict(extra="forbid")

    json_: Union[dict, str, None] = Field(default=None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Text(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        """Every string of the body encodes as UTF-8: JSON can carry a lone surrogate ("\\ud800"),
        which the tokenizer (and the request log) cannot take."""
        todo = [((), data)]
        while todo:  # not recursive: a body may nest deeply
            path, x = todo.pop()
            if isinstance(x, str):
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError as e:
                    where = ".".join(map(str, path)) or "the body"
                    raise ValueError(f"{where} is not valid Unicode: a lone surrogate at character {e.start}") from None
            elif isinstance(x, dict):
                todo.extend(((*path, k), v) for k, v in x.items())
                todo.extend(((*path, "(key)"), k) for k in x)
            elif isinstance(x, list):
                todo.extend(((*path, i), v) for i, v in enumerate(x))
        return data


class _Sampling(_Text):
    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias, clamped to +-100
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1)  # only requests with the same salt share cached KV

    def engine_prompt(self, ids: list[int]) -> list[int] | dict:
        """The prompt as the engine takes it: the token ids, with the request's cache_salt if any."""
        return ids if self.cache_salt is None else {"prompt_token_ids": ids, "cache_salt": self.cache_salt}

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint, from response_format or vLLM's structured_outputs (not both)."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise InputError("give response_format or structured_outputs, not both")
        if so is not None:
            return StructuredOutputsParams(json=so.json_, json_object=so.json_object, regex=so.regex,
                                           choice=so.choice, grammar=so.grammar)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InputError("response_format.json_schema.schema is required for type json_schema")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with integer ids, each bias clamped to [-100, 100] as OpenAI and vLLM do."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise InputError(f"logit_bias keys are token ids; got {key!r}") from None
            if not math.isfinite(bias):
                raise InputError(f"logit_bias values must be finite numbers; token {key} has {bias}")
            out[token] = max(-100.0, min(100.0, bias))
        return out

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, max_tokens=max_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=self.token_bias(), structured_outputs=structured)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt (and its logprobs) before each choice; with max_tokens 0, the prompt alone
    best_of: int | None = None  # refused unless it adds nothing (1 or n): vLLM V1 dropped it too
    suffix: str | None = None  # refused: no insertion here

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        """Content parts are text (qtk's models read text only: an image or audio part would be
        dropped and the answer made without it, so it is refused)."""
        for i, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") != "text":
                raise ValueError(f"content part {i} is {part.get('type')!r}: this model takes text parts only")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: a text part needs a string 'text'")
        return content

    def text(self) -> str:
        """The content as text: a string, or the text parts of a list of content parts."""
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)  # any name, as vLLM takes (MCP tools have dots in theirs)
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # forced calls: objects without additionalProperties get false, as OpenAI's


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class _Messages(_Text):
    """What the chat template reads from a request with messages (chat, /tokenize); each
    subclass declares its `messages`."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None  # extra template variables, e.g. Qwen3's enable_thinking

    def conversation(self) -> list[dict]:
        """The messages for the chat template: role and text, and the fields a template reads (an
        assistant's tool_calls with their arguments as objects and its reasoning_content, a tool
        message's tool_call_id)."""
        out = []
        for m in self.messages:
            msg = {"role": m.role, "content": m.text()}
            extra = m.model_extra or {}
            for key in ("name", "tool_call_id"):
                if isinstance(extra.get(key), str):
                    msg[key] = extra[key]
            thought = extra.get("reasoning", extra.get("reasoning_content"))
            if isinstance(thought, str):  # an earlier turn's thought, as templates that keep it read it
                msg["reasoning_content"] = thought
            if isinstance(extra.get("tool_calls"), list):
                msg["tool_calls"] = [_call_for_template(c) for c in extra["tool_calls"]]
            out.append(msg)
        return out

    def tool_dicts(self) -> list[dict] | None:
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]


class ChatCompletionRequest(_Sampling, _Messages):
    """A chat request. Tools, as vLLM serves them without a tool-call parser: the tools go to the
    chat template; tool_choice "none" answers in text, a named function or "required" is forced by
    the grammar (the arguments always parse and match the function's parameters schema) and comes
    back as tool_calls; "auto" (OpenAI's default when tools are given) needs a model-specific
    parser to tell a call from text (api_server.py's --tool-call-parser): without one, a 400 that says
    what to send instead."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True

    def forced_tools(self, auto: bool = False) -> StructuredOutputsParams | None:
        """The grammar that forces tool calls (a named function's arguments, or for "required" a
        list of {"name", "parameters"}), None when the answer is text (or, with `auto`, text a
        tool-call parser reads); InputError for a tool_choice the request cannot have."""
        choice, tools = self.tool_choice, self.tools or []
        if choice is None:
            choice = "auto" if tools else "none"
        if choice != "none" and not tools:
            raise InputError("tool_choice needs tools: give the functions the model may call in tools")
        if choice == "none" or (choice == "auto" and auto):
            return None
        if choice == "auto":
            raise InputError('tool_choice "auto" (the default when tools are given) needs a tool-call parser: '
                             'start the server with --enable-auto-tool-choice --tool-call-parser NAME for a model '
                             'that writes that syntax, or send tool_choice "required" or '
                             '{"type": "function", "function": {"name": ...}} to force a call, or "none"')
        if (self.response_format is not None and self.response_format.type != "text") or self.structured_outputs:
            raise InputError("a forced tool call constrains the output itself: drop response_format / structured_outputs")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise InputError(f"tools: function names must be unique, got {names}")
        if isinstance(choice, NamedToolChoice):
            tool = next((t for t in tools if t.function.name == choice.function.name), None)
            if tool is None:
                raise InputError(f"tool_choice names function {choice.function.name!r}, which is not in tools "
                                 f"({', '.join(names)})")
            return StructuredOutputsParams(json=_parameters(tool))
        defs: dict = {}  # each tool's $defs, moved to the root where its "#/$defs/..." refs point
        items = []
        for t in tools:
            params = dict(_parameters(t))
            for key in ("$defs", "definitions"):
                named = params.pop(key, None) or {}
                if not isinstance(named, dict):
                    raise InputError(f"tools: {t.function.name}'s parameters.{key} must be an object of named "
                                     f"schemas, got {type(named).__name__}")
                for name, schema in named.items():
                    if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                        raise InputError(f"tools define {key}/{name} differently; give the shared "
                                         "definitions one name each")
            items.append({"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **defs}
        if not self.parallel_tool_calls:
            calls["maxItems"] = 1
        return StructuredOutputsParams(json=calls)


class TokenizeRequest(_Messages):
    """vLLM's /tokenize: a prompt (special tokens added unless add_special_tokens is false), or
    chat messages through the chat template (which writes its own special tokens)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def _parameters(tool: Tool) -> dict:
    """A function's arguments schema (no parameters: an empty object, as OpenAI takes it); with
    strict, every object schema that does not say otherwise takes no other properties. Arguments
    are a JSON object whatever the schema leaves open ({} would allow a bare string or number)."""
    params = tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}
    if "type" not in params:
        params = {**params, "type": "object"}
    return _closed(params) if tool.function.strict else params


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")


def _closed(schema):
    """A copy of schema with additionalProperties false on every object that does not set it."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _closed(s) for name, s in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_closed(s) for s in value]
        elif key in _SCHEMAS:
            value = _closed(value)
        out[key] = value
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _call_for_template(call) -> dict:
    """An assistant message's tool call as chat templates read it: arguments as an object (the API
    carries them as a JSON string), as vLLM passes them."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        with contextlib.suppress(ValueError, RecursionError):  # not JSON (or too deep): the string as sent
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}
