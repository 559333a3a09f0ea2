"""Messages through a model's chat template, one way for all of qtk: what `qtk serve` does for
/v1/chat/completions and /tokenize, and what LLM.chat, `qtk generate --chat`, the evals, the
benchmarks, calibration's --chat-template and lm-eval's --apply_chat_template do.

The messages (with the tools and extra template variables, e.g. Qwen3's enable_thinking) are
rendered to text by transformers' apply_chat_template, then tokenized without adding special
tokens (the template writes its own), as transformers and vLLM do.
"""
from __future__ import annotations

import functools
import inspect

import jinja2

from .errors import InputError


class ChatTemplateError(InputError):
    """The template refused the messages (or variables that are not template variables were
    given); `param` names the request field at fault, for the server's 400."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
           continue_final_message: bool = False, variables: dict | None = None) -> str:
    """The conversation as the template writes it. `variables` are template variables only:
    apply_chat_template's own parameters (padding, max_length, return_tensors, ...) would reach
    the tokenizer, and one request could pad its prompt to a billion tokens."""
    if not has_template(tokenizer):
        raise ChatTemplateError("this model has no chat template")
    variables = variables or {}
    taken = sorted(set(variables) & (_template_parameters(tokenizer) | {"messages", "conversation", "tools"}))
    if taken:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(taken)}: they are request fields or "
                                "tokenizer arguments, not template variables", "chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **variables)
    except (jinja2.TemplateError, ValueError, TypeError) as e:  # the template's own checks (roles alternate...)
        raise ChatTemplateError(f"the model's chat template refused these messages: {e}") from e


def prompt_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """render(tokenizer, messages, **kwargs) as token ids: the prompt a chat request runs."""
    return list(tokenizer(render(tokenizer, messages, **kwargs), add_special_tokens=False).input_ids)


@functools.lru_cache(maxsize=None)
def _template_parameters(tokenizer) -> frozenset[str]:
    return frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
