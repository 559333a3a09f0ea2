"""`qtk generate`: one prompt through qtk's runtime (the engine `qtk serve` and the gates run)."""
from __future__ import annotations

from .chat_template import has_template
from .errors import InputError
from .runtime.config import EngineConfig


def generate(engine: EngineConfig | str, prompt: str, max_tokens: int = 64, chat: bool = False,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
             **options) -> str:
    """The completion of `prompt` (wrapped in the chat template with chat=True) on the engine
    `engine` describes, or a model name or path with EngineConfig's `options` (as LLM takes them)."""
    from .runtime.engine import LLM
    from .runtime.sampling_params import SamplingParams

    config = engine if isinstance(engine, EngineConfig) and not options else EngineConfig(engine, **options)
    if max_tokens <= 0:
        raise InputError(f"--max-tokens must be positive, got {max_tokens}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    llm = LLM(config=config)
    if chat and not has_template(llm.tokenizer):
        raise InputError(f"{config.model} has no chat template: drop --chat to generate from the prompt as written")
    if chat:
        out = llm.chat([{"role": "user", "content": prompt}], params)
    else:
        out = llm.generate([prompt], params)
    return out[0].outputs[0].text
