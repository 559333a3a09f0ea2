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
from .cases import check_max_tokens, check_messages, check_prompt, prompt_ids

MATCHES = ("exact", "contains")
KEYS = ("id", "prompt", "messages", "answer", "match", "max_tokens")


def load_cases(path: str | Path, limit: int | None = None) -> list[dict]:
    rows = [_case(f"{path}:{n}", n, row) for n, row in jsonl_rows(path, "task file")]
    if not rows:  # an accuracy over no cases would pass any gate
        raise InputError(f"{path}: no cases (each line a JSON object with prompt or messages, and answer)")
    return rows[:limit] if limit is not None else rows


def _case(where: str, n: int, row) -> dict:
    """One line, every field checked: the error names FILE:LINE."""
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise InputError(f"{where}: give exactly one of prompt (text) or messages (a chat)")
    unknown = set(row) - set(KEYS)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(KEYS)}")
    if not isinstance(row.get("answer"), str) or not row["answer"].strip():
        raise InputError(f"{where}: answer (the expected text) is missing or empty")
    if row.get("match", "exact") not in MATCHES:
        raise InputError(f"{where}: match must be exact or contains, not {row['match']!r}")
    if "messages" in row:
        check_messages(where, row["messages"])
    else:
        check_prompt(where, row["prompt"])
    check_max_tokens(where, row.get("max_tokens"))
    return {"id": row.get("id", f"line-{n}"), **row, "where": where}


def matches(text: str, expected: str, how: str = "exact") -> bool:
    return text.strip() == expected.strip() if how == "exact" else expected.strip() in text


def run_cases(llm, rows: list[dict]) -> dict:
    """{"accuracy": share matched, "answers": [...]} for every case, greedily, in one batch."""
    from ..runtime.sampling_params import SamplingParams

    prompts = [prompt_ids(llm, r) for r in rows]  # every case checked before any runs
    params = [SamplingParams(max_tokens=r.get("max_tokens") or 64, temperature=0) for r in rows]
    outs = llm.generate(prompts, params) if rows else []
    answers = [{"id": r["id"], "text": o.outputs[0].text, "expected": r["answer"],
                "matched": matches(o.outputs[0].text, r["answer"], r.get("match", "exact"))} for r, o in zip(rows, outs)]
    return {"accuracy": sum(a["matched"] for a in answers) / max(1, len(answers)), "answers": answers}
