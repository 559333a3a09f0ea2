"""Shared fixtures: tiny random Llamas (in memory and as an HF dir), the bundled model (slow).

The tiny HF dir carries the bundled model's tokenizer, chat template and a generation config, so
the CLI and the checkpoint writer see everything a real source has; its vocab is the tokenizer's
(49152) with hidden size 64 and tied embeddings, about 3.2M parameters.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

# One intra-op thread unless told otherwise: the models here are small, and on a shared machine
# with more busy processes than cores, torch's OpenMP threads wait on each other at every op
# (a 135M forward measured 0.45 s with 1 thread, 7-11 s with 2).
torch.set_num_threads(int(os.environ.get("QTK_TEST_THREADS", "1")))

from interop import TINY  # noqa: E402  (the tiny Llama of every test, as the peer fixtures build it)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_llama():
    """Factory: a seeded random LlamaForCausalLM (eval mode, float32); same seed -> same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(seed: int = 0, **overrides):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()
        return model

    return make


@pytest.fixture(scope="session")
def bundled_dir():
    """The bundled SmolLM2-135M as an HF dir (converted once into ~/.cache/qtk)."""
    from qtk.loading import BUNDLED, resolve

    try:
        return resolve(BUNDLED)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tokenizer(bundled_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, bundled_dir, tokenizer):
    """An HF model dir: tiny random Llama (vocab = the tokenizer's), tokenizer, chat template,
    generation config; weights stored in float32 so a reload is bit-exact."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**TINY, "vocab_size": len(tokenizer), "tie_word_embeddings": True,
                         "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                         "pad_token_id": tokenizer.pad_token_id})
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                                               max_new_tokens=7)
    model.save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled_dir / name, d / name)
    return d


@pytest.fixture(scope="session")
def bundled_model(bundled_dir):
    """(model, tokenizer) of the bundled model in float32; tests must not modify the model."""
    from qtk.loading import load_model

    return load_model(str(bundled_dir))


@pytest.fixture(scope="session")
def kl_of(tiny_dir):
    """KL divergence of a checkpoint's next-token distributions from tiny_dir's, on 8 windows of 64 tokens
    of the built-in text's evaluation split (no calibration sample is drawn from it)."""
    from qtk.evals.perplexity import eval_windows
    from qtk.loading import load_model

    base, tok = load_model(str(tiny_dir), dtype=torch.float32)
    windows = eval_windows(tok, "builtin", 64, 8)
    with torch.no_grad():
        p = base(windows).logits.log_softmax(-1)

    def kl(path) -> float:
        model, _ = load_model(str(path), dtype=torch.float32)
        with torch.no_grad():
            q = model(windows).logits.log_softmax(-1)
        return (p.exp() * (p - q)).sum(-1).mean().item()

    return kl
