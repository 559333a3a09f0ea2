"""Text generation with a float or quantized model (transformers' generate over QuantLinear layers).

qtk's own paged runtime replaces this for serving; this is the simple path the CLI and demo use."""
from __future__ import annotations

import torch

from .models import load_model
from .device import choose_dtype
from .errors import InputError


def generate(model_name: str, prompt: str, max_tokens: int = 64, chat: bool = False, temperature: float = 0.0,
             device: str = "cpu", dtype: str = "auto") -> str:
    if max_tokens <= 0:
        raise InputError(f"--max-tokens must be positive, got {max_tokens}")
    model, tok = load_model(model_name, dtype=choose_dtype(dtype, device).dtype, device=device)
    if chat:
        if not getattr(tok, "chat_template", None):
            raise InputError(f"{model_name} has no chat template; drop --chat")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    ids = ids.to(device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id, **sampling)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
