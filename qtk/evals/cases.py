"""Cases read from a user's file (a tasks JSONL, a request log): each field checked where it is
read, an error naming FILE:LINE; each prompt checked against the model before any case runs.

A case is a dict with "where" (FILE:LINE), "max_tokens" and either "messages" (a chat, through
the model's chat template) or "prompt" (text or token ids)."""
from __future__ import annotations

from ..chat_template import has_template, prompt_ids as chat_ids
from ..errors import InputError


def check_messages(where: str, messages) -> list[dict]:
    """A chat: a non-empty list of {"role": str, "content": str, ...}."""
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: messages[{i}] must be an object with string role and content, got {m!r}"[:300])
    return messages


def check_prompt(where: str, prompt) -> str | list[int]:
    """A completion's prompt: non-empty text or a non-empty list of token ids."""
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise InputError(f"{where}: prompt must be non-empty text or a list of token ids, got {prompt!r}"[:300])


def check_max_tokens(where: str, value, name: str = "max_tokens") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return value


def prompt_ids(llm, case: dict) -> list[int]:
    """The case's prompt as token ids (a chat through the template), checked against the
    vocabulary and the context: the error names the case's FILE:LINE."""
    where = case.get("where", "a case")
    if "messages" in case:
        if not has_template(llm.tokenizer):
            raise InputError(f"{where}: a chat (messages) but the model has no chat template")
        try:
            ids = chat_ids(llm.tokenizer, case["messages"])
        except InputError as e:
            raise InputError(f"{where}: {e}") from e
    else:
        try:
            ids = llm.prompt_ids(case["prompt"])
        except InputError as e:
            raise InputError(f"{where}: {e}") from e
    if len(ids) >= llm.max_model_len:
        raise InputError(f"{where}: the prompt has {len(ids)} tokens; it must be shorter than the context "
                         f"(max_model_len {llm.max_model_len}) to leave room for an answer: shorten it")
    return ids
