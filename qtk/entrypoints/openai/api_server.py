"""`qtk serve`: the OpenAI-compatible HTTP API over AsyncLLM (FastAPI on uvicorn), shaped as vLLM
serves it (docs: shared formats, OpenAI API):

    POST /v1/completions, /v1/chat/completions   JSON, or SSE chunks ending `data: [DONE]` (stream)
    GET  /v1/models, /health, /version, /metrics (Prometheus; vLLM's names under `qtk:`, metrics.py)
    POST /tokenize, /detokenize; GET /tokenizer_info   vLLM's (lm-eval's remote tokenizer reads them)

A request is checked at the edge: malformed JSON, a missing or ill-typed field, a parameter out of
range, an unknown model name, a prompt or max_tokens beyond the context are a 400 in OpenAI's
error shape naming what is wrong; without the --api-key, a 401 (compared in constant time); with
--max-queue requests already waiting, a 503 with Retry-After. A client that leaves a stream aborts
its request (AsyncLLM frees its blocks); an error inside one request fails only that one (500).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...chat_template import ChatTemplateError, has_template, prompt_ids
from ...errors import InputError
from ...runtime.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from ...runtime.input_processor import EngineRequest, RequestError
from ...runtime.output_processor import CompletionOutput, RequestOutput
from ...version import __version__
from .chat_choices import ChatChoices
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .reasoning import PARSERS as REASONING_PARSERS
from .request_log import RequestLog
from .tool_calls import PARSERS

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
            503: "ServiceUnavailableError"}.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _now() -> int:
    return int(time.time())


async def news(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[RequestOutput, CompletionOutput,
                                                                            int, int]]:
    """Each completion with something new to send (text, or its finish): (the request's output,
    the completion, characters and tokens already sent), for the stream's deltas."""
    sent: dict[int, tuple[int, int]] = {}
    finished: set[int] = set()  # a finished sibling (n > 1) comes back in every later output
    async for out in stream:
        for c in out.outputs:
            chars, toks = sent.get(c.index, (0, 0))
            if c.index not in finished and (len(c.text) > chars or c.finish_reason is not None):
                sent[c.index] = (len(c.text), len(c.token_ids))
                if c.finish_reason is not None:
                    finished.add(c.index)
                yield out, c, chars, toks


async def all_or_none(aws: list) -> list:
    """The results of aws run together; if one fails (or the caller is cancelled) the others are
    cancelled, which closes their engine streams and so aborts their requests (gather alone would
    leave them generating, holding their KV blocks)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def merged(streams: list[tuple[object, AsyncIterator]]) -> AsyncIterator[tuple[object, object]]:
    """(key, item) from several async iterators as their items come (the prompts of one request run
    as one batch). Leaving early (a client gone) cancels every pump, which closes the engine streams
    and so aborts their requests."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(key, items):
        try:
            async for item in items:
                await queue.put((key, item, None))
            await queue.put((key, done, None))
        except Exception as e:  # noqa: BLE001  the consumer raises it
            await queue.put((key, None, e))

    tasks = [asyncio.ensure_future(pump(key, items)) for key, items in streams]
    try:
        left = len(tasks)
        while left:
            key, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                left -= 1
                continue
            yield key, item
    finally:
        for t in tasks:
            t.cancel()


class Server:
    """The API's handlers around one engine (one model)."""

    def __init__(self, engine: AsyncLLM, served_model_name: str, api_key: str | None = None,
                 max_queue: int | None = None, request_log: RequestLog | None = None, tool_parser=None,
                 reasoning_parser=None):
        self.engine = engine
        self.tool_parser = tool_parser  # tool_choice "auto" reads calls from the text with it
        self.reasoning_parser = reasoning_parser  # splits a thinking model's thought from its answer
        self.request_log = request_log
        self.model_name = served_model_name
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_model_len = engine.max_model_len

    # -- checks at the edge ------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        want = f"Bearer {self.api_key}"
        if not hmac.compare_digest(given.encode(), want.encode()):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)")

    def check_model(self, body) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}", "model")

    def admit(self, body) -> None:
        self.check_model(body)
        waiting = self.engine.num_waiting_requests()
        if self.max_queue is not None and waiting >= self.max_queue:
            raise ApiError(503, f"{waiting} requests are waiting (--max-queue {self.max_queue}); retry shortly",
                           headers={"Retry-After": "1"})
        if self.engine.dead is not None:
            raise ApiError(503, f"the engine stopped: {self.engine.dead!r}")

    def token_ids(self, prompt: str | list[int]) -> list[int]:
        try:  # the engine's own check (token ids inside the vocabulary), before any stream starts
            return self.engine.prompt_ids(prompt)
        except InputError as e:
            raise ApiError(400, str(e), "prompt") from e

    def max_tokens(self, requested: int | None, prompt_len: int, field: str, prompt_field: str = "prompt") -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(400, f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                                f"has {prompt_len}", prompt_field)
        if requested is None:
            return room
        if requested < 1:
            raise ApiError(400, f"{field} must be at least 1, got {requested}", field)
        if requested > room:
            raise ApiError(400, f"this model's maximum context length is {self.max_model_len} tokens; you asked "
                                f"for {prompt_len + requested} ({prompt_len} in the prompt, {requested} in "
                                f"the completion): lower {field}", field)
        return requested

    # -- completions -------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest):
        """/v1/completions. The prompts of one request run together (a batch, as in vLLM). With
        echo each choice's text (and, with logprobs, its logprobs) starts with the prompt's, as
        vLLM's; echo with max_tokens 0 returns the prompt alone (the engine computes one token it
        does not send: completion_tokens 0, finish_reason that token's). lm-eval's local-completions
        scores a continuation with echo, logprobs and max_tokens 1, dropping the last entry."""
        self.admit(body)
        if body.suffix:
            raise ApiError(400, "suffix is not supported (no insertion here)", "suffix")
        if body.best_of is not None and body.best_of not in (1, body.n):
            raise ApiError(400, f"best_of={body.best_of} is not supported (vLLM V1 dropped it too): ask for n "
                                "completions with logprobs and rank them by their sum", "best_of")
        raw = body.prompts()
        prompts = [self.token_ids(p) for p in raw]
        if not prompts:
            raise ApiError(400, "prompt is empty", "prompt")
        echo_only = body.echo and body.max_tokens == 0
        tok = self.engine.tokenizer
        base = f"cmpl-{uuid.uuid4().hex}"
        streams = []
        for i, (ids, p) in enumerate(zip(prompts, raw)):
            max_tokens = self.max_tokens(1 if echo_only else body.max_tokens, len(ids), "max_tokens")
            params = self._params(body, max_tokens, body.logprobs,
                                  prompt_logprobs=body.logprobs if body.echo else None)
            request = self._request(body, ids, params, self._structured_field(body))
            echo = (p if isinstance(p, str) else tok.decode(ids)) if body.echo else None
            streams.append((i, ids, echo, self.engine.generate(request, request_id=f"{base}-{i}")))
        if body.stream:
            return self._sse(self._stream_completions(base, body, streams, echo_only))
        finals = await all_or_none([self._last(stream) for *_, stream in streams])
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for (i, ids, echo, _), final in zip(streams, finals):
            usage["prompt_tokens"] += len(ids)
            for c in final.outputs:
                usage["completion_tokens"] += 0 if echo_only else len(c.token_ids)
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(c, len(c.token_ids) if echo_only else 0,
                                                         (ids, final.prompt_logprobs) if body.echo else None,
                                                         offset=len(echo or ""))
                choices.append({"index": i * body.n + c.index, "logprobs": logprobs,
                                "text": (echo or "") + ("" if echo_only else c.text), "finish_reason": c.finish_reason})
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        self._log("/v1/completions", body, [{"index": c["index"], "text": c["text"],
                                             "finish_reason": c["finish_reason"]} for c in choices], usage)
        return {"id": base, "object": "text_completion", "created": _now(), "model": self.model_name,
                "choices": choices, "usage": usage}

    async def _stream_completions(self, base: str, body: CompletionRequest, streams,
                                  echo_only: bool) -> AsyncIterator[dict]:
        usage = {"prompt_tokens": sum(len(ids) for _, ids, _, _ in streams), "completion_tokens": 0}
        texts: dict[int, dict] = {}
        prompts = {i: (ids, echo) for i, ids, echo, _ in streams}
        echoed: set[int] = set()

        def chunk(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
            return {"id": base, "object": "text_completion", "created": _now(), "model": self.model_name,
                    "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}

        # the prompts' choices interleaved as their tokens come
        async for i, (out, c, chars, toks) in merged([(i, news(stream)) for i, _, _, stream in streams]):
            ids, echo = prompts[i]
            index = i * body.n + c.index
            if echo is not None and index not in echoed:  # the prompt first, once its logprobs are known
                echoed.add(index)
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(c, len(c.token_ids), (ids, out.prompt_logprobs))
                if echo_only:
                    texts[index] = {"index": index, "text": echo, "finish_reason": c.finish_reason}
                    yield chunk(index, echo, c.finish_reason, logprobs)
                    continue
                yield chunk(index, echo, None, logprobs)
            elif echo_only:
                continue
            texts[index] = {"index": index, "text": (echo or "") + c.text, "finish_reason": c.finish_reason}
            if c.finish_reason is not None:
                usage["completion_tokens"] += len(c.token_ids)
            logprobs = self._completion_logprobs(c, toks, offset=len(echo or "") + chars) \
                if body.logprobs is not None else None
            yield chunk(index, c.text[chars:], c.finish_reason, logprobs)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        self._log("/v1/completions", body, [texts[k] for k in sorted(texts)], usage)
        if body.stream_options and body.stream_options.include_usage:
            yield {"id": base, "object": "text_completion", "created": _now(), "model": self.model_name,
                   "choices": [], "usage": usage}

    def _completion_logprobs(self, c, start: int = 0, prompt: tuple[list[int], list] | None = None,
                             offset: int = 0) -> dict:
        """OpenAI's completion logprobs of c's tokens from `start` on, after the prompt's (echo:
        (ids, prompt_logprobs); the first token has no logprob, as in vLLM). text_offset: the
        prompt's tokens from 0, the generated ones from `offset` (where they start in the text),
        each the sum of the tokens before it decoded one by one (as vLLM's, an approximation where
        a character spans tokens)."""
        tok = self.engine.tokenizer
        tokens, lps, tops, offsets = [], [], [], []

        def add(t: int, e: dict | None, at: int) -> int:
            text = tok.decode([t])
            tokens.append(text)
            lps.append(None if e is None else e[t])
            tops.append(None if e is None else {tok.decode([k]): v for k, v in e.items()})
            offsets.append(at)
            return at + len(text)

        if prompt is not None:
            p_ids, p_entries = prompt
            at = 0
            for t, e in zip(p_ids, p_entries or [None] * len(p_ids)):
                at = add(t, e, at)
        for t, e in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
            offset = add(t, e, offset)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    # -- chat --------------------------------------------------------------------------------------
    def chat_ids(self, body) -> list[int]:
        """The messages through the model's chat template (with the request's tools and
        chat_template_kwargs), as token ids: qtk.chat_template, the one way qtk applies one."""
        if not has_template(self.engine.tokenizer):
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        if body.continue_final_message and (body.add_generation_prompt or body.messages[-1].role != "assistant"):
            raise ApiError(400, "continue_final_message continues a last assistant message: set "
                                "add_generation_prompt to false and end the messages with the assistant's", "messages")
        try:
            return prompt_ids(self.engine.tokenizer, body.conversation(), tools=body.tool_dicts(),
                              add_generation_prompt=body.add_generation_prompt,
                              continue_final_message=body.continue_final_message, variables=body.chat_template_kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), e.param) from e

    async def chat(self, body: ChatCompletionRequest):
        self.admit(body)
        try:
            forced = body.forced_tools(auto=self.tool_parser is not None)
        except InputError as e:
            raise ApiError(400, str(e), "tool_choice") from e
        auto = self.tool_parser is not None and bool(body.tools) and body.tool_choice in (None, "auto")
        ids = self.chat_ids(body)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, self.max_tokens(requested, len(ids), field, "messages"), top, forced)
        if auto:  # a model's call tags may be special tokens (vLLM's hermes parser keeps them too)
            params = replace(params, skip_special_tokens=False)
        free = params.structured_outputs is None  # a grammar leaves no room for a thought before the answer
        replies = ChatChoices(body, self.tool_parser if auto else None, self.reasoning_parser if free else None)
        request = self._request(body, ids, params, self._structured_field(body, forced), "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self.engine.generate(request, request_id=rid)
        if body.stream:
            return self._sse(self._stream_chat(rid, body, len(ids), stream, replies))
        final = await self._last(stream)
        completion = sum(len(c.token_ids) for c in final.outputs)
        choices = [{"index": c.index, **replies.message(c),
                    "logprobs": self._chat_logprobs(c, body.top_logprobs or 0) if body.logprobs else None}
                   for c in final.outputs]
        usage = {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion}
        self._log("/v1/chat/completions", body, [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
                                                 for c in final.outputs], usage)
        return {"id": rid, "object": "chat.completion", "created": _now(), "model": self.model_name,
                "choices": choices, "usage": usage}

    async def _stream_chat(self, rid: str, body: ChatCompletionRequest, prompt_len: int, stream,
                           replies: ChatChoices) -> AsyncIterator[dict]:
        def chunk(choices, **extra):
            return {"id": rid, "object": "chat.completion.chunk", "created": _now(), "model": self.model_name,
                    "choices": choices, **extra}

        def role():  # as vLLM: with the first token, so a client's time to first chunk is queueing + prefill
            return chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None} for i in range(body.n)])
        completion, texts, started = 0, {}, False
        async for _, c, chars, toks in news(stream):
            if not started:
                started = True
                yield role()
            texts[c.index] = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
            if c.finish_reason is not None:
                completion += len(c.token_ids)
            delta, finish_reason = replies.delta(c, chars)
            logprobs = self._chat_logprobs(c, body.top_logprobs or 0, toks) if body.logprobs else None
            if not delta and finish_reason is None and logprobs is None:
                continue  # "required" tool calls: nothing to send until the list is complete
            yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])
        if not started:
            yield role()
        usage = {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}
        self._log("/v1/chat/completions", body, [texts[k] for k in sorted(texts)], usage)
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=usage)

    def _chat_logprobs(self, c, top: int, start: int = 0) -> dict:
        tok = self.engine.tokenizer

        def entry(t: int, lp: float) -> dict:
            text = tok.decode([t])
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        content = []
        for t, e in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
            ranked = sorted(((k, v) for k, v in e.items()), key=lambda kv: -kv[1])[:top]
            content.append({**entry(t, e[t]), "top_logprobs": [entry(k, v) for k, v in ranked]})
        return {"content": content}

    # -- tokenizer (vLLM's endpoints; lm-eval's remote tokenizer reads them) -----------------------
    def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body)
        tok = self.engine.tokenizer
        if body.messages is not None:
            ids = self.chat_ids(body)
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(tok(body.prompt, add_special_tokens=add).input_ids)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body)
        try:
            ids = self.engine.prompt_ids(body.tokens)
        except InputError as e:
            raise ApiError(400, str(e).replace("of the prompt", "of tokens"), "tokens") from e
        return {"prompt": self.engine.tokenizer.decode(ids)}

    def tokenizer_info(self) -> dict:
        tok = self.engine.tokenizer
        return {"tokenizer_class": type(tok).__name__, "model_max_length": self.max_model_len,
                "vocab_size": self.engine.vocab_size, "chat_template": getattr(tok, "chat_template", None),
                **{name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}}

    # -- plumbing ----------------------------------------------------------------------------------
    def _log(self, endpoint: str, body, choices: list[dict], usage: dict) -> None:
        if self.request_log is not None:
            self.request_log.write(endpoint, body.model_dump(exclude_none=True), choices, usage)

    @staticmethod
    def _structured_field(body, forced_tools=None) -> str:
        """The request's field that constrains the output."""
        return ("tools" if forced_tools is not None else
                "structured_outputs" if body.structured_outputs is not None else "response_format")

    def _params(self, body, max_tokens: int, logprobs: int | None, forced_tools=None,
                prompt_logprobs: int | None = None):
        try:
            structured = forced_tools or body.structured()
        except InputError as e:
            raise ApiError(400, str(e), self._structured_field(body, forced_tools)) from e
        try:  # SamplingParams' own checks
            return body.sampling_params(max_tokens, logprobs, structured, prompt_logprobs)
        except (InputError, ValueError) as e:
            raise ApiError(400, str(e), _named_field(body, e)) from e

    def _request(self, body, ids: list[int], params, structured_field: str,
                 prompt_field: str = "prompt") -> EngineRequest:
        """The request checked once by the engine's InputProcessor (this model's limits, the
        grammar compiled), before any stream starts: what it refuses is a 400 naming the field."""
        try:
            return self.engine.process(body.engine_prompt(ids), params)
        except RequestError as e:
            param = {"prompt": prompt_field, "structured_outputs": structured_field}.get(e.field)
            raise ApiError(400, str(e), param or _named_field(body, e)) from e

    @staticmethod
    async def _last(stream) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        return final

    @staticmethod
    def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
        async def body():
            try:
                async for c in chunks:
                    yield f"data: {json.dumps(c)}\n\n"
            except (InputError, ValueError) as e:  # found once the engine took the request
                yield f"data: {json.dumps(error_body(400, str(e)))}\n\n"
            except Exception as e:  # noqa: BLE001  this request fails, the server goes on
                log.exception("a streamed request failed")
                yield f"data: {json.dumps(error_body(500, f'{type(e).__name__}: {e}'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")


def _named_field(body, e: Exception) -> str | None:
    """The request field an error names: its message starts with the field's name (top_p must...,
    logprobs=21 is more...), or None."""
    name = str(e).split(" ", 1)[0].split("=", 1)[0]
    return name if name in type(body).model_fields else None


async def until_disconnected(request: Request, handler):
    """The handler's result, unless the client goes away first: then the handler is cancelled,
    which closes its engine streams and so aborts its requests (their KV blocks are freed)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(handler), asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        gone.cancel()
        return work.result()
    work.cancel()
    return Response(status_code=499)  # nobody reads it: the client left


class Authorize:
    """The API key, checked before the body is even read. Plain ASGI: a Starlette BaseHTTPMiddleware
    (`@app.middleware("http")`) hands each chunk of a streamed response from one task to another
    through a memory stream."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            try:
                self.server.authorize(Request(scope))
            except ApiError as e:
                await JSONResponse(error_body(e.status, e.message), status_code=e.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, served_model_name: str, api_key: str | None = None,
              max_queue: int | None = None, log_requests: str | None = None,
              tool_call_parser: str | None = None, chat_template: str | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """The app; tool_call_parser (a name in tool_calls.PARSERS) lets the model choose its tool
    calls (tool_choice "auto"), read from its text by that parser; chat_template (Jinja text)
    replaces the model's own; reasoning_parser (reasoning.PARSERS) splits a thinking model's
    thought (the message's `reasoning`) from its answer."""
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise InputError(f"no tool-call parser {tool_call_parser!r}; qtk has {', '.join(sorted(PARSERS))}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise InputError(f"no reasoning parser {reasoning_parser!r}; qtk has {', '.join(sorted(REASONING_PARSERS))}")
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    server = Server(engine, served_model_name, api_key, max_queue,
                    None if log_requests is None else RequestLog(log_requests),
                    None if tool_call_parser is None else PARSERS[tool_call_parser](),
                    None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser]())
    if engine.metrics is None:
        engine.metrics = Metrics(engine)
    try:
        engine.load_grammar_tokenizer()
    except InputError as e:
        log.warning("structured outputs are unavailable: %s", e)
    app = FastAPI(title="qtk", version=__version__)
    app.state.server = server

    app.add_middleware(Authorize, server=server)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid JSON body")
        return JSONResponse(error_body(400, message, where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):  # an unknown path (404), a wrong method (405)
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, e: EngineDeadError):
        return JSONResponse(error_body(503, str(e)), status_code=503)

    @app.exception_handler(RequestFailedError)
    async def failed(_: Request, e: RequestFailedError):
        return JSONResponse(error_body(500, f"the request failed: {e}"), status_code=500)

    @app.exception_handler(InputError)
    async def bad_input(_: Request, e: InputError):
        return JSONResponse(error_body(400, str(e)), status_code=400)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(500, f"{type(e).__name__}: {e}"), status_code=500)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await until_disconnected(request, server.completions(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await until_disconnected(request, server.chat(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return server.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return server.tokenizer_info()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": _now(),
                                            "owned_by": "qtk", "max_model_len": server.max_model_len}]}

    @app.get("/health")
    async def health():
        return Response(status_code=503 if engine.dead is not None else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    return app
