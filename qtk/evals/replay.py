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


def load_requests(path: str | Path, limit: int | None = None) -> list[dict]:
    """[{"messages": [...]} | {"prompt": text or ids}, "max_tokens": n] from a request log."""
    cases = []
    for n, row in jsonl_rows(path, "request log"):
        body = row.get("request", row) if isinstance(row, dict) else None
        if not isinstance(body, dict) or ("messages" in body) == ("prompt" in body):
            raise InputError(f"{path}:{n}: not an OpenAI request (a completion's prompt or a chat's messages)")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if "messages" in body:
            cases.append({"messages": [{"role": m["role"], "content": _text(m.get("content"))}
                                       for m in body["messages"]], "max_tokens": max_tokens})
            continue
        prompts = body["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        cases += [{"prompt": p, "max_tokens": max_tokens} for p in prompts]
    if not cases:
        raise InputError(f"{path}: no requests to replay")
    return cases[:limit] if limit is not None else cases


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def prompt_ids(llm, case: dict) -> list[int]:
    if "messages" in case:
        if not getattr(llm.tokenizer, "chat_template", None):
            raise InputError("the request log holds chat requests but the model has no chat template")
        return list(llm.tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
    p = case["prompt"]
    return list(p) if isinstance(p, list) else llm.tokenizer(p).input_ids


def replay(llm, cases: list[dict], max_tokens: int = 128, reference: list[list[int]] | None = None) -> dict:
    """Greedy responses to every case (one batch); with `reference` (the baseline's responses) the
    three agreement numbers of the module docstring. Returns the metrics and "_responses"."""
    from ..runtime.sampling_params import SamplingParams

    prompts = [prompt_ids(llm, c) for c in cases]
    params = [SamplingParams(max_tokens=min(c.get("max_tokens") or max_tokens, max_tokens), temperature=0)
              for c in cases]
    responses = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if reference is None:
        return {"agreement": 1.0, "first_divergence": 1.0, "top1_agreement": 1.0, "_responses": responses}
    if len(reference) != len(responses):
        raise InputError("the baseline's responses do not match this request log (rerun with --no-cache)")
    same = sum(r == b for r, b in zip(responses, reference))
    parts = []
    for r, b in zip(responses, reference):
        first = next((i for i, (x, y) in enumerate(zip(r, b)) if x != y), min(len(r), len(b)))
        parts.append(1.0 if r == b else first / max(1, len(b)))
    # teacher-forced: the candidate reads prompt + the baseline's response; its top-1 at each position
    forced = [p + b for p, b in zip(prompts, reference) if b]
    outs = llm.generate(forced, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)) if forced else []
    hits = total = 0
    for p, b, out in zip((p for p, b in zip(prompts, reference) if b), (b for b in reference if b), outs):
        for i, token in enumerate(b):
            entry = out.prompt_logprobs[len(p) + i]
            top = max(entry.items(), key=lambda kv: kv[1])[0]
            hits += top == token
            total += 1
    return {"agreement": same / len(responses), "first_divergence": sum(parts) / len(parts),
            "top1_agreement": hits / total if total else 1.0, "_responses": responses}
