"""The Llama family over a packed, ragged batch (no padding): Llama 2/3, SmolLM, Mistral, Qwen2
(q/k/v bias), Qwen3 (q/k RMSNorm per head); Mixtral and Qwen3-MoE, their MoE blocks by models/moe.py.

    h = embed(tokens)                                             [T, hidden]
    per layer:  x = rmsnorm(h); q, k, v = x Wq, x Wk, x Wv (+ bias)   [T, heads | kv_heads, D]
                (qwen3: q, k = rmsnorm_head(q), rmsnorm_head(k))
                q, k = rope(q, k, positions)
                h = h + Wo paged_attention(q, k, v, window)           (writes k, v to the cache)
                h = h + W_down (silu(x W_gate) * x W_up),  x = rmsnorm(h)
    logits = lm_head(rmsnorm(h)[last token of each sampling sequence])

The weights are those of the loaded Hugging Face model (a float checkpoint, or one qtk's loader
filled with QuantLinear layers): this module shares its Linear / QuantLinear, norm and embedding
modules, and its rotary module computes the frequencies for every RoPE scaling type the config
names, once at load for the longest sequence (`frozen_rope`). What is ours is the packing and the
paged attention, sliding windows included (`sliding_windows`). Adding a family is a row in
FAMILIES plus what is truly new about it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention import AttentionMetadata, KVCache, paged_attention
from . import moe


@dataclass(frozen=True)
class Family:
    qk_norm: bool = False  # q_norm / k_norm over head_dim before RoPE (Qwen3)


FAMILIES = {"llama": Family(), "mistral": Family(), "qwen2": Family(), "qwen3": Family(qk_norm=True),
            "mixtral": Family(), "qwen3_moe": Family(qk_norm=True)}  # MoE blocks: models/moe.py
# sibling projections the engine may fuse into one matmul (packed_linear.pack_linears)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def sliding_windows(cfg) -> list[int | None]:
    """Per layer, the sliding window (a query sees its last `window` keys, itself included) or None,
    as transformers and vLLM read the config: with `layer_types` (Qwen2/Qwen3: use_sliding_window
    and max_window_layers) on the layers of type "sliding_attention", else (Mistral) on every layer."""
    window, n = getattr(cfg, "sliding_window", None), cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * n
    return [window if t == "sliding_attention" else None for t in types]


def frozen_rope(rotary: nn.Module, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2], attention scaling) of transformers' rotary module for a sequence of
    max_positions tokens, fixed at load. Per forward it picks them by that forward's last position
    ("longrope": short or long factors; "dynamic": grown past max_position_embeddings), which here
    would make a token's RoPE depend on the chunk and the batch it runs in, and differ from its
    cached keys'. vLLM fixes them at load too (longrope: the long factors where max_model_len >
    original_max_position_embeddings; the engine's max_model_len is at most max_positions)."""
    inv_freq = rotary.inv_freq
    rotary(torch.zeros(1, device=inv_freq.device), torch.tensor([[max_positions - 1]], device=inv_freq.device))
    return rotary.inv_freq.detach().float().clone(), rotary.attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaModel(nn.Module):
    why_no_graphs = None  # the decode step is captured (runtime/cuda_graphs.py)

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        cfg = hf_model.config
        if cfg.model_type not in FAMILIES:
            raise ValueError(f"the qtk runtime runs model_type {sorted(FAMILIES)}, not {cfg.model_type!r}")
        self.config = cfg
        self.family = FAMILIES[cfg.model_type]
        base = hf_model.model
        self.embed_tokens, self.layers, self.norm = base.embed_tokens, base.layers, base.norm
        self.rotary_emb, self.lm_head = base.rotary_emb, hf_model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.windows = sliding_windows(cfg)
        inv_freq, self.rope_scaling = frozen_rope(self.rotary_emb, cfg.max_position_embeddings)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.cpu_ops = self._cpu_ops()
        if moe.install(self.layers, cfg, self.cpu_ops):  # each MoE layer's mlp now a SparseMoE over [T, H]
            self.why_no_graphs = moe.WHY_NO_GRAPHS
        self._plan = None  # per layer, the projections' callables (built at the first fused forward)

    def _cpu_ops(self):
        """qtk's fused CPU ops (kernels/csrc/cpu_layers.cpp) for a float32 model on CPU, or None."""
        from ...kernels import cpu as cpu_kernels

        w = self.embed_tokens.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or getattr(self.config, "hidden_act", "silu") != "silu":
            return None
        return cpu_kernels.ops()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def attentions(self) -> list[nn.Module]:
        """Per layer, the attention module (it owns the checkpoint's k_scale / v_scale)."""
        return [layer.self_attn for layer in self.layers]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of positions [T]: transformers' rotary forward over the frozen frequencies."""
        freqs = positions[:, None].float() * self.rope_inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (normed)."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        if self.cpu_ops is not None and meta.backend == "cpu":
            return self._forward_fused(h, cos, sin, meta, kv_caches)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
        for layer, cache, window in zip(self.layers, kv_caches, self.windows):
            h = h + self._attention(layer.self_attn, layer.input_layernorm(h), cos, sin, meta, cache, window)
            h = h + self._mlp(layer.mlp, layer.post_attention_layernorm(h))
        return self.norm(h)

    def _attention(self, attn, x, cos, sin, meta, cache, window) -> torch.Tensor:
        T = x.shape[0]
        if hasattr(attn, "qkv_proj"):  # fused by the engine
            q, k, v = attn.qkv_proj(x).split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                              self.num_kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.family.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = paged_attention(q, k, v, cache, meta, self.scale, window=window)
        return attn.o_proj(o.reshape(T, self.num_heads * self.head_dim))

    def _forward_fused(self, h, cos, sin, meta, kv_caches) -> torch.Tensor:
        """forward() with qtk's fused CPU ops: the same math in a fifth of the calls. The residual
        stream h is added to and normalized in one op (add_rms_norm_), RoPE rotates q and k in
        place in the projection's output, SiLU-and-multiply is one op; the projections qtk's
        kernel runs are called directly (a plan built once: at batch 1 a step is ~300 calls, and
        Python's module machinery would cost as much as the attention)."""
        ops = self.cpu_ops
        if self._plan is None:
            self._plan = [self._layer_plan(layer) for layer in self.layers]
            norm = lambda n: (n.weight, n.variance_epsilon)  # noqa: E731
            self._norms = [norm(layer.input_layernorm) for layer in self.layers] + [norm(self.norm)]
            self._post_norms = [norm(layer.post_attention_layernorm) for layer in self.layers]
        T, H, KV, D = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk_norm, norms, heads = self.family.qk_norm, self._norms, [H, KV, KV]
        x = ops.rms_norm(h, *norms[0])
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            qkv, q_proj, k_proj, v_proj, o_proj, gate_up, down = self._plan[i]
            attn = layer.self_attn
            if qkv is not None:
                y = qkv(x)
                q, k, v = y.view(T, H + 2 * KV, D).split_with_sizes(heads, 1)  # views of y, one call
            else:
                q, k, v = q_proj(x).view(T, H, D), k_proj(x).view(T, KV, D), v_proj(x).view(T, KV, D)
            if qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            if qkv is not None and not qk_norm:  # q and k side by side in each row: one pass
                ops.rope_(y, cos, sin, H + KV)
            else:  # in place, through 2-D views
                ops.rope_(q.view(T, H * D), cos, sin, H)
                ops.rope_(k.view(T, KV * D), cos, sin, KV)
            o = paged_attention(q, k, v, cache, meta, self.scale, ops, self.windows[i])
            x = ops.add_rms_norm_(h, o_proj(o.view(T, H * D)), *self._post_norms[i])
            m = down(ops.silu_and_mul(gate_up(x))) if gate_up is not None else layer.mlp(x)
            x = ops.add_rms_norm_(h, m, *norms[i + 1])
        return x

    @staticmethod
    def _layer_plan(layer) -> tuple:
        """(qkv, q, k, v, o, gate_up, down): a callable per projection (the kernel itself for the
        ones qtk's CPU kernel runs, else the module), None where fused or unfused away."""
        from ..packed_linear import KernelLinear

        def fn(module):
            return None if module is None else module.direct() if isinstance(module, KernelLinear) else module

        attn, mlp = layer.self_attn, layer.mlp
        get = lambda m, name: getattr(m, name, None)  # noqa: E731
        return (fn(get(attn, "qkv_proj")), fn(get(attn, "q_proj")), fn(get(attn, "k_proj")), fn(get(attn, "v_proj")),
                fn(attn.o_proj), fn(get(mlp, "gate_up_proj")), fn(get(mlp, "down_proj")))

    @staticmethod
    def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
        if hasattr(mlp, "gate_up_proj"):  # fused by the engine
            gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
            return mlp.down_proj(mlp.act_fn(gate) * up)
        return mlp(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
