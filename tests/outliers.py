"""Tiny random Llamas with activation outliers, for the smoothing methods' tests (AWQ, SmoothQuant)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(kv_heads=2, seed=0, outlier=None, channel=5):
    """A random 2-layer Llama; with `outlier`, channel `channel` of every norm weight is scaled by it
    (the activation outlier channels real LLMs have)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads)
    model = LlamaForCausalLM(cfg).eval()
    if outlier is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.input_layernorm.weight[channel] *= outlier
                layer.post_attention_layernorm.weight[channel] *= outlier
    return model


def ids(n, seed, length=64):
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits
