"""A team's own cases: a JSONL of prompts with the answers the business needs, gated like any task.

Each line: {"prompt": TEXT} (a completion) or {"messages": [{"role", "content"}, ...]} (a chat,
through the model's template), "answer": the expected text, and optionally "match": "exact" (the
default: the answer, stripped, equals the expected text) or "contains" (the expected text appears
in the answer), "max_tokens" (default 64) and "id". Every case runs greedily, in one batch on
qtk's runtime; the metric is the share matched.
"""
from __future__ import annotations

from pathlib import Path

from ..data import jsonl_rows
from ..errors import InputError

MATCHES = ("exact", "contains")


def load_cases(path: str | Path, limit: int | None = None) -> list[dict]:
    rows = []
    for n, row in jsonl_rows(path, "task file"):
        where = f"{path}:{n}"
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise InputError(f"{where}: give exactly one of prompt (text) or messages (a chat)")
        if not isinstance(row.get("answer"), str) or not row["answer"].strip():
            raise InputError(f"{where}: answer (the expected text) is missing or empty")
        if row.get("match", "exact") not in MATCHES:
            raise InputError(f"{where}: match must be exact or contains, not {row['match']!r}")
        unknown = set(row) - {"id", "prompt", "messages", "answer", "match", "max_tokens"}
        if unknown:
            raise InputError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: id, prompt, messages, answer, "
                             "match, max_tokens")
        rows.append({"id": row.get("id", f"line-{n}"), **row})
    return rows[:limit] if limit is not None else rows


def matches(text: str, expected: str, how: str = "exact") -> bool:
    return text.strip() == expected.strip() if how == "exact" else expected.strip() in text


def run_cases(llm, rows: list[dict]) -> dict:
    """{"accuracy": share matched, "answers": [...]} for every case, greedily, in one batch."""
    from ..runtime.sampling_params import SamplingParams

    prompts = []
    for r in rows:
        if "messages" in r:
            if not getattr(llm.tokenizer, "chat_template", None):
                raise InputError(f"case {r['id']} is a chat (messages) but the model has no chat template")
            prompts.append(list(llm.tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True,
                                                                  tokenize=True, return_dict=True)["input_ids"]))
        else:
            prompts.append(llm.tokenizer(r["prompt"]).input_ids)
    params = [SamplingParams(max_tokens=r.get("max_tokens", 64), temperature=0) for r in rows]
    outs = llm.generate(prompts, params) if rows else []
    answers = [{"id": r["id"], "text": o.outputs[0].text, "expected": r["answer"],
                "matched": matches(o.outputs[0].text, r["answer"], r.get("match", "exact"))} for r, o in zip(rows, outs)]
    return {"accuracy": sum(a["matched"] for a in answers) / max(1, len(answers)), "answers": answers}
