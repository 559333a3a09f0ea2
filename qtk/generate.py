"""`qtk generate`: one prompt through qtk's runtime (the engine `qtk serve` and the gates run)."""
from __future__ import annotations

from .chat_template import has_template
from .errors import InputError


def generate(model_name: str, prompt: str, max_tokens: int = 64, chat: bool = False, temperature: float = 0.0,
             device: str = "cpu", dtype: str = "auto", top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
             **engine_args) -> str:
    """The completion of `prompt` (wrapped in the chat template with chat=True); engine_args are
    LLM's (block_size, max_num_seqs, max_num_batched_tokens, max_model_len, kv_cache_memory,
    enable_prefix_caching, kv_cache_dtype, gpu_memory_utilization)."""
    from .runtime.engine import LLM
    from .runtime.sampling_params import SamplingParams

    if max_tokens <= 0:
        raise InputError(f"--max-tokens must be positive, got {max_tokens}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    llm = LLM(model_name, dtype=dtype, device=device, **engine_args)
    if chat and not has_template(llm.tokenizer):
        raise InputError(f"{model_name} has no chat template: drop --chat to generate from the prompt as written")
    if chat:
        out = llm.chat([{"role": "user", "content": prompt}], params)
    else:
        out = llm.generate([prompt], params)
    return out[0].outputs[0].text
