"""Replay: the user's own traffic, offline, as a shadow deployment would see it.

A JSONL of OpenAI-format requests (what `qtk serve --log-requests` writes: {"endpoint",
"request", "response"} per line; or bare request bodies) is replayed greedily on the baseline and
on the candidate, whatever sampling the requests asked for (greedy is what makes two models
comparable token by token). A chat request goes through the model's chat template; a completion's
prompt (text, token ids, or a list of them: one case each) as given; max_tokens as the request
asked, capped by `max_tokens`. Three numbers, candidate against baseline:

  agreement        share of responses whose tokens are identical
  first_divergence mean position of the first differing token, as a share of the baseline
                   response's length (1.0 for an identical response): how early answers part
  top1_agreement   teacher-forced along the baseline's response: the share of positions where the
                   candidate's most likely next token is the baseline's token (the baseline's
                   greedy choice), over all responses: agreement that one early flip cannot hide
The baseline's own run scores 1.0 on all three.
"""
from __future__ import annotations

from pathlib import Path

from ..data import jsonl_rows
from ..errors import InputError
from . import bootstrap
from .cases import check_max_tokens, check_messages, check_prompt, prompt_ids


def load_requests(path: str | Path, limit: int | None = None) -> list[dict]:
    """[{"messages": [...]} | {"prompt": text or ids}, "max_tokens": n, "where": FILE:LINE] from a
    request log, every field checked (the error names FILE:LINE)."""
    cases = []
    for n, row in jsonl_rows(path, "request log"):
        cases += _request_cases(f"{path}:{n}", row)
    if not cases:
        raise InputError(f"{path}: no requests to replay")
    return cases[:limit] if limit is not None else cases


def _request_cases(where: str, row) -> list[dict]:
    """The cases of one logged request: a chat is one, a completion one per prompt."""
    body = row.get("request", row) if isinstance(row, dict) else None
    if not isinstance(body, dict) or ("messages" in body) == ("prompt" in body):
        raise InputError(f"{where}: not an OpenAI request (a completion's prompt or a chat's messages)")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = check_max_tokens(where, body.get(name), name)
    if "messages" in body:
        return [{"messages": _messages(where, body["messages"]), "max_tokens": max_tokens, "where": where}]
    prompts = body["prompt"]
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise InputError(f"{where}: prompt must be text, token ids, or a non-empty list of them, got {prompts!r}"[:300])
    return [{"prompt": check_prompt(where, p), "max_tokens": max_tokens, "where": where} for p in prompts]


def _messages(where: str, messages) -> list[dict]:
    """OpenAI messages as {role, content} text (content parts joined; no content is "")."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InputError(f"{where}: messages must be a list of {{role, content}} objects")
    return check_messages(where, [{"role": m.get("role"), "content": _text(m.get("content"))} for m in messages])


def _text(content):
    """Text content parts joined; content that is not text is returned as it is, for
    check_messages to name."""
    if isinstance(content, list):  # content parts
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(texts) if all(isinstance(t, str) for t in texts) else content
    return content if content is not None else ""


def replay(llm, cases: list[dict], max_tokens: int = 128, reference: list[list[int]] | None = None) -> dict:
    """Greedy responses to every case (one batch); with `reference` (the baseline's responses) the
    three agreement numbers of the module docstring. Returns the metrics and "_responses"."""
    from ..runtime.sampling_params import SamplingParams

    prompts = [prompt_ids(llm, c) for c in cases]  # every case checked before any runs
    params = [SamplingParams(max_tokens=min(c.get("max_tokens") or max_tokens, max_tokens), temperature=0)
              for c in cases]
    responses = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if reference is None:  # the baseline against itself, per request as the candidate's units
        units = {"agreement": bootstrap.units("mean", [1] * len(responses)),
                 "first_divergence": bootstrap.units("mean", [1.0] * len(responses)),
                 "top1_agreement": bootstrap.units("ratio", [[1, 1]] * len(responses))}
        return {"agreement": 1.0, "first_divergence": 1.0, "top1_agreement": 1.0, "_responses": responses,
                "_units": units}
    if len(reference) != len(responses):
        raise InputError("the baseline's responses do not match this request log (rerun with --no-cache)")
    same = [int(r == b) for r, b in zip(responses, reference)]
    parts = []
    for r, b in zip(responses, reference):
        first = next((i for i, (x, y) in enumerate(zip(r, b)) if x != y), min(len(r), len(b)))
        parts.append(1.0 if r == b else first / max(1, len(b)))
    hits = top1_hits(llm, prompts, reference)
    units = {"agreement": bootstrap.units("mean", same), "first_divergence": bootstrap.units("mean", parts),
             "top1_agreement": bootstrap.units("ratio", hits)}
    return {"agreement": sum(same) / len(same), "first_divergence": sum(parts) / len(parts),
            "top1_agreement": top1_agreement(hits), "_responses": responses, "_units": units}


def top1_agreement(hits: list[list[int]]) -> float:
    """The share of response positions where the candidate's top-1 was the baseline's token."""
    total = sum(n for _, n in hits)
    return sum(h for h, _ in hits) / total if total else 1.0


def top1_hits(llm, prompts: list[list[int]], reference: list[list[int]]) -> list[list[int]]:
    """Teacher-forced: the engine reads prompt + the baseline's response; per response [positions
    where its top-1 is the baseline's token, positions]. A response is cut to fit the context with
    the slot the engine keeps for the token it samples (a baseline answer that ran into
    max_model_len would otherwise make the forced prompt too long)."""
    from ..runtime.sampling_params import SamplingParams

    pairs = [(p, b[:llm.max_model_len - len(p) - 1]) for p, b in zip(prompts, reference)]
    forced = [k for k, (p, b) in enumerate(pairs) if b]
    outs = llm.generate([pairs[k][0] + pairs[k][1] for k in forced],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)) if forced else []
    hits = [[0, 0] for _ in pairs]
    for k, out in zip(forced, outs):
        p, b = pairs[k]
        for i, token in enumerate(b):
            entry = out.prompt_logprobs[len(p) + i]
            hits[k][0] += max(entry.items(), key=lambda kv: kv[1])[0] == token
            hits[k][1] += 1
    return hits
